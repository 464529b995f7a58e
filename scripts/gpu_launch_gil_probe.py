"""On a GPU: kvwire's movers launched through :mod:`kvwire.cuda_launch` (the GIL kept) against
Triton's own launcher (``KVWIRE_TRITON_LAUNCHER=1``).

Triton's C launcher lets go of the GIL around ``cuLaunchKernelEx``; beside an engine thread
running Python, the launching thread then waits for the GIL to come back (8-13% of a
``cudaipc`` worker's wall time at C=8, docs/benchmarks.md "Session 27").

1. Correctness, every byte: the page mover (:class:`PageCopier`, whole pages and a head
   slice, gather and scatter) and the run mover (:class:`RunCopier`, tiles and page groups)
   on GPU memory, each launched 4 times (the first compiles through Triton, the rest go
   through the kept launcher), against torch indexing / the NumPy reference; and which
   launcher each variant got (``HeldLaunch`` expected on a CUDA 12.4+ driver).
2. The GIL: beside a thread running Python without pause (5 ms switch interval), N page
   mover calls each way: microseconds a call and the rounds the busy thread ran meanwhile.

    python3 scripts/gpu_launch_gil_probe.py [--n 400] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np
import torch
from busy_gil import BusyThread

from kvwire import cuda_launch
from kvwire.movers import copy_runs_reference
from kvwire.movers.triton_copy import RunCopier
from kvwire.movers.triton_pages import PageCopier


def launchers(kernels: Any) -> list[str]:
    return sorted({type(v).__name__ for v in kernels._launchers.values()})


def pages_check(dev: torch.device) -> dict[str, Any]:
    """PageCopier on GPU pools: whole pages and a head slice, gather then scatter, 4 rounds."""
    g = torch.Generator(device=dev).manual_seed(3)
    slots, page, row, nbuf = 64, 16, 256, 6
    bufs = [
        torch.randint(0, 256, (slots, page, row), dtype=torch.uint8, device=dev, generator=g)
        for _ in range(nbuf)
    ]
    addrs = np.array([b.data_ptr() for b in bufs], dtype=np.int64)
    mover = PageCopier(dev)
    bad = 0
    for lo, hi in ((0, row), (64, 192)):
        whole = hi - lo == row
        n, tokens = (page * row, 1) if whole else (hi - lo, page)
        for r in range(4):
            pages = torch.randperm(slots, generator=torch.Generator().manual_seed(r))[:9]
            block = torch.zeros(nbuf * 9 * page * (hi - lo), dtype=torch.uint8, device=dev)
            mover.copy(addrs, pages.numpy(), block.data_ptr(), slot_bytes=page * row, lo=lo,
                       row=row, n=n, tokens=tokens, to_pool=False)  # fmt: skip
            want = torch.stack([b[pages.to(dev)][:, :, lo:hi] for b in bufs]).reshape(-1)
            torch.cuda.synchronize(dev)
            bad += int((block != want).sum())
            fresh = torch.randint(0, 256, block.shape, dtype=torch.uint8, device=dev, generator=g)
            dst = torch.randperm(slots, generator=torch.Generator().manual_seed(100 + r))[:9]
            before = [b.clone() for b in bufs]
            mover.copy(addrs, dst.numpy(), fresh.data_ptr(), slot_bytes=page * row, lo=lo,
                       row=row, n=n, tokens=tokens, to_pool=True)  # fmt: skip
            torch.cuda.synchronize(dev)
            got = torch.stack([b[dst.to(dev)][:, :, lo:hi] for b in bufs]).reshape(-1)
            bad += int((got != fresh).sum())
            for b, keep in zip(bufs, before, strict=True):
                keep[dst.to(dev), :, lo:hi] = b[dst.to(dev), :, lo:hi]
                bad += int((b != keep).sum())
    return {"page_wrong_bytes": bad, "page_launchers": launchers(mover._kernels)}


def runs_check(dev: torch.device) -> dict[str, Any]:
    """RunCopier tiles (scattered runs) and groups (head slices page to page), 4 rounds."""
    rng = np.random.default_rng(5)
    mover = RunCopier(dev)
    bad = 0
    for r in range(4):
        mem = torch.from_numpy(rng.integers(0, 256, 1 << 22, dtype=np.uint8)).to(dev)
        want = mem.cpu().numpy().copy()
        src = rng.permutation(48) * 32768 + 16
        dst = (1 << 21) + rng.permutation(48) * 32768 + 48
        n = rng.integers(1, 30000 // 16, 48) * 16
        copy_runs_reference(want, src, dst, n)
        mover.copy(src + mem.data_ptr(), dst + mem.data_ptr(), n)
        torch.cuda.synchronize(dev)
        bad += int((mem.cpu().numpy() != want).sum())
        # head slices: buffer b, page p, token t: 64 of 256 bytes, page to page
        mem = torch.from_numpy(rng.integers(0, 256, 1 << 22, dtype=np.uint8)).to(dev)
        want = mem.cpu().numpy().copy()
        b, p, t = np.meshgrid(np.arange(3), np.arange(4), np.arange(16), indexing="ij")
        src = ((b * 8 + p) * 16 + t).reshape(-1) * 256 + 64 + r * 16
        dst = (1 << 21) + ((b * 8 + p + 4) * 16 + t).reshape(-1) * 256 + 128
        lens = np.full(src.size, 64)
        copy_runs_reference(want, src, dst, lens)
        mover.move(src + mem.data_ptr(), dst + mem.data_ptr(), lens)
        torch.cuda.synchronize(dev)
        bad += int((mem.cpu().numpy() != want).sum())
    return {"run_wrong_bytes": bad, "run_launchers": launchers(mover._kernels)}


def gil_rounds(dev: torch.device, n: int) -> dict[str, Any]:
    """Page mover calls beside a busy thread, the kept launcher and Triton's."""
    slots, page, row, nbuf = 64, 16, 256, 8  # 8 buffers x 8 pages x 4 KiB: the GPU keeps up
    pool = torch.zeros(nbuf, slots, page, row, dtype=torch.uint8, device=dev)
    addrs = np.array([pool[i].data_ptr() for i in range(nbuf)], dtype=np.int64)
    pages = np.arange(8, dtype=np.int64)
    block = torch.empty(nbuf * 8 * page * row, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    res: dict[str, Any] = {}
    for name, env in (("held", "0"), ("triton", "1"), ("held2", "0"), ("triton2", "1")):
        os.environ[cuda_launch.ENV_TRITON] = env
        mover = PageCopier(dev)

        def call(m: PageCopier = mover) -> None:
            m.copy(addrs, pages, block.data_ptr(), slot_bytes=page * row, lo=0, row=row,
                   n=page * row, tokens=1, to_pool=False, stream=stream)  # fmt: skip

        call()
        stream.synchronize()
        res[f"{name}_launcher"] = launchers(mover._kernels)
        with BusyThread() as busy:
            rounds, us = busy.measure(call, n)
        stream.synchronize()
        res[f"{name}_us"], res[f"{name}_busy_rounds"] = round(us, 1), rounds
    os.environ.pop(cuda_launch.ENV_TRITON, None)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--json", default="")
    a = p.parse_args()
    sys.setswitchinterval(0.005)
    dev = torch.device("cuda", 0)
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(dev)}
    res.update(pages_check(dev))
    res.update(runs_check(dev))
    res.update(gil_rounds(dev, a.n))
    print(json.dumps(res, indent=1))
    ok = res["page_wrong_bytes"] == 0 and res["run_wrong_bytes"] == 0
    held = res["page_launchers"] == ["HeldLaunch"] and res["run_launchers"] == ["HeldLaunch"]
    print("summary launch probe", "OK" if ok else "WRONG", "held" if held else "NOT held",
          f"us held/triton {res['held_us']}/{res['triton_us']}",
          f"busy rounds {res['held_busy_rounds']}/{res['triton_busy_rounds']}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
