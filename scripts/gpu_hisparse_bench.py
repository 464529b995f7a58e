"""The HiSparse ``mapped`` path on one host: prefill copies its KV rows into decode's shared
host pool itself (kvwire_hisparse.shm + kvwire_hisparse.copier), against a local pinned copy.

Two processes (spawn). The main process is "decode": it creates a pinned SharedHostPool (its
host KV pool, carved as one buffer per layer and K/V) and checks what lands in it. The spawned
"prefill" process allocates a CUDA KV pool (``--layers`` x K/V buffers, ``--row-kib`` token
rows, random bytes), attaches decode's pool and copies with a RowCopier, old against new in one
run (``--paths``, default both):

  old  ``vram_path="index"``, ``batch_rows=0``: every row validated and planned, then copied
       (copy engine per run of consecutive rows, else index_select/index_copy_ kernels): the
       copier before session 14
  new  ``vram_path="mover"``, batches of 16,384 rows: every row validated, then each batch
       planned and queued as one launch of kvwire's fused run mover while the GPU copies the
       previous one; ``rows`` = the same through a prepared table (``prepare`` once,
       ``start_rows`` per call: only indices checked, addresses gathered per batch), which is
       what the hisparse strategy calls; ``rows-index`` = ``rows`` with ``vram_path="index"``
       (the strategy's default)

Cases (each under every copier):
  a   one request laid out contiguously (one run per layer buffer)
  a-k the same rows with the copy engine off (old: kernels; the mover ignores runs anyway)
  b   page size 1: the same bytes as token rows, scattered slots -> shuffled host slots
  c   64 KiB rows, scattered -> shuffled
  d   DRAM source (NumPy path, thread pool), rows as in b
  b/8, d/8  b and d as 8 chunks of the request, all started before any is waited for (the
      transfer pipeline's pattern: planning a chunk overlaps the copies of the previous one)
  ref local pinned device-to-host copy of the same bytes (torch ``copy_``), no second process

Every case is copied once into a zeroed pool and checked by decode (CRC32 of every destination
row against prefill's CRC32 of the source rows, sent right after ``done()``), then timed
best-of-``--repeat`` (start() to done()). Prints a table of every case, then old and new side
by side (GB/s, x local copy, new/old); full results go to ``$OUT/gpu_hisparse_bench.json`` when
``$OUT`` is set (or ``--out``).

``--quick``: CPU smoke mode (DRAM source only, small sizes), for machines without a GPU.
``--cpu-plan``: only the CPU side of a VRAM copy of case b (131,072 rows of 2 KiB by default),
GPU calls left out (the mover's table is written into a slot-sized array, no launch): time to
the first queued copy and to the last, old against new; runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import zlib
from typing import Any

import numpy as np

MiB = 1 << 20
KiB = 1 << 10


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


# ----------------------------------------------------------------------------- the cases
def case_rows(
    cfg: dict[str, Any], row_len: int, pattern: str, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(source row numbers per region, destination row numbers per host buffer), both in
    units of ``row_len``, for one request of ``cfg['mib']`` MiB spread over every buffer."""
    nbuf = 2 * cfg["layers"]
    per_buf = cfg["mib"] * MiB // nbuf // row_len
    src_rows = cfg["slots"] * cfg["row"] // row_len
    dst_rows = cfg["pool_bytes"] // nbuf // row_len
    if per_buf > min(src_rows, dst_rows):
        raise SystemExit(f"{cfg['mib']} MiB does not fit the pools with {row_len}-byte rows")
    rng = np.random.default_rng(seed)
    if pattern == "contig":
        s0 = min(src_rows - per_buf, 7)
        return np.arange(s0, s0 + per_buf), np.arange(dst_rows - per_buf, dst_rows)
    return rng.choice(src_rows, per_buf, replace=False), rng.choice(
        dst_rows, per_buf, replace=False
    )


def addresses(bases: list[int], buf_bytes: int, rows: np.ndarray, row_len: int) -> np.ndarray:
    """Row addresses, buffer-major: every buffer's rows (the same row numbers in each)."""
    b = np.asarray(bases, dtype=np.uint64)[:, None]
    return (b + rows.astype(np.uint64)[None, :] * np.uint64(row_len)).reshape(-1)


