"""Launch shapes for many short runs into host memory (issue 27, HiSparse's mapped path).

Session 33 found kvwire's run mover (one Triton program per run) writes scattered 2 KiB rows
into registered /dev/shm memory at 0.74-0.76x a plain pinned D2H copy, where ``index_copy_``
reaches 0.92x. This probe times, on the same rows into the same memory, with the plan table
uploaded to the device before the clock (the kernel's time only):

  tiles          kvwire's mover as it is (``RunCopier.launch``, one program per run)
  multi-K-wW     one program per K consecutive runs, copied as one [K, block] access
  stride-G-wW    G programs (a multiple of the SM count), each copying every G-th run
  index_copy     torch: gather on the GPU, then one ``index_copy_`` through a CUDA alias

and kvwire's ``RunCopier`` as the HiSparse copier drives it (one launch per batch of B rows,
``bus-B``: each table in a pinned slot the kernel reads over the bus), plus the same for 32 KiB
runs from GPU 0 into GPU 1 (KV page rows over NVLink) where there are two GPUs; the clock
includes the host's planning. (Session 34 also ran ``dev-B``, the table copied into device
memory before each launch, from a RunCopier option it then dropped: 0.88x against 0.87x at
16,384 rows, worse at 1,024 and fewer; this tree runs ``bus-B`` only.)
Every case's rows checked. Prints GB/s and the ratio to the pinned D2H copy (the peer copy of
the same bytes for GPU 1).

    PYTHONPATH=plugins/hisparse/src:$PYTHONPATH python3 scripts/gpu_run_mover_probe.py \
        --json $OUT/run_mover.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from kvwire_hisparse.pointers import CudaPtr, device_pointer

MiB = 1 << 20


@triton.jit(do_not_specialize=["table_addr", "num_tiles"])
def _multi(table_addr, num_tiles, k: tl.constexpr, b: tl.constexpr, vec: tl.constexpr):
    # table: int64 [3, num_tiles] (source, destination, length in int32 elements); runs of at
    # most b elements, every address and length a multiple of 16 bytes
    tp = table_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * k + tl.arange(0, k)
    ok = idx < num_tiles
    s = tl.load(tp + idx, mask=ok, other=0)
    d = tl.load(tp + num_tiles + idx, mask=ok, other=0)
    n = tl.load(tp + 2 * num_tiles + idx, mask=ok, other=0)
    sp = tl.multiple_of(s.to(tl.pointer_type(tl.int32)), 16)
    dp = tl.multiple_of(d.to(tl.pointer_type(tl.int32)), 16)
    o = tl.max_contiguous(tl.multiple_of(tl.arange(0, b), vec), vec)
    m = o[None, :] < n[:, None]
    v = tl.load(sp[:, None] + o[None, :], mask=m)
    tl.store(dp[:, None] + o[None, :], v, mask=m)


@triton.jit(do_not_specialize=["table_addr", "num_tiles", "grid"])
def _stride(table_addr, num_tiles, grid, b: tl.constexpr, vec: tl.constexpr):
    tp = table_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, b)
    for t in range(pid, num_tiles, grid):
        s = tl.load(tp + t)
        d = tl.load(tp + num_tiles + t)
        n = tl.multiple_of(tl.load(tp + 2 * num_tiles + t), vec)
        sp = tl.multiple_of(s.to(tl.pointer_type(tl.int32)), 16)
        dp = tl.multiple_of(d.to(tl.pointer_type(tl.int32)), 16)
        for start in range(0, n, b):
            q = start + o
            mk = q < n
            tl.store(dp + q, tl.load(sp + q, mask=mk), mask=mk)


def _shm(nbytes: int, keep: list[Any]) -> int:
    """Registered /dev/shm memory, as HiSparse's pool is (``gpu_host_memory_probe``'s)."""
    from gpu_host_memory_probe import host_buffer  # scripts/ is this script's path

    return host_buffer("shm", nbytes, keep)


def _best(fn: Callable[[], None], before: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):
        before()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times[1:])


def _rows(rk: int, total: int, ref: float, repeat: int) -> dict[str, Any]:
    """Every case for rows of ``rk`` KiB (``total`` bytes of them) into registered /dev/shm
    memory; GB/s, the ratio to ``ref`` and whether every row landed right, per case."""
    from kvwire.movers.plan import plan_tiles
    from kvwire.movers.triton_copy import RunCopier, _copy_tiles, plan_table

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rl = rk * 1024
    n = total // rl
    src = torch.randint(0, 1 << 30, (2 * n, rl // 8), dtype=torch.int64, device="cuda")
    rng = np.random.default_rng(3 + rk)
    s_idx_np = rng.choice(2 * n, n, replace=False)
    d_idx_np = rng.choice(2 * n, n, replace=False)
    s_idx, d_idx = torch.from_numpy(s_idx_np).cuda(), torch.from_numpy(d_idx_np).cuda()
    keep: list[Any] = []
    addr = _shm(2 * n * rl, keep)
    dev, _ = device_pointer(addr)
    host = np.ctypeslib.as_array((ctypes.c_int64 * (2 * n * rl // 8)).from_address(addr))
    alias = torch.as_tensor(CudaPtr(dev, (2 * n, rl // 8), "<i8"))
    want = src[s_idx]
    rb = np.uint64(rl)
    src_addr = np.uint64(src.data_ptr()) + s_idx_np.astype(np.uint64) * rb
    dst_addr = np.uint64(dev) + d_idx_np.astype(np.uint64) * rb
    plan = plan_tiles(src_addr, dst_addr, np.full(n, rl, dtype=np.uint64), 64 << 10)
    table = torch.from_numpy(plan_table(plan).copy()).cuda()  # lengths in int32 elements
    nt, elems, tptr = plan.num_tiles, rl // 4, table.data_ptr()
    mover = RunCopier("cuda")

    def clear() -> None:
        host[:] = 0

    cases: dict[str, Callable[[], Any]] = {
        "tiles": lambda: mover.launch(plan),
        "tiles-devtable": lambda: _copy_tiles[(nt,)](
            tptr, nt, block=min(elems, 2048), elem=tl.int32, align=16, vec=4, num_warps=4
        ),
    }
    for k in (2, 4, 8, 16):
        for w in (4, 8):
            if k * elems <= 65536:
                cases[f"multi-{k}-w{w}"] = lambda k=k, w=w: _multi[(triton.cdiv(nt, k),)](
                    tptr, nt, k=k, b=elems, vec=4, num_warps=w
                )
    for mult in (4, 8, 16, 32):
        for w in (4, 8):
            cases[f"stride-{mult}xSM-w{w}"] = lambda g=sms * mult, w=w: _stride[(g,)](
                tptr, nt, g, b=min(elems, 2048), vec=4, num_warps=w
            )
    cases["index_copy"] = lambda: alias.index_copy_(0, d_idx, src.index_select(0, s_idx))
    cases.update(_batched(src_addr, dst_addr, rl))
    rows: dict[str, Any] = {}
    for name, fn in cases.items():
        try:
            sec = _best(fn, clear, repeat)
            got = torch.from_numpy(host.reshape(2 * n, rl // 8)[d_idx_np]).cuda()
            ok = bool(torch.equal(got, want))
            gbps = total / sec / 1e9
            rows[name] = {"gbps": gbps, "x": gbps / ref, "ok": ok}
            print(f"  {rk} KiB rows {name:<18} {gbps:6.1f} GB/s ({gbps / ref:.2f}x) verified={ok}")
        except Exception as exc:  # report every case
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"  {rk} KiB rows {name:<18} {rows[name]['error']}")
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(addr)
    return rows


def _batched(src: Any, dst: Any, rl: int) -> dict[str, Callable[[], Any]]:
    """``RunCopier`` launches of one-tile-per-row plans in batches of B rows (``bus-B``)."""
    from kvwire.movers.plan import TilePlan
    from kvwire.movers.triton_copy import RunCopier

    out: dict[str, Callable[[], Any]] = {}
    lens = np.full(src.size, rl // 16, dtype=np.int64)
    for mode in ("bus",):
        for batch in (256, 1024, 4096, 16384):
            copier = RunCopier("cuda", slots=32)

            def run(copier: Any = copier, batch: int = batch) -> None:
                for a in range(0, src.size, batch):
                    b = min(src.size, a + batch)
                    sa, da = src[a:b].view(np.int64), dst[a:b].view(np.int64)
                    tile = max(16, 1 << (rl - 1).bit_length())
                    copier.launch(TilePlan(sa, da, lens[: b - a], 16, tile))

            out[f"{mode}-{batch}"] = run
    return out


def _peer(total: int, repeat: int) -> dict[str, Any]:
    """32 KiB runs from GPU 0's scattered slots into GPU 1's (peer access on), batched as
    :func:`_batched` does, against a torch peer copy of the same bytes."""
    rl = 32 << 10
    n = total // rl
    torch.cuda.set_device(0)
    if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
        return {"error": "no second GPU with peer access"}
    src = torch.randint(0, 1 << 30, (2 * n, rl // 8), dtype=torch.int64, device="cuda:0")
    dst = torch.zeros((2 * n, rl // 8), dtype=torch.int64, device="cuda:1")
    flat = torch.empty(total, dtype=torch.uint8, device="cuda:1")
    ref = total / _best(lambda: flat.copy_(src.view(torch.uint8)[:total]), lambda: None, repeat)
    ref /= 1e9
    rng = np.random.default_rng(7)
    s_idx, d_idx = rng.choice(2 * n, n, replace=False), rng.choice(2 * n, n, replace=False)
    rb = np.uint64(rl)
    sa = np.uint64(src.data_ptr()) + s_idx.astype(np.uint64) * rb
    da = np.uint64(dst.data_ptr()) + d_idx.astype(np.uint64) * rb
    want = src[torch.from_numpy(s_idx).cuda()].to("cuda:1")
    rows: dict[str, Any] = {"peer_copy_gbps": ref}
    for name, fn in _batched(sa, da, rl).items():
        if name.endswith("-16384"):
            continue
        sec = _best(fn, lambda: dst.zero_(), repeat)
        ok = bool(torch.equal(dst[torch.from_numpy(d_idx).to("cuda:1")], want))
        gbps = total / sec / 1e9
        rows[name] = {"gbps": gbps, "x": gbps / ref, "ok": ok}
        print(f"  32 KiB runs GPU 0 -> 1 {name:<10} {gbps:6.1f} GB/s ({gbps / ref:.2f}x peer "
              f"copy {ref:.0f}) verified={ok}")  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--row-kib", type=str, default="2,8")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "sms": sms, "rows": {}}
    total = a.mib * MiB
    ref_host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    ref_src = torch.empty(total, dtype=torch.uint8, device="cuda")
    ref = total / _best(lambda: ref_host.copy_(ref_src), lambda: None, a.repeat) / 1e9
    report["pinned_d2h_gbps"] = ref
    print(f"{report['gpu']}, {sms} SMs; pinned D2H copy of {a.mib} MiB: {ref:.1f} GB/s")
    for rk in (int(x) for x in a.row_kib.split(",")):
        report["rows"][f"{rk}KiB"] = _rows(rk, total, ref, a.repeat)
    report["peer"] = _peer(total, a.repeat)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
