"""Scattered GPU -> host row writes into host memory of different origins (issue 27,
HiSparse's mapped path): is the shared pool slower to write than torch's pinned memory, and why?

One process, one GPU. For each kind of host buffer (``--mib`` x 2 of it), the same scattered
2 KiB rows (``--mib`` of them) are gathered on the GPU and written into it with one
``index_copy_`` through a CUDA alias of the host memory (what ``b-own`` of
``gpu_hisparse_bench.py`` does), best of ``--repeat``, every row checked:

  torch-pinned   ``torch.zeros(pin_memory=True)`` (cudaHostAlloc)
  anon           anonymous mmap, ``cudaHostRegister``-ed
  anon-thp       the same after ``madvise(MADV_HUGEPAGE)`` (transparent huge pages)
  shm            a file in /dev/shm, mmap-ed shared and registered (HiSparse's pool)
  shm-thp        the same after ``madvise(MADV_HUGEPAGE)`` (honoured only when the kernel's
                 ``shmem_enabled`` allows it)

Then the same rows into the /dev/shm buffer with kvwire's fused run mover
(:class:`kvwire.movers.triton_copy.RunCopier`, one launch straight from the scattered source
rows, as HiSparse's copier moves them), with 4 and 8 warps a program, tiles of 64 KiB (its
default: 8 KiB steps) or of one row (steps of a row), and as ``gather`` (the rows gathered on
the GPU first, then the mover from the contiguous copy). Prints GB/s per
kind beside a plain pinned D2H copy of the same bytes, and the kernel's THP settings.

    python3 scripts/gpu_host_memory_probe.py --json $OUT/host_memory.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvwire_hisparse.pointers import CudaPtr, device_pointer

MiB = 1 << 20
MADV_HUGEPAGE = 14
_libc = ctypes.CDLL(None, use_errno=True)


def _register(addr: int, nbytes: int) -> None:
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(addr, nbytes, 3)  # portable | mapped
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")


def _madvise_huge(addr: int, nbytes: int) -> bool:
    fn = _libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn(ctypes.c_void_p(addr), nbytes, MADV_HUGEPAGE) == 0


def host_buffer(kind: str, nbytes: int, keep: list[Any]) -> int:
    """The address of a zeroed host buffer of ``kind``, registered where needed (the objects
    that keep it alive go into ``keep``)."""
    if kind == "torch-pinned":
        t = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        keep.append(t)
        return int(t.data_ptr())
    if kind.startswith("anon"):
        mm = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="kvwire-probe-")
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        os.close(fd)
        os.unlink(path)
    keep.append(mm)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    if kind.endswith("-thp"):
        keep.append(("madvise", _madvise_huge(addr, nbytes)))
    np.frombuffer(mm, dtype=np.uint8)[::4096] = 0  # touch every page
    _register(addr, nbytes)
    return addr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--row-kib", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rl, n = a.row_kib * 1024, a.mib * MiB // (a.row_kib * 1024)
    thp = {
        f: Path(f"/sys/kernel/mm/transparent_hugepage/{f}").read_text().strip()
        for f in ("enabled", "shmem_enabled")
        if Path(f"/sys/kernel/mm/transparent_hugepage/{f}").exists()
    }
    # one spare row: the 8-byte-aligned variant reads each row 8 bytes later
    src_all = torch.randint(0, 1 << 30, (2 * n + 1, rl // 8), dtype=torch.int64, device="cuda")
    src = src_all[: 2 * n]
    rng = np.random.default_rng(3)
    s_idx = torch.from_numpy(rng.choice(2 * n, n, replace=False)).cuda()
    d_idx = torch.from_numpy(rng.choice(2 * n, n, replace=False)).cuda()
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "thp": thp, "kinds": {}}
    ref_host = torch.empty(n * rl, dtype=torch.uint8, pin_memory=True)
    ref_src = torch.empty(n * rl, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(a.repeat + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        ref_host.copy_(ref_src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    report["pinned_d2h_gbps"] = n * rl / min(times[1:]) / 1e9
    for kind in ("torch-pinned", "anon", "anon-thp", "shm", "shm-thp"):
        keep: list[Any] = []
        try:
            addr = host_buffer(kind, 2 * n * rl, keep)
            dev, mode = device_pointer(addr)
            alias = torch.as_tensor(CudaPtr(dev, (2 * n, rl // 8), "<i8"))
            times = []
            for _ in range(a.repeat + 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                alias.index_copy_(0, d_idx, src.index_select(0, s_idx))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            host = np.ctypeslib.as_array((ctypes.c_int64 * (2 * n * rl // 8)).from_address(addr))
            got = torch.from_numpy(host.reshape(2 * n, rl // 8)[d_idx.cpu().numpy()]).cuda()
            ok = bool(torch.equal(got, src[s_idx]))
            gbps = n * rl / min(times[1:]) / 1e9
            madv = [k[1] for k in keep if isinstance(k, tuple)]
            report["kinds"][kind] = {"gbps": gbps, "verified": ok, "pointer": mode, "madvise": madv}
        except Exception as exc:  # report every kind
            report["kinds"][kind] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for k in keep:
                if isinstance(k, mmap.mmap):
                    torch.cuda.cudart().cudaHostUnregister(
                        ctypes.addressof(ctypes.c_char.from_buffer(k))
                    )
    from kvwire.movers.plan import plan_tiles
    from kvwire.movers.triton_copy import RunCopier

    keep2: list[Any] = []
    addr = host_buffer("shm", 2 * n * rl, keep2)
    dev, _ = device_pointer(addr)
    row_bytes = np.uint64(rl)
    src_addr = np.uint64(src.data_ptr()) + s_idx.cpu().numpy().astype(np.uint64) * row_bytes
    dst_addr = np.uint64(dev) + d_idx.cpu().numpy().astype(np.uint64) * row_bytes
    lens = np.full(n, rl, dtype=np.uint64)
    host = np.ctypeslib.as_array((ctypes.c_int64 * (2 * n * rl // 8)).from_address(addr))
    staging = torch.empty_like(src[:n])
    contiguous = np.uint64(staging.data_ptr()) + np.arange(n, dtype=np.uint64) * row_bytes
    variants = (("mover-w4", 4, False, 64 << 10), ("mover-w8", 8, False, 64 << 10),
                ("gather+mover", 4, True, 64 << 10), ("mover-tile2k-w4", 4, False, rl),
                ("mover-tile2k-w2", 2, False, rl), ("mover-tile2k-w1", 1, False, rl),
                ("mover-8byte", 4, False, 64 << 10))  # fmt: skip
    shifted = torch.cat([src_all.view(-1)[1:], src_all.view(-1)[:1]]).view(2 * n + 1, rl // 8)
    for name, warps, gather, tile in variants:
        mover = RunCopier("cuda", tile_bytes=tile, num_warps=warps)
        # planned before the clock starts: the kernel's time, not the host's planning;
        # "8byte": every source row starts 8 bytes later (8-byte, not 16-byte, accesses)
        start = contiguous if gather else src_addr + np.uint64(8 if name == "mover-8byte" else 0)
        plan = plan_tiles(start, dst_addr, lens, mover.tile_bytes)
        times = []
        for _ in range(a.repeat + 1):
            host[:] = 0
            torch.cuda.synchronize()
            t = time.perf_counter()
            if gather:
                torch.index_select(src, 0, s_idx, out=staging)
            mover.launch(plan)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        got = torch.from_numpy(host.reshape(2 * n, rl // 8)[d_idx.cpu().numpy()]).cuda()
        want = shifted[s_idx] if name == "mover-8byte" else src[s_idx]
        ok = bool(torch.equal(got, want))
        report["kinds"][name] = {
            "gbps": n * rl / min(times[1:]) / 1e9, "verified": ok, "pointer": "shm", "madvise": []
        }  # fmt: skip
    ref = report["pinned_d2h_gbps"]
    print(f"THP: {thp}; pinned D2H copy {ref:.1f} GB/s")
    for kind, r in report["kinds"].items():
        if "gbps" in r:
            x = r["gbps"] / ref
            print(f"  {kind:<13} {r['gbps']:6.1f} GB/s ({x:.2f}x) verified={r['verified']}", end="")
            print(f" pointer={r['pointer']} madvise={r['madvise']}")
        else:
            print(f"  {kind:<13} {r['error']}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