def table_column(addr: np.ndarray, row_len: int) -> np.ndarray:
    """``addr`` as the strategy hands a link's table to ``prepare``: the address column of a
    ``[rows, 3]`` descriptor table (address, length, device), a strided view."""
    return np.stack([addr, np.full_like(addr, row_len), np.zeros_like(addr)], axis=1)[:, 0]


CASES: list[tuple[str, str, str, int, bool, int]] = [
    # name, source kind, pattern, row length (0: --row-kib), copy engine off, chunks
    ("a", "VRAM", "contig", 0, False, 1),
    ("a-k", "VRAM", "contig", 0, True, 1),
    ("b", "VRAM", "scatter", 0, False, 1),
    ("b/8", "VRAM", "scatter", 0, False, 8),
    ("c", "VRAM", "scatter", 64 * KiB, False, 1),
    ("d", "DRAM", "scatter", 0, False, 1),
    ("d/8", "DRAM", "scatter", 0, False, 8),
]
#: copier -> RowCopier options, and whether calls go through a prepared table
COPIERS: dict[str, tuple[dict[str, Any], bool]] = {
    "old": ({"vram_path": "index", "batch_rows": 0}, False),
    "new": ({"vram_path": "mover"}, False),
    "rows": ({"vram_path": "mover"}, True),
    # what the hisparse strategy calls by default: a prepared table, batches, index kernels
    "rows-index": ({"vram_path": "index"}, True),
    # "rows" with other batch sizes (rows of a batch: one launch each; 0: one batch)
    "rows-b4k": ({"vram_path": "mover", "batch_rows": 4096}, True),
    "rows-b64k": ({"vram_path": "mover", "batch_rows": 65536}, True),
    "rows-b0": ({"vram_path": "mover", "batch_rows": 0}, True),
}


def table_index(cfg: dict[str, Any], rows: np.ndarray, per_buf_rows: int) -> np.ndarray:
    """Row indices, buffer-major, into a table of every row of every buffer."""
    nbuf = 2 * cfg["layers"]
    return (np.arange(nbuf, dtype=np.int64)[:, None] * per_buf_rows + rows[None, :]).reshape(-1)


