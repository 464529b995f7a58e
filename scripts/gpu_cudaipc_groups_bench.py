"""Head slices page to page on two GPUs: the run mover's tile plan (one program per token
row) against its group plan (one program per buffer and page), side by side in one process.

The run list is what ``cudaipc`` moves for heterogeneous TP (issue 28): for every buffer
(32 layers x K/V) and page (16 tokens), half of each 2 KiB token row of a GPU 0 pool into the
1 KiB rows of a GPU 1 pool, pages in random order on both sides. Each variant: CUDA-event
median of ``--repeat`` calls (planning and launch included, as the backend pays them), and
every byte of the destination compared with a torch reference after a fresh poison.

    python3 scripts/gpu_cudaipc_groups_bench.py --json $OUT/groups.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,128", help="MiB of source pages (half of it moves)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    import torch

    from kvwire.movers.triton_copy import RunCopier
    from kvwire_cudaipc._cuda import enable_peer_access

    enable_peer_access(0, 1)
    nbuf, tokens, row, n = 64, 16, 2048, 1024
    rng = np.random.default_rng(7)
    copier = RunCopier(0)
    out: list[dict[str, Any]] = []
    for mib in [int(x) for x in a.sizes.split(",")]:
        pages = mib * (1 << 20) // (nbuf * tokens * row)
        slots = 2 * pages
        src = torch.randint(
            -(2**31), 2**31 - 1, (nbuf, slots, tokens, row // 4), device="cuda:0", dtype=torch.int32
        )
        dst = torch.empty((nbuf, slots, tokens, n // 4), device="cuda:1", dtype=torch.int32)
        sp = torch.as_tensor(rng.permutation(slots)[:pages])
        dp = torch.as_tensor(rng.permutation(slots)[:pages])
        b = np.arange(nbuf)[:, None, None]
        t = np.arange(tokens)[None, None, :]
        s_runs = (
            src.data_ptr() + ((b * slots + sp.numpy()[None, :, None]) * tokens + t) * row + n
        ).ravel()
        d_runs = (
            dst.data_ptr() + ((b * slots + dp.numpy()[None, :, None]) * tokens + t) * n
        ).ravel()
        lens = np.full(s_runs.size, n, dtype=np.int64)
        want = src[:, sp, :, n // 4 :].to("cuda:1")
        row_out: dict[str, Any] = {"mib_moved": mib / 2, "runs": int(s_runs.size)}
        for name in ("tiles", "groups"):
            fn = copier.copy if name == "tiles" else copier.move
            dst.fill_(-1)
            torch.cuda.synchronize(1)
            plan = fn(s_runs, d_runs, lens)
            torch.cuda.synchronize(0)
            bad = int((dst[:, dp] != want).sum())
            untouched = torch.ones(slots, dtype=torch.bool)
            untouched[dp] = False
            bad += int((dst[:, untouched.to("cuda:1")] != -1).sum())
            times = []
            for _ in range(a.repeat):
                torch.cuda.synchronize(0)
                t0 = time.perf_counter()
                fn(s_runs, d_runs, lens)
                torch.cuda.synchronize(0)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            row_out[name] = {
                "programs": int(getattr(plan, "num_tiles", 0) or getattr(plan, "num_groups", 0)),
                "ms": med * 1e3,
                "gbps": s_runs.size * n / med / 1e9,
                "mismatches": bad,
            }
            assert bad == 0, (name, bad)
        row_out["groups_over_tiles"] = row_out["groups"]["gbps"] / row_out["tiles"]["gbps"]
        print(json.dumps(row_out), flush=True)
        out.append(row_out)
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"gpus": [torch.cuda.get_device_name(i) for i in (0, 1)], "cells": out}, indent=2
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
