"""Which NumPy calls let go of the GIL, seen from the time they take beside a busy thread.

A second thread runs Python in bursts (``--burst-ms``, then a 0.2 ms sleep), as an engine's
loop does. Each NumPy call below is timed 2,000 times on arrays of each ``--sizes`` length: a
call that keeps the GIL takes its own time; one that lets go of it (NumPy does in ufunc loops
and copies of 500 elements or more) now and then waits out the busy thread's burst before it
gets the GIL back, so its mean rises far above its median.

    uv run --frozen --no-sync python scripts/gil_release_probe.py
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256,512,2048")
    ap.add_argument("--burst-ms", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < a.burst_ms / 1e3:
                pass
            time.sleep(0.0002)

    threading.Thread(target=busy, daemon=True).start()
    slot = np.empty((4, 1 << 14), np.int64)
    print(f"{'call':<10} {'elements':>8} {'median us':>10} {'mean us':>8}")
    for n in (int(x) for x in a.sizes.split(",")):
        x = np.arange(n, dtype=np.int64)
        y = np.arange(n, dtype=np.int64)
        calls: dict[str, Callable[[], object]] = {
            "add": lambda x=x, y=y: x + y,
            "or-reduce": lambda x=x: np.bitwise_or.reduce(x),
            "concat": lambda x=x, y=y: np.concatenate([x, y]),
            "assign": lambda x=x, n=n: slot.__setitem__((1, slice(0, n)), x),
        }
        for name, fn in calls.items():
            ts = []
            for _ in range(a.reps):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            med, mean = statistics.median(ts) * 1e6, statistics.fmean(ts) * 1e6
            print(f"{name:<10} {n:>8} {med:>10.1f} {mean:>8.1f}", flush=True)
    stop.set()


if __name__ == "__main__":
    main()