# ----------------------------------------------------------------------------- prefill process
def prefill(cfg: dict[str, Any], descs: list[dict[str, Any]], conn: Any) -> None:
    try:
        _prefill(cfg, descs, conn)
    except BaseException as exc:
        import traceback

        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _prefill(cfg: dict[str, Any], descs: list[dict[str, Any]], conn: Any) -> None:
    from kvwire_hisparse.copier import RowCopier
    from kvwire_hisparse.shm import SharedHostPool

    from kvwire.layout import MemoryRegion

    torch = None if cfg["quick"] else _torch_cuda()
    nbuf, row = 2 * cfg["layers"], cfg["row"]
    buf_bytes = cfg["slots"] * row
    info: dict[str, Any] = {}
    remote = int(descs[0]["addr"])
    dst_buf = cfg["pool_bytes"] // nbuf
    dst_bases = [remote + i * dst_buf for i in range(nbuf)]

    # DRAM KV pool (always) and CUDA KV pool (GPU runs)
    rng = np.random.default_rng(1)
    dram = [rng.integers(0, 256, size=buf_bytes, dtype=np.uint8) for _ in range(nbuf)]
    dram_regions = [MemoryRegion.from_tensor(a, row) for a in dram]
    vram: list[Any] = []
    vram_regions: list[MemoryRegion] = []
    if torch is not None:
        gen = torch.Generator(device="cuda").manual_seed(2)
        vram = [
            torch.randint(0, 256, (buf_bytes,), dtype=torch.uint8, device="cuda", generator=gen)
            for _ in range(nbuf)
        ]
        torch.cuda.synchronize()
        vram_regions = [MemoryRegion.from_tensor(t, row) for t in vram]
        info["gpu"] = torch.cuda.get_device_name(0)
        info["torch"] = torch.__version__

    t0 = time.perf_counter()
    pool = SharedHostPool.attach(descs[0]["path"], int(descs[0]["nbytes"]))
    info["attach_s"] = time.perf_counter() - t0
    info["prefill_pinned"] = pool.pinned
    copiers: dict[tuple[str, str, bool], Any] = {}
    kinds = ["DRAM"] + (["VRAM"] if torch is not None else [])
    for kind in kinds:
        regions = vram_regions if kind == "VRAM" else dram_regions
        for how in cfg["paths"]:
            opts, _ = COPIERS[how]
            for no_dma in (False, True):
                kw = dict(opts, dma_min_run_bytes=1 << 62) if no_dma else dict(opts)
                if kind == "DRAM":
                    kw.pop("vram_path")
                t0 = time.perf_counter()
                copiers[(kind, how, no_dma)] = RowCopier(regions, [(remote, pool)], **kw)
                info.setdefault("copier_setup_s", {})[f"{kind}/{how}"] = time.perf_counter() - t0
    if torch is not None:
        cp = copiers[("VRAM", cfg["paths"][0], False)]
        info["dst_pointer_mode"] = cp.dst_pointer_mode
        info["uva_alias"] = cp.dst_pointer_mode == "uva"
        info["vram_paths"] = {how: copiers[("VRAM", how, False)].vram_path for how in cfg["paths"]}
        # The same file attached (and pinned) a second time in one process: decode and prefill
        # of an in-process test cluster do this.
        try:
            again = SharedHostPool.attach(descs[0]["path"], int(descs[0]["nbytes"]), pin=True)
            info["second_pin_in_process"] = f"ok ({again.pinned})"
            again.close()
        except Exception as exc:
            info["second_pin_in_process"] = f"failed: {exc}"
    conn.send(("info", info))

    results: list[dict[str, Any]] = []
    tables: dict[tuple[str, str, int], Any] = {}
    for name, kind, pattern, rl, no_dma, chunks in CASES:
        if torch is None:  # CPU run: every case from DRAM
            kind = "DRAM"
        rl = rl or row
        if cfg["quick"] and rl > buf_bytes:
            rl = row
        s_rows, d_rows = case_rows(cfg, rl, pattern, seed=zlib.crc32(name.encode()))
        regions = vram_regions if kind == "VRAM" else dram_regions
        src = addresses([r.addr for r in regions], buf_bytes, s_rows, rl)
        dst = addresses(dst_bases, dst_buf, d_rows, rl)
        si = table_index(cfg, s_rows, buf_bytes // rl)
        di = table_index(cfg, d_rows, dst_buf // rl)
        nbytes = src.size * rl
        # expected bytes, in row order
        if kind == "VRAM":
            idx = torch.from_numpy(s_rows.astype(np.int64)).cuda()
            exp = torch.cat([t.view(-1, rl).index_select(0, idx) for t in vram]).cpu().numpy()
        else:
            exp = np.concatenate([a.reshape(-1, rl)[s_rows] for a in dram])
        crc = zlib.crc32(exp)
        del exp
        for how in cfg["paths"]:
            copier = copiers[(kind, how, no_dma)]
            prepared = COPIERS[how][1]
            if prepared:
                key = (kind, how, rl)
                if key not in tables:  # once per link in the strategy: every row of the pools
                    every_s = np.arange(buf_bytes // rl, dtype=np.int64)
                    every_d = np.arange(dst_buf // rl, dtype=np.int64)
                    t0 = time.perf_counter()
                    tables[key] = copier.prepare(
                        table_column(
                            addresses([r.addr for r in regions], buf_bytes, every_s, rl), rl
                        ),
                        table_column(addresses(dst_bases, dst_buf, every_d, rl), rl),
                        rl,
                    )
                    info.setdefault("prepare_s", {})[f"{kind}/{rl}"] = time.perf_counter() - t0
                table = tables[key]

                def go(a: Any, b: Any, copier: Any = copier, table: Any = table) -> Any:
                    return copier.start_rows(table, a, b)

                parts_of = (si, di)
            else:

                def go(a: Any, b: Any, copier: Any = copier, rl: int = rl) -> Any:
                    return copier.start(a, b, rl)

                parts_of = (src, dst)
            conn.send(("zero", None))
            assert conn.recv() == "zeroed"
            job = go(*parts_of)
            job.wait(120)
            dst_off = (dst - np.uint64(remote)).astype(np.int64)
            conn.send(("verify", (f"{name}/{how}", dst_off, rl, crc)))
            ok = conn.recv()

            # chunks: the request's tokens in ``chunks`` consecutive parts (every buffer's rows
            # of those tokens), all started before the first is waited for, as the transfer
            # pipeline does with a request's chunks
            parts = [
                (np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1))
                for a, b in zip(
                    np.array_split(parts_of[0].reshape(nbuf, -1), chunks, axis=1),
                    np.array_split(parts_of[1].reshape(nbuf, -1), chunks, axis=1),
                    strict=True,
                )
            ]
            times, host = [], []
            for _ in range(cfg["repeat"] + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                jobs = [go(a, b) for a, b in parts]
                t1 = time.perf_counter()
                for job in jobs:
                    job.wait(120)
                t2 = time.perf_counter()
                times.append(t2 - t0)
                host.append(t1 - t0)
            best = min(times[1:])
            results.append(
                {
                    "case": name,
                    "kind": kind,
                    "pattern": pattern,
                    "copier": how,
                    "vram_path": copier.vram_path or "numpy",
                    "copy_engine": not no_dma,
                    "chunks": chunks,
                    "rows": int(src.size),
                    "row_len": rl,
                    "nbytes": nbytes,
                    "verified": ok,
                    "best_s": best,
                    "gbps": nbytes / best / 1e9,
                    "times_s": times[1:],
                    "start_host_ms_min": 1e3 * min(host[1:]),
                }
            )
    conn.send(("info", {"prepare_s": info.get("prepare_s", {})}))

    if torch is not None:  # local reference: pinned device-to-host copy of the same bytes
        nbytes = cfg["mib"] * MiB
        src_t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        dst_t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        times = []
        for _ in range(cfg["repeat"] + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst_t.copy_(src_t, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ok = bool(torch.equal(dst_t[: 1 << 20].cuda(), src_t[: 1 << 20]))
        best = min(times[1:])
        results.append(
            {
                "case": "ref",
                "kind": "VRAM",
                "pattern": "local pinned D2H copy_",
                "copier": "torch",
                "rows": 1,
                "row_len": nbytes,
                "nbytes": nbytes,
                "verified": ok,
                "best_s": best,
                "gbps": nbytes / best / 1e9,
                "times_s": times[1:],
                "start_host_ms_min": 0.0,
            }
        )
    if torch is not None:
        results.append(_own_pinned_scatter(torch, cfg))
    for c in copiers.values():
        c.close()
    pool.close()
    conn.send(("done", results))


def _own_pinned_scatter(torch: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Diagnostic: the b rows gathered from one CUDA buffer and scattered with index_copy_ into
    this process's own torch-pinned (cudaHostAlloc) buffer through a CUDA alias: the kernel path
    without shared memory, to tell the memory from the method."""
    from kvwire_hisparse.pointers import CudaPtr

    rl = cfg["row"]
    n = cfg["mib"] * MiB // rl
    src = torch.randint(0, 256, (2 * n * rl,), dtype=torch.uint8, device="cuda")
    host = torch.zeros(2 * n * rl, dtype=torch.uint8, pin_memory=True)
    alias = torch.as_tensor(CudaPtr(host.data_ptr(), (2 * n, rl // 8), "<i8"))
    rng = np.random.default_rng(3)
    s_idx = torch.from_numpy(rng.choice(2 * n, n, replace=False)).cuda()
    d_idx = torch.from_numpy(rng.choice(2 * n, n, replace=False)).cuda()
    srcv = src.view(torch.int64).view(2 * n, rl // 8)
    times = []
    for _ in range(cfg["repeat"] + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        alias.index_copy_(0, d_idx, srcv.index_select(0, s_idx))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    hv = host.view(torch.int64).view(2 * n, rl // 8)
    ok = bool(torch.equal(hv[d_idx.cpu()].cuda(), srcv[s_idx]))
    best = min(times[1:])
    return {
        "case": "b-own",
        "kind": "VRAM",
        "pattern": "scatter into own cudaHostAlloc buffer",
        "copier": "index_copy_",
        "rows": n,
        "row_len": rl,
        "nbytes": n * rl,
        "verified": ok,
        "best_s": best,
        "gbps": n * rl / best / 1e9,
        "times_s": times[1:],
        "start_host_ms_min": 0.0,
        "alias_device": str(alias.device),
    }


# ----------------------------------------------------------------------------- decode process
def shm_directory(need: int) -> tuple[str, dict[str, Any]]:
    """/dev/shm (or $KVWIRE_SHM_DIR) when it can hold the pool, else a memfd."""
    from kvwire_hisparse.shm import DEFAULT_SHM_DIR, MEMFD, SHM_DIR_ENV

    where = os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR
    probe: dict[str, Any] = {"dir": where}
    if where != MEMFD:
        st = os.statvfs(where)
        probe["size_bytes"] = st.f_blocks * st.f_frsize
        probe["free_bytes"] = st.f_bavail * st.f_frsize
        if probe["free_bytes"] < need:
            where = MEMFD
    probe["used"] = where
    return where, probe


def print_ab(results: list[dict[str, Any]], paths: list[str], ref: Any) -> None:
    """Old and new side by side per case: GB/s (x local copy), and each against the first."""
    cells = {(r["case"], r["copier"]): r for r in results if r["case"] not in ("ref", "b-own")}
    base = paths[0]
    print()
    head = f"{'case':<5} {'source':<6}" + "".join(f" {p + ' GB/s (x local)':>22}" for p in paths)
    head += "".join(f" {p + '/' + base:>10}" for p in paths[1:])
    print(head)
    for name, *_ in CASES:
        row = [cells.get((name, p)) for p in paths]
        first = row[0]
        if first is None:
            continue
        line = f"{name:<5} {first['kind']:<6}"
        for r in row:
            if r is None:
                line += f" {'-':>22}"
                continue
            x = f"{r['gbps'] / ref['gbps']:.2f}" if ref else "-"
            cell = f"{r['gbps']:.2f} ({x})"
            line += f" {cell:>22}"
        for r in row[1:]:
            ratio = f"{r['gbps'] / first['gbps']:.2f}x" if r is not None else "-"
            line += f" {ratio:>10}"
        print(line)


class _TableOnly:
    """Stands in for ``RunCopier`` in ``--cpu-plan``: writes each launch's table into a
    slot-sized array as ``RunCopier.launch`` does, launches nothing, notes the first call."""

    _slot_tiles = 16384

    def __init__(self) -> None:
        self.slot = np.empty((3, self._slot_tiles), dtype=np.int64)
        self.first: float | None = None

    def launch(self, plan: Any, stream: Any = None) -> None:
        n = plan.num_tiles
        t = np.stack([plan.src, plan.dst, plan.elems], out=self.slot[:, :n])
        if plan.width >= 8:
            t[2] *= plan.width // 4
        if self.first is None:
            self.first = time.perf_counter()


def cpu_plan(cfg: dict[str, Any], repeat: int) -> int:
    """``--cpu-plan``: the copier's CPU work for case b, old against new (module doc)."""
    from kvwire_hisparse.copier import RowCopier
    from kvwire_hisparse.row_mover import RowMover
    from kvwire_hisparse.rows import consecutive_runs
    from kvwire_hisparse.shm import MEMFD, SharedHostPool

    from kvwire.layout import MemoryRegion

    nbuf, row = 2 * cfg["layers"], cfg["row"]
    buf_bytes = cfg["slots"] * row
    bufs = [np.zeros(buf_bytes, dtype=np.uint8) for _ in range(nbuf)]
    regions = [MemoryRegion.from_tensor(a, row) for a in bufs]
    pool = SharedHostPool.create(cfg["pool_bytes"], pin=False, directory=MEMFD)
    remote = 1 << 40
    dst_buf = cfg["pool_bytes"] // nbuf
    src_bases = [r.addr for r in regions]
    dst_bases = [remote + i * dst_buf for i in range(nbuf)]
    s_rows, d_rows = case_rows(cfg, row, "scatter", seed=zlib.crc32(b"b"))
    src = addresses(src_bases, buf_bytes, s_rows, row).view(np.int64)
    dst = addresses(dst_bases, dst_buf, d_rows, row).view(np.int64)
    si = table_index(cfg, s_rows, buf_bytes // row)
    di = table_index(cfg, d_rows, dst_buf // row)
    n = int(src.size)
    fake = _TableOnly()
    old = RowCopier(regions, [(remote, pool)], batch_rows=0)
    new = RowCopier(regions, [(remote, pool)], dram_mover=RowMover(fake))
    t0 = time.perf_counter()
    table = new.prepare(
        table_column(addresses(src_bases, buf_bytes, np.arange(buf_bytes // row), row), row),
        table_column(addresses(dst_bases, dst_buf, np.arange(dst_buf // row), row), row),
        row,
    )
    prep_ms = 1e3 * (time.perf_counter() - t0)

    def run_old() -> tuple[float, float]:
        # start() with vram_path="index", one batch: validate every address, group, find
        # runs, fill the index upload buffer (the CPU part of _queue_cuda); no GPU calls
        t0 = time.perf_counter()
        chk = old._check(src, dst, row)
        first = None
        for a, b in old._batches(n, 0):
            for g in old._groups(chk, a, b, row):
                consecutive_runs(g, row, old.dma_min_run_bytes, old._scratch)
                host = np.empty(2 * g.src_rows.size, dtype=np.int64)
                np.subtract(g.src_rows, 0, out=host[: g.src_rows.size])
                host[g.src_rows.size :] = g.dst_rows
                first = first or time.perf_counter()
        return (first or t0) - t0, time.perf_counter() - t0

    def run_new(rows: bool) -> tuple[float, float]:
        fake.first = None
        t0 = time.perf_counter()
        if rows:
            new.start_rows(table, si, di)
        else:
            new.start(src, dst, row)
        return (fake.first or t0) - t0, time.perf_counter() - t0

    # what the strategy's plan() did per chunk before calling the copier (session 13): gather
    # both address columns of its descriptor tables and split the rows by source kind
    tab_s = np.zeros((buf_bytes // row * nbuf, 3), dtype=np.uint64)
    tab_s[:, 0] = addresses(src_bases, buf_bytes, np.arange(buf_bytes // row), row)
    tab_d = np.zeros((dst_buf // row * nbuf, 3), dtype=np.uint64)
    tab_d[:, 0] = addresses(dst_bases, dst_buf, np.arange(dst_buf // row), row)
    src_kind = np.full(tab_s.shape[0], 2, dtype=np.int8)

    def run_old_strategy() -> tuple[float, float]:
        t0 = time.perf_counter()
        a, b = tab_s[si, 0], tab_d[di, 0]
        kinds = src_kind[si]
        for k in np.unique(kinds).tolist():
            m = kinds == k
            a[m], b[m]  # the masked copies the old plan() made
        t = time.perf_counter() - t0
        return t, t

    cases = [
        ("old: strategy plan() before start()", run_old_strategy),
        ("old: start(), index path, one batch", run_old),
        ("new: start(), mover, batches", lambda: run_new(False)),
        ("new: start_rows(), mover, batches", lambda: run_new(True)),
    ]
    print(f"{n} rows x {row} B; prepare() of the link's tables (once): {prep_ms:.1f} ms")
    print(f"{'copier':<38} {'first queued ms':>15} {'all queued ms':>14} {'ns/row':>7}")
    for name, fn in cases:
        for _ in range(3):
            fn()
        ts = [fn() for _ in range(repeat)]
        first = 1e3 * min(t[0] for t in ts)
        total = 1e3 * min(t[1] for t in ts)
        print(f"{name:<38} {first:>15.2f} {total:>14.2f} {1e6 * total / n:>7.1f}")
    old.close()
    new.close()
    pool.close()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke mode: DRAM source, tiny")
    ap.add_argument("--cpu-plan", action="store_true", help="only the CPU side (module doc)")
    ap.add_argument("--mib", type=int, default=256, help="bytes per case (MiB)")
    ap.add_argument("--pool-mib", type=int, default=1024, help="decode host pool (MiB)")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--row-kib", type=int, default=2, help="bytes per token row (KiB)")
    ap.add_argument("--slots", type=int, default=4096, help="token slots per prefill buffer")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--paths",
        default="old,new,rows",
        help="copiers to compare, comma-separated: old (index kernels, one batch), new (fused "
        "mover, batches), rows (new through a prepared table, as the strategy calls it), "
        "rows-index (the same with index kernels: the strategy's default vram_path)",
    )
    args = ap.parse_args()
    paths = [x for x in args.paths.split(",") if x]
    if not paths or any(x not in COPIERS for x in paths):
        ap.error(f"--paths takes a comma-separated subset of {sorted(COPIERS)}")
    if args.quick:
        args.mib, args.pool_mib, args.layers, args.slots = 2, 8, 4, 512
        args.repeat = min(args.repeat, 3)
    cfg = {
        "quick": args.quick,
        "mib": args.mib,
        "pool_bytes": args.pool_mib * MiB,
        "layers": args.layers,
        "row": args.row_kib * KiB,
        "slots": args.slots,
        "repeat": args.repeat,
        "paths": paths,
    }
    if args.cpu_plan:
        return cpu_plan(cfg, max(args.repeat, 21))
    from kvwire_hisparse.shm import SharedHostPool

    torch = None if args.quick else _torch_cuda()
    directory, probe = shm_directory(cfg["pool_bytes"] + 64 * MiB)
    t0 = time.perf_counter()
    pool = SharedHostPool.create(cfg["pool_bytes"], pin=torch is not None, directory=directory)
    probe["create_s"] = time.perf_counter() - t0
    probe["decode_pinned"] = pool.pinned
    if torch is not None:
        probe["decode_tensor_is_pinned"] = bool(pool.tensor()[:16].is_pinned())
    print(f"decode pool: {pool}  shm: {probe}", flush=True)
    arr = pool.array()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill, args=(cfg, [pool.describe()], child), daemon=True)
    proc.start()
    deadline = time.monotonic() + args.timeout
    info: dict[str, Any] = {}
    results: list[dict[str, Any]] = []
    verify: dict[str, Any] = {}
    rc = 0
    try:
        while True:
            if not parent.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"prefill did not finish within {args.timeout} s")
            what, body = parent.recv()
            if what == "error":
                print(f"prefill failed: {body}", file=sys.stderr)
                rc = 1
                break
            if what == "info":
                info.update(body)
                print(f"prefill: {body}", flush=True)
            elif what == "zero":
                arr[:] = 0
                parent.send("zeroed")
            elif what == "verify":
                name, dst_off, rl, crc = body
                rows = arr[: arr.size // rl * rl].reshape(-1, rl)
                got = zlib.crc32(np.ascontiguousarray(rows[dst_off // rl]))
                ok = got == crc and bool(arr.any())
                del rows
                verify[name] = ok
                print(f"case {name}: {'verified' if ok else 'MISMATCH'}", flush=True)
                parent.send(ok)
            elif what == "done":
                results = body
                break
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        del arr
        pool.close()

    ref = next((r for r in results if r["case"] == "ref"), None)
    for r in results:
        r["ratio_to_local_d2h"] = r["gbps"] / ref["gbps"] if ref else None
    out = {"config": cfg, "shm": probe, "prefill": info, "results": results, "argv": sys.argv}
    path = args.out or (
        os.path.join(os.environ["OUT"], "gpu_hisparse_bench.json") if os.environ.get("OUT") else ""
    )
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    if not results or not all(r["verified"] for r in results):
        rc = 1
    print()
    print(
        f"{'case':<5} {'copier':<6} {'source':<6} {'rows x bytes':>16} {'path':<22} "
        f"{'GB/s':>7} {'x local':>8} {'start ms':>9} ok"
    )
    for r in results:
        path_s = (
            r["copier"] if r["case"] in ("ref", "b-own") else f"{r['pattern']}/{r['vram_path']}"
        )
        ratio = f"{r['ratio_to_local_d2h']:.2f}" if r["ratio_to_local_d2h"] else "-"
        how = "-" if r["case"] in ("ref", "b-own") else r["copier"]
        print(
            f"{r['case']:<5} {how:<6} {r['kind']:<6} {r['rows']:>8} x {r['row_len']:<6} "
            f"{path_s:<22} {r['gbps']:>7.2f} {ratio:>8} {r['start_host_ms_min']:>9.2f} "
            f"{'yes' if r['verified'] else 'NO'}"
        )
    print_ab(results, paths, ref)
    return rc


if __name__ == "__main__":
    sys.exit(main())
