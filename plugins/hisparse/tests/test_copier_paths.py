"""The row copier's batched and prepared-table paths on the CPU, and its fused-mover path under
Triton's interpreter.

* rows copied in batches (``batch_rows``) and through a prepared table (``prepare`` +
  ``start_rows``) land exactly as one unbatched ``start`` puts them, for aligned, misaligned
  and odd-length rows over several regions and two pools (every byte against a per-row oracle);
* ``prepare`` refuses tables with rows outside the regions or pools, ``start_rows`` refuses
  bad indices, and a refused call writes nothing;
* the ``mover`` path (:class:`~kvwire_hisparse.row_mover.RowMover` around kvwire's
  ``RunCopier``; on a GPU it moves VRAM rows into the pinned pool) runs on host memory under
  Triton's interpreter through the copier's ``dram_mover`` seam, batched, by address and by
  prepared table, and matches the NumPy path byte for byte. The GPU itself is not tested here
  (no GPU in CI): scripts/gpu_hisparse_bench.py checks it with a CRC of every row.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from kvwire_hisparse.copier import RowCopier
from kvwire_hisparse.row_mover import row_width
from kvwire_hisparse.shm import SharedHostPool

from kvwire.errors import DescriptorError
from kvwire.layout import MemoryRegion
from kvwire.testing.interpreted import run_interpreted

#: (row length, offset skew): widths 16 / 8 (aligned), 8 off the grid, 1 (odd length)
ROW_CASES = [(256, 0), (256, 40), (72, 3)]
POOL_SIZES = (1 << 16, 40000)
REMOTE = 0x10_0000_0000


def _rows(
    rng: np.random.Generator, srcs: list[np.ndarray], row_len: int, skew: int, n: int
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int, int]]]:
    """``n`` scattered rows: (source addresses, decode-side addresses, oracle tuples (source
    region, offset, pool, offset)); destinations never overlap."""
    per_reg = (srcs[0].size - skew) // row_len
    reg = rng.integers(0, len(srcs), n)
    s_off = rng.integers(0, per_reg, n) * row_len + skew
    slots = [(p, k) for p, size in enumerate(POOL_SIZES) for k in range((size - skew) // row_len)]
    pick = rng.choice(len(slots), n, replace=False)
    pool = np.array([slots[i][0] for i in pick])
    d_off = np.array([slots[i][1] for i in pick]) * row_len + skew
    bases = np.cumsum([0, *POOL_SIZES[:-1]]) + REMOTE
    src = np.array([srcs[r].ctypes.data for r in reg], dtype=np.uint64) + s_off.astype(np.uint64)
    dst = bases[pool].astype(np.uint64) + d_off.astype(np.uint64)
    oracle = list(zip(reg.tolist(), s_off.tolist(), pool.tolist(), d_off.tolist(), strict=True))
    return src, dst, oracle


def _setup(tmp_path: Path, seed: int) -> tuple[list[np.ndarray], list[SharedHostPool]]:
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(0, 256, 1 << 14, dtype=np.uint8) for _ in range(3)]
    pools = [SharedHostPool.create(s, pin=False, directory=str(tmp_path)) for s in POOL_SIZES]
    return srcs, pools


def _copier(srcs: list[np.ndarray], pools: list[SharedHostPool], **kw: int) -> RowCopier:
    regions = [MemoryRegion.from_pointer(int(a.ctypes.data), a.nbytes, 1) for a in srcs]
    bases = np.cumsum([0, *POOL_SIZES[:-1]]) + REMOTE
    return RowCopier(regions, list(zip(bases.tolist(), pools, strict=True)), **kw)


@pytest.mark.parametrize(("row_len", "skew"), ROW_CASES)
def test_batches_and_prepared_rows_land_like_one_call(
    tmp_path: Path, row_len: int, skew: int
) -> None:
    srcs, pools = _setup(tmp_path, row_len + skew)
    try:
        rng = np.random.default_rng(1)
        src, dst, oracle = _rows(rng, srcs, row_len, skew, 90)
        expected = [np.zeros(p.nbytes, dtype=np.uint8) for p in pools]
        for r, so, p, do in oracle:  # test oracle only
            expected[p][do : do + row_len] = srcs[r][so : so + row_len]
        # a prepared table: the rows above, shuffled, plus rows no call uses
        extra_src, extra_dst, _ = _rows(np.random.default_rng(2), srcs, row_len, skew, 20)
        order = rng.permutation(110)
        tab_src = np.concatenate([src, extra_src])[order]
        tab_dst = np.concatenate([dst, extra_dst])[order]
        where = np.argsort(order)[:90]  # table row of each call row
        si, di = where, where
        for how, kw in (
            ("one call", {"batch_rows": 0}),
            ("batches of 7", {"batch_rows": 7}),
            ("prepared, batches of 16", {"batch_rows": 16}),
        ):
            for p in pools:
                p.array()[:] = 0
            copier = _copier(srcs, pools, **kw)
            try:
                if how.startswith("prepared"):
                    table = copier.prepare(tab_src, tab_dst, row_len)
                    job = copier.start_rows(table, si, di)
                else:
                    job = copier.start(src, dst, row_len)
                assert job.done() and job.nbytes == 90 * row_len and job.num_rows == 90
            finally:
                copier.close()
            for p, exp in zip(pools, expected, strict=True):
                assert np.array_equal(p.array(), exp), how
    finally:
        for p in pools:
            p.close()


def test_prepared_tables_refuse_bad_rows_and_indices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvwire_hisparse import copier as copier_mod

    monkeypatch.setattr(copier_mod, "_PREPARE_PIECE", 4)  # tables checked 4 rows at a time
    srcs, pools = _setup(tmp_path, 3)
    copier = _copier(srcs, pools)
    try:
        src, dst, oracle = _rows(np.random.default_rng(4), srcs, 64, 0, 10)
        bad = src.copy()
        bad[3] = srcs[0].ctypes.data + srcs[0].size - 32  # crosses the region's end
        with pytest.raises(DescriptorError, match=r"row 3: source .* not inside one source"):
            copier.prepare(bad, dst, 64)
        bad = dst.copy()
        bad[5] = REMOTE - 64
        with pytest.raises(DescriptorError, match=r"row 5: destination .* not inside one shared"):
            copier.prepare(src, bad, 64)
        table = copier.prepare(src, dst, 64)
        assert np.shares_memory(table.src, src) and np.shares_memory(table.dst, dst)  # views
        assert table.dst_pool is not None  # two pools: each row's pool is kept
        assert table.dst_pool.tolist() == [o[2] for o in oracle]
        idx = np.arange(10)
        for si, di, what in (
            (np.array([0, 1, 10]), idx[:3], r"row 2: source row 10 is not in the table of 10"),
            (idx[:3], np.array([0, -1, 2]), r"row 1: destination row -1 is not in the table"),
            (idx[:3], idx[:2], "3 source rows but 2 destination rows"),
            (idx[:3].astype(np.float64), idx[:3], "must be integers"),
        ):
            with pytest.raises(DescriptorError, match=what):
                copier.start_rows(table, si, di)
        assert all(p.array().sum() == 0 for p in pools)  # nothing written by refused calls
        assert copier.start_rows(table, idx[:0], idx[:0]).nbytes == 0
        job = copier.start_rows(table, idx, idx[::-1])
        assert job.done() and job.nbytes == 640
        for i in range(10):  # table row i's source went to table row 9 - i's destination
            r, so, _, _ = oracle[i]
            _, _, p, do = oracle[9 - i]
            assert np.array_equal(pools[p].array()[do : do + 64], srcs[r][so : so + 64])
        # a link's tables come as columns of a wider table: prepare copies them contiguous
        # once (np.take would copy a strided column whole on every batch of every chunk)
        wide = np.stack([src, dst, src], axis=1)
        cols = copier.prepare(wide[:, 0], wide[:, 1], 64)
        assert cols.src.flags.c_contiguous and cols.dst.flags.c_contiguous
        assert not np.shares_memory(cols.src, wide) and not np.shares_memory(cols.dst, wide)
        for p in pools:
            p.array()[:] = 0
        assert copier.start_rows(cols, idx, idx).done()
        for r, so, p, do in oracle:
            assert np.array_equal(pools[p].array()[do : do + 64], srcs[r][so : so + 64])
        # found once per link for the mover's batches: each row's address in its pool as the
        # copies reach it, and the access width of every row
        assert cols.dst_dev.tolist() == [pools[p].addr + do for _, _, p, do in oracle]
        assert cols.width == row_width(cols.src, cols.dst_dev, 64) == 16
    finally:
        copier.close()
        for p in pools:
            p.close()


def test_gpu_bench_runs_its_cpu_modes() -> None:
    """The GPU A/B script (old, new and prepared copiers, every case CRC-checked by a second
    process) and its CPU-side timing run on the CPU, so a GPU call does not find them broken."""
    script = Path(__file__).resolve().parents[3] / "scripts" / "gpu_hisparse_bench.py"
    for extra in ([], ["--cpu-plan"]):
        out = subprocess.run(
            [sys.executable, str(script), "--quick", *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        if extra:
            assert "start_rows(), mover, batches" in out.stdout
        else:
            assert "MISMATCH" not in out.stdout
            assert out.stdout.count("verified") == 21  # 7 cases x 3 copiers
            assert "rows/old" in out.stdout


def test_mover_path_matches_numpy_under_interpreter() -> None:
    """The ``mover`` path's batching, addressing and kernel (Triton's interpreter on host
    memory) against the NumPy path: same pools byte for byte, for aligned, misaligned and odd
    rows, by address and by prepared table, and rows longer than a mover tile."""
    pytest.importorskip("triton")
    run_interpreted(_MOVER_CHECK, "ROW-MOVER-OK", timeout_s=900)


_MOVER_CHECK = textwrap.dedent(
    """
    import numpy as np
    from kvwire.layout import MemoryRegion
    from kvwire.movers.triton_copy import RunCopier
    from kvwire_hisparse.copier import RowCopier
    from kvwire_hisparse.row_mover import RowMover
    from kvwire_hisparse.shm import MEMFD, SharedHostPool

    rng = np.random.default_rng(9)
    sizes = (1 << 18, 100000)
    remote = 0x10_0000_0000
    bases = [remote, remote + sizes[0]]
    srcs = [rng.integers(0, 256, 1 << 18, dtype=np.uint8) for _ in range(3)]
    regions = [MemoryRegion.from_pointer(int(a.ctypes.data), a.nbytes, 1) for a in srcs]
    mover = RowMover(RunCopier("cpu"))
    # (row length, skew, rows, contiguous): widths 16, 8, 1, rows longer than a 64 KiB tile,
    # and runs of consecutive rows (batches of 16 rows: whole runs go to the runs path, the
    # batches that straddle two runs through the mover)
    cases = ((256, 0, 40, False), (256, 40, 40, False), (72, 3, 40, False),
             ((64 << 10) + 64, 0, 3, False), (256, 0, 72, True))
    for row_len, skew, n, contiguous in cases:
        per_reg = (srcs[0].size - skew) // row_len
        if contiguous:  # runs of 24 consecutive rows, each in one region and one pool
            k = np.arange(n) % 24
            run = np.arange(n) // 24
            reg, pool_i = run % 3, run % 2
            s_off = (k + 100 * run) * row_len + skew
            d_off = (k + 30 * run) * row_len + skew
        else:
            reg = rng.integers(0, 3, n)
            s_off = rng.integers(0, per_reg, n) * row_len + skew
            slots = [(p, k) for p, s in enumerate(sizes) for k in range((s - skew) // row_len)]
            pick = rng.choice(len(slots), n, replace=False)
            pool_i = np.array([slots[i][0] for i in pick])
            d_off = np.array([slots[i][1] for i in pick]) * row_len + skew
        src = np.array([srcs[r].ctypes.data for r in reg], dtype=np.uint64)
        src += s_off.astype(np.uint64)
        dst = np.array(bases, dtype=np.uint64)[pool_i] + d_off.astype(np.uint64)
        results = []
        for how in ("numpy", "mover", "mover-prepared"):
            pools = [SharedHostPool.create(s, pin=False, directory=MEMFD) for s in sizes]
            kw = {} if how == "numpy" else {"dram_mover": mover, "batch_rows": 16}
            kw["dma_min_run_bytes"] = 16 * row_len
            cp = RowCopier(regions, list(zip(bases, pools)), **kw)
            if how == "mover-prepared":
                order = rng.permutation(n)
                table = cp.prepare(src[order], dst[order], row_len)
                where = np.argsort(order)
                job = cp.start_rows(table, where, where)
            else:
                job = cp.start(src, dst, row_len)
            assert job.done() and job.nbytes == n * row_len
            cp.close()
            results.append([p.array().copy() for p in pools])
            for p in pools:
                p.close()
        ref = results[0]
        assert sum(int(a.astype(bool).sum()) for a in ref) > 0
        for other in results[1:]:
            for a, b in zip(ref, other):
                assert np.array_equal(a, b), (row_len, skew)
        print("case", row_len, skew, "ok", flush=True)
    print("ROW-MOVER-OK")
    """
)
