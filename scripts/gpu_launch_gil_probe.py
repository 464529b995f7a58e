"""On a GPU: a Triton kernel launched with the GIL kept, against Triton's own launcher.

Triton's C launcher lets go of the GIL around ``cuLaunchKernelEx``; beside an engine thread
running Python, the launching thread then waits for the GIL to come back (8-13% of a
``cudaipc`` worker's wall time at C=8, docs/benchmarks.md "Session 27"). This probe launches an
already compiled kernel through ``libcuda``'s ``cuLaunchKernel`` via ``ctypes.PyDLL`` (the
GIL kept), packing the parameters as Triton's launcher does: every argument whose signature
type is not ``constexpr``, in order (pointers and 64-bit integers as 8 bytes, 32-bit ones as
4), then the global and profile scratch pointers (null: these kernels use none).

1. Correctness: a copy kernel launched both ways writes the same bytes (a kernel that needs
   scratch memory, clusters or a cooperative grid is refused by :class:`HeldLauncher`).
2. The GIL: beside a thread running Python without pause (5 ms interval), N launches each way,
   microseconds per launch and the rounds the busy thread ran meanwhile.

Written in session 27 after the device time was spent: not run on a GPU yet. Not used by
kvwire: once this probe holds on a GPU, the page movers' direct launch path
(``PageCopier._launch_table``) is the place to take it.

    python3 scripts/gpu_launch_gil_probe.py [--n 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
from typing import Any

import torch
import triton
import triton.language as tl
from busy_gil import BusyThread


@triton.jit
def _copy(src, dst, n, block: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.program_id(0) * block + tl.arange(0, block)
    m = i < n
    tl.store(dst + i, tl.load(src + i, mask=m), mask=m)


_C_TYPES: dict[str, Any] = {
    "i8": ctypes.c_int8,
    "i16": ctypes.c_int16,
    "i32": ctypes.c_int32,
    "i64": ctypes.c_int64,
    "u8": ctypes.c_uint8,
    "u16": ctypes.c_uint16,
    "u32": ctypes.c_uint32,
    "u64": ctypes.c_uint64,
    "fp32": ctypes.c_float,
    "fp64": ctypes.c_double,
}


class HeldLauncher:
    """Launches one compiled Triton kernel through ``cuLaunchKernel`` with the GIL kept."""

    def __init__(self, kernel: Any) -> None:
        kernel._init_handles()
        md = kernel.metadata
        if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
            raise ValueError("the kernel needs scratch memory: use Triton's launcher")
        if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False):
            raise ValueError("clusters and cooperative grids: use Triton's launcher")
        self.function = int(kernel.function)
        self.threads = 32 * int(md.num_warps)
        self.shared = int(md.shared)
        self.types = list(kernel.src.signature.values())
        lib = ctypes.PyDLL("libcuda.so.1")
        self._launch = lib.cuLaunchKernel
        self._launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self._launch.restype = ctypes.c_int

    def __call__(self, grid: tuple[int, int, int], stream: int, *args: Any) -> None:
        vals: list[Any] = []
        for a, t in zip(args, self.types, strict=True):
            if t == "constexpr":
                continue
            if t.startswith("*"):
                vals.append(ctypes.c_uint64(a if isinstance(a, int) else a.data_ptr()))
            elif t in _C_TYPES:
                vals.append(_C_TYPES[t](a))
            else:
                raise ValueError(f"argument type {t!r} is not packed here")
        vals += [ctypes.c_uint64(0), ctypes.c_uint64(0)]  # global and profile scratch
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        rc = self._launch(
            self.function, *grid, self.threads, 1, 1, self.shared, stream, params, None
        )
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernel failed: CUDA driver error {rc}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--json", default="")
    a = p.parse_args()
    n, block = 1 << 22, 1024
    src = torch.randint(0, 1 << 30, (n,), dtype=torch.int32, device="cuda")
    dst1, dst2 = torch.zeros_like(src), torch.zeros_like(src)
    grid = (triton.cdiv(n, block), 1, 1)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        kernel = _copy[grid[:1]](src, dst1, n, block=block)
    held = HeldLauncher(kernel)
    held(grid, s.cuda_stream, src, dst2, n, block)
    s.synchronize()
    same = bool(torch.equal(dst1, src) and torch.equal(dst2, src))
    res: dict[str, Any] = {"same_bytes": same}
    with BusyThread() as busy:
        for name, launch in (
            ("triton", lambda: kernel[grid](src, dst1, n, block, stream=s.cuda_stream)),
            ("held", lambda: held(grid, s.cuda_stream, src, dst2, n, block)),
        ):
            rounds, us = busy.measure(launch, a.n)
            res[f"{name}_us"], res[f"{name}_busy_rounds"] = round(us, 1), rounds
            s.synchronize()
    res["same_after"] = bool(torch.equal(dst2, src))
    print(json.dumps(res, indent=1))
    ok = res["same_bytes"] and res["same_after"]
    print("launch probe", "OK" if ok else "WRONG")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
