"""Shared host pools and the row copier on the CPU: pools created by one process, attached and
filled by another (every byte checked), refusals (bad rows, wrong size, owner or name, full
directory), close/unlink, exit cleanup and the find() registry."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvwire_hisparse import shm
from kvwire_hisparse.copier import RowCopier
from kvwire_hisparse.shm import SharedHostPool, host_identity

from kvwire.errors import ConfigError, DescriptorError, LayoutError, TransferError
from kvwire.layout import MemKind, MemoryRegion

CTX = mp.get_context("spawn")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# ---------------------------------------------------------------------- a fill plan both sides know
def _sources(seed: int, nreg: int, reg_len: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=reg_len, dtype=np.uint8) for _ in range(nreg)]


def _plan(
    seed: int,
    nreg: int,
    reg_len: int,
    pool_sizes: list[int],
    row_len: int,
    nrows: int,
    skew: int,
    contiguous: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows as (source region, source offset, pool, pool offset): ``skew`` shifts every offset
    off the row grid (0 keeps them aligned); destinations never overlap. ``contiguous``: four
    runs of consecutive rows (region i -> pool i % 2) instead of scattered rows."""
    rng = np.random.default_rng(seed + 1)
    if contiguous:
        k = nrows // 4
        blk = np.repeat(np.arange(4), k)
        within = np.tile(np.arange(k), 4) * row_len + skew
        pool = blk % 2
        d_off = within + (blk // 2) * k * row_len
        return blk % nreg, within, pool, d_off
    per_reg = (reg_len - skew) // row_len
    reg = rng.integers(0, nreg, size=nrows)
    s_off = rng.integers(0, per_reg, size=nrows) * row_len + skew
    slots = [(p, k) for p, size in enumerate(pool_sizes) for k in range((size - skew) // row_len)]
    pick = rng.choice(len(slots), size=nrows, replace=False)
    pool = np.array([slots[i][0] for i in pick])
    d_off = np.array([slots[i][1] for i in pick]) * row_len + skew
    return reg, s_off, pool, d_off


def _child_fill(
    descs: list[dict[str, Any]], spec: dict[str, Any], conn: Any
) -> None:  # runs in a spawned prefill-like process
    try:
        logging.basicConfig(level=logging.DEBUG)
        srcs = _sources(spec["seed"], spec["nreg"], spec["reg_len"])
        regions = [MemoryRegion.from_pointer(int(a.ctypes.data), a.nbytes, 1) for a in srcs]
        pools = [
            (int(d["addr"]), SharedHostPool.attach(d["path"], d["nbytes"], pin=False))
            for d in descs
        ]
        assert all(not p.owner and not p.pinned for _, p in pools)
        assert all(d["identity"] == host_identity() for d in descs)
        copier = RowCopier(regions, pools, dma_min_run_bytes=spec["dma_min_run_bytes"])
        reg, s_off, pool, d_off = _plan(
            spec["seed"],
            spec["nreg"],
            spec["reg_len"],
            [d["nbytes"] for d in descs],
            spec["row_len"],
            spec["nrows"],
            spec["skew"],
            spec.get("contiguous", False),
        )
        starts = np.array([r.addr for r in regions], dtype=np.uint64)
        rbases = np.array([d["addr"] for d in descs], dtype=np.uint64)
        src = starts[reg] + s_off.astype(np.uint64)
        dst = rbases[pool] + d_off.astype(np.uint64)
        job = copier.start(src, dst, spec["row_len"])
        ok = job.done() and job.nbytes == spec["nrows"] * spec["row_len"]
        job.wait(1.0)
        ok = ok and job.num_rows == spec["nrows"]
        copier.close()
        for _, p in pools:
            p.close()
            ok = ok and os.path.exists(p.path)  # attach never unlinks
        conn.send(("ok" if ok else "bad job", None))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _child_exit_without_close(directory: str, conn: Any) -> None:
    pool = SharedHostPool.create(1 << 16, pin=False, directory=directory)
    pool.array()[:10] = 7
    conn.send(pool.path)
    # no close(): the weakref finalizer runs at interpreter exit and unlinks


FILL_CASES = {
    "aligned-scattered": dict(row_len=256, skew=0, dma_min_run_bytes=1 << 20),
    "misaligned-rows": dict(row_len=256, skew=40, dma_min_run_bytes=1 << 20),
    "odd-row-len": dict(row_len=72, skew=3, dma_min_run_bytes=1 << 20),
    "runs": dict(row_len=128, skew=0, dma_min_run_bytes=4096, contiguous=True),
    "misaligned-runs": dict(row_len=96, skew=5, dma_min_run_bytes=4096, contiguous=True),
}


@pytest.mark.parametrize("where", ["dir", "memfd"])
@pytest.mark.parametrize("case", sorted(FILL_CASES))
def test_another_process_fills_the_pools(tmp_path: Path, case: str, where: str) -> None:
    spec: dict[str, Any] = dict(seed=7, nreg=5, reg_len=1 << 15, nrows=300, **FILL_CASES[case])
    directory = str(tmp_path) if where == "dir" else shm.MEMFD
    pools = [
        SharedHostPool.create(size, pin=False, directory=directory) for size in (1 << 16, 40000)
    ]
    try:
        assert all(p.owner and p.array().sum() == 0 for p in pools)
        if where == "dir":
            mode = stat.S_IMODE(os.stat(pools[0].path).st_mode)
            assert mode == 0o600 and os.path.basename(pools[0].path).startswith("kvwire-hisparse-")
            assert len(os.path.basename(pools[0].path)) == len("kvwire-hisparse-") + 32
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_child_fill, args=([p.describe() for p in pools], spec, child))
        proc.start()
        status, err = parent.recv()
        proc.join(30)
        assert status == "ok", err
        assert proc.exitcode == 0

        srcs = _sources(spec["seed"], spec["nreg"], spec["reg_len"])
        reg, s_off, pool, d_off = _plan(
            spec["seed"],
            spec["nreg"],
            spec["reg_len"],
            [p.nbytes for p in pools],
            spec["row_len"],
            spec["nrows"],
            spec["skew"],
            spec.get("contiguous", False),
        )
        rl = spec["row_len"]
        expected = [np.zeros(p.nbytes, dtype=np.uint8) for p in pools]
        for r, so, p, do in zip(reg, s_off, pool, d_off, strict=True):  # test oracle only
            expected[p][do : do + rl] = srcs[r][so : so + rl]
        for p, exp in zip(pools, expected, strict=True):
            assert np.array_equal(p.array(), exp)
    finally:
        for p in pools:
            p.close()
    if where == "dir":
        assert os.listdir(tmp_path) == []


def test_exit_cleans_up_an_unclosed_pool(tmp_path: Path) -> None:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_child_exit_without_close, args=(str(tmp_path), child))
    proc.start()
    path = parent.recv()
    proc.join(30)
    assert proc.exitcode == 0
    assert path.startswith(str(tmp_path)) and not os.path.exists(path)


# ---------------------------------------------------------------------- pools
def test_close_is_idempotent_unlinks_and_find(tmp_path: Path) -> None:
    pool = SharedHostPool.create(1 << 16, pin=False, directory=str(tmp_path))
    other = SharedHostPool.attach(pool.path, pool.nbytes, pin=False)
    assert SharedHostPool.find(pool.addr + 100, 200) is pool
    assert SharedHostPool.find(other.addr, other.nbytes) is other
    assert SharedHostPool.find(pool.addr + pool.nbytes - 10, 20) is None
    assert SharedHostPool.find(pool.addr - 1, 2) is None
    other.array()[5] = 42  # same pages through both mappings
    assert pool.array()[5] == 42
    assert pool.tensor()[5].item() == 42
    d = pool.describe()
    assert d == {
        "path": pool.path,
        "nbytes": 1 << 16,
        "addr": pool.addr,
        "identity": host_identity(),
    }
    other.close()
    other.close()
    assert os.path.exists(pool.path) and SharedHostPool.find(other.addr, 1) is None
    pool.close()
    pool.close()
    assert pool.closed and not os.path.exists(pool.path)
    assert SharedHostPool.find(pool.addr, 1) is None
    with pytest.raises(ConfigError, match="closed"):
        pool.array()


def test_close_with_live_views_unlinks_and_keeps_the_mapping(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = SharedHostPool.create(1 << 16, pin=False, directory=str(tmp_path))
    view = pool.array()[100:200]
    tview = pool.tensor()
    view[:] = 3
    with caplog.at_level(logging.WARNING):
        pool.close()
    assert "views" in caplog.text
    assert not os.path.exists(pool.path)
    assert int(view.sum()) == 300 and int(tview[150].item()) == 3  # still mapped, no crash


def test_env_directory_and_full_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWIRE_SHM_DIR", str(tmp_path))
    with SharedHostPool.create(4096, pin=False) as pool:
        assert os.path.dirname(pool.path) == str(tmp_path)

    real = os.statvfs

    class Tiny:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_frsize = st.f_frsize
            self.f_bavail = 2

    monkeypatch.setattr(shm.os, "statvfs", lambda p: Tiny(real(p)))
    with pytest.raises(ConfigError) as ei:
        SharedHostPool.create(1 << 20)
    msg = str(ei.value)
    assert str(tmp_path) in msg and str(1 << 20) in msg and "KVWIRE_SHM_DIR" in msg
    assert os.listdir(tmp_path) == []
    with pytest.raises(ConfigError, match="does not exist"):
        SharedHostPool.create(4096, directory=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="nbytes > 0"):
        SharedHostPool.create(0)


def test_attach_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = SharedHostPool.create(8192, pin=False, directory=str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="has 8192 bytes, expected 4096"):
            SharedHostPool.attach(pool.path, 4096, pin=False)
        with pytest.raises(ConfigError, match="not a shared host pool"):
            SharedHostPool.attach(str(tmp_path / "notes.txt"), 8192, pin=False)
        with pytest.raises(ConfigError, match="cannot open"):
            SharedHostPool.attach(str(tmp_path / ("kvwire-hisparse-" + "0" * 32)), 8192)
        link = tmp_path / ("kvwire-hisparse-" + "1" * 32)
        link.symlink_to(pool.path)
        with pytest.raises(ConfigError, match="cannot open"):  # O_NOFOLLOW
            SharedHostPool.attach(str(link), 8192, pin=False)
        link.unlink()
        (tmp_path / ("kvwire-hisparse-" + "2" * 32)).mkdir()
        with pytest.raises(ConfigError):
            SharedHostPool.attach(str(tmp_path / ("kvwire-hisparse-" + "2" * 32)), 8192)
        uid = os.geteuid()
        monkeypatch.setattr(shm.os, "geteuid", lambda: uid + 1)
        with pytest.raises(ConfigError, match="same user"):
            SharedHostPool.attach(pool.path, 8192, pin=False)
    finally:
        pool.close()


def test_pinning_needs_cuda(tmp_path: Path) -> None:
    if _has_cuda():  # on a GPU machine: pinned (shared memory only), then unpinned by close
        pool = SharedHostPool.create(1 << 20, directory=shm.MEMFD)
        assert pool.pinned and pool.tensor().is_pinned()
        pool.close()
        assert not pool.pinned
        if shm._fs_type(str(tmp_path)) not in ("tmpfs", "ramfs", "hugetlbfs"):
            with pytest.raises(ConfigError, match="tmpfs"):  # pages of a disk file: refused
                SharedHostPool.create(1 << 20, pin=True, directory=str(tmp_path))
            assert os.listdir(tmp_path) == []
    else:
        with pytest.raises(ConfigError, match="CUDA"):
            SharedHostPool.create(1 << 20, pin=True, directory=str(tmp_path))
        assert os.listdir(tmp_path) == []
        with SharedHostPool.create(1 << 20, directory=str(tmp_path)) as pool:
            assert not pool.pinned  # pin=None: no GPU, no pinning


# ---------------------------------------------------------------------- copier refusals
@pytest.fixture
def copier_setup(tmp_path: Path) -> Any:
    srcs = [np.arange(4096, dtype=np.uint8) + i for i in range(3)]
    regions = [MemoryRegion.from_pointer(int(a.ctypes.data), a.nbytes, 64) for a in srcs]
    pool = SharedHostPool.create(1 << 14, pin=False, directory=str(tmp_path))
    remote = 0x10_0000_0000
    copier = RowCopier(regions, [(remote, pool)])
    yield srcs, regions, pool, remote, copier
    copier.close()
    pool.close()


def test_copier_rejects_rows_outside(copier_setup: Any) -> None:
    srcs, regions, pool, remote, copier = copier_setup
    r0 = regions[0].addr
    src = np.array([r0, r0 + 64, r0 + 4096 - 32], dtype=np.uint64)  # row 2 crosses the end
    dst = np.array([remote, remote + 64, remote + 128], dtype=np.uint64)
    with pytest.raises(DescriptorError, match=r"row 2: source .* not inside one source region"):
        copier.start(src, dst, 64)
    src[2] = r0 + 128
    dst[1] = remote + (1 << 14) - 10
    with pytest.raises(DescriptorError, match=r"row 1: destination .* not inside one shared"):
        copier.start(src, dst, 64)
    dst[1] = remote - 64
    with pytest.raises(DescriptorError, match="row 1: destination"):
        copier.start(src, dst, 64)
    with pytest.raises(DescriptorError, match="3 source addresses but 2"):
        copier.start(src, dst[:2], 64)
    with pytest.raises(DescriptorError, match="row_len"):
        copier.start(src, dst, 0)
    assert pool.array().sum() == 0  # nothing written by refused calls
    dst[1] = remote + 64
    job = copier.start(src, dst, 64)
    assert job.done() and job.nbytes == 192
    assert np.array_equal(pool.array()[64:128], srcs[0][64:128])
    empty = copier.start(np.empty(0, np.uint64), np.empty(0, np.uint64), 64)
    assert empty.done() and empty.nbytes == 0
    copier.close()
    with pytest.raises(TransferError, match="closed"):
        copier.start(src, dst, 64)


def test_copier_refuses_overlaps_and_vram_without_cuda(tmp_path: Path) -> None:
    a = np.zeros(1 << 12, dtype=np.uint8)
    dram = MemoryRegion.from_pointer(int(a.ctypes.data), a.nbytes, 64)
    with SharedHostPool.create(1 << 14, pin=False, directory=str(tmp_path)) as pool:
        with pytest.raises(LayoutError, match="overlap"):
            RowCopier([dram, dram], [(0x1000, pool)])
        with pytest.raises(LayoutError, match="overlap"):
            RowCopier([dram], [(0x1000, pool), (0x1000 + 4096, pool)])
        with pytest.raises(ConfigError, match="at least one"):
            RowCopier([], [(0x1000, pool)])
        if not _has_cuda():  # CI: VRAM regions need CUDA (the GPU side runs in the bench)
            vram = MemoryRegion.from_pointer(0x7000_0000_0000, 1 << 20, 64, kind=MemKind.VRAM)
            with pytest.raises(ConfigError, match="CUDA"):
                RowCopier([vram], [(0x1000, pool)])


@pytest.mark.parametrize("max_buckets", [1 << 22, 1])  # bucket table, then searchsorted
def test_range_lookup_matches_a_plain_search(max_buckets: int) -> None:
    from kvwire_hisparse.rows import Ranges, Scratch

    rng = np.random.default_rng(5)
    sc = Scratch()
    for _ in range(200):
        n = int(rng.integers(1, 9))
        starts, ends, a = [], [], int(rng.integers(0, 10_000))
        for _ in range(n):
            a += int(rng.integers(0, 3000))
            starts.append(a)
            a += int(rng.integers(1, 5000))
            ends.append(a)
        ranges = Ranges(starts, ends, max_buckets=max_buckets)
        addr = rng.integers(0, a + 6000, 500).astype(np.int64)
        addr[:2] = [-1, np.iinfo(np.int64).min]  # addresses >= 2**63, seen as int64
        row_len = int(rng.integers(1, 300))
        pos, ok = ranges.locate(addr, row_len, sc, "t")
        for v, p, o in zip(addr.tolist(), pos.tolist(), ok.tolist(), strict=True):
            inside = [
                i
                for i, (s, e) in enumerate(zip(starts, ends, strict=True))
                if s <= v and v + row_len <= e
            ]
            assert o == bool(inside), (v, starts, ends, row_len)
            if o:
                assert p == inside[0]
