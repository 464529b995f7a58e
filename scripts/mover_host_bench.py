"""Host part of one fused-mover launch, on the CPU: planning (``plan_tiles``) and writing the
tile table into a preallocated buffer (what :class:`~kvwire.movers.triton_copy.RunCopier`
does with its pinned slots) against building a fresh table (the old launch's ``np.stack``
before its upload), for page runs of the model of issue 27 (64 runs of 32 KiB per 2 MiB page,
random pages). Needs no GPU and no Triton; prints medians in microseconds.

    python3 scripts/mover_host_bench.py [--repeat 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvwire.movers import plan_tiles

RUN = 32 << 10


def _table(plan: object, out: np.ndarray | None) -> np.ndarray:
    p = plan  # the table layout of kvwire.movers.triton_copy.plan_table, without Triton
    t = np.stack([p.src, p.dst, p.elems], out=out)  # type: ignore[attr-defined]
    t[2] *= 4  # width 16 -> int32 elements
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=300)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| MiB | runs | plan us | table into slot us | fresh table us | host us (plan + slot) |")
    print("|---:|---:|---:|---:|---:|---:|")
    slot = np.empty(3 * 16384, dtype=np.int64)
    for mib in (2, 16, 128, 512):
        pages = mib // 2
        slots = 2 * pages
        sp = rng.permutation(slots)[:pages]
        dp = rng.permutation(slots)[:pages]
        b = np.arange(64, dtype=np.int64)[:, None] * slots * RUN
        s = (1 << 30) + (b + sp[None, :] * RUN).ravel()
        d = (1 << 40) + (b + dp[None, :] * RUN).ravel()
        n = np.full(s.size, RUN, dtype=np.int64)
        plan_t, slot_t, fresh_t = [], [], []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            plan = plan_tiles(s, d, n)
            t1 = time.perf_counter()
            k = plan.num_tiles
            _table(plan, slot[: 3 * k].reshape(3, k))
            t2 = time.perf_counter()
            _table(plan, None)
            t3 = time.perf_counter()
            plan_t.append((t1 - t0) * 1e6)
            slot_t.append((t2 - t1) * 1e6)
            fresh_t.append((t3 - t2) * 1e6)
        p, sl, f = (statistics.median(x) for x in (plan_t, slot_t, fresh_t))
        print(f"| {mib} | {s.size} | {p:.1f} | {sl:.1f} | {f:.1f} | {p + sl:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
