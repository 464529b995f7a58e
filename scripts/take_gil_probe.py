"""What a HiSparse copier batch's address gathers cost alone and beside a thread running Python.

The copier gathers each 16,384-row batch's source and destination addresses from the link's
prepared tables with ``np.take`` (``kvwire_hisparse.copier._Checked.rows``). In a prefill rank
on an H200 host that took 0.45 ms a batch (session 34's trace), against ~0.05 ms in a quiet
process. NumPy lets go of the GIL inside ``take``; a thread that lets go of it waits, to take
it back, for whichever thread took it meanwhile, up to the switch interval. This probe times
the two gathers of a batch (the cluster bench's shapes: 64 buffers x 12,288 token slots a
table, a request's 64 pages of 16 tokens) alone, beside a thread that runs Python without
pause at the interpreter's 5 ms interval, and beside it at 100 us::

    python3 scripts/take_gil_probe.py
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

SLOTS, BUFFERS, BATCH = 768 * 16, 64, 16384


def main() -> int:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 1 << 40, BUFFERS * SLOTS).astype(np.int64)
    dst = rng.integers(0, 1 << 40, BUFFERS * SLOTS).astype(np.int64)
    pages = rng.choice(768, 64, replace=False)
    tokens = (pages[:, None] * 16 + np.arange(16)).ravel()
    si = (np.arange(BUFFERS)[:, None] * SLOTS + tokens[None, :]).ravel()
    shuffled = rng.permutation(SLOTS)[: tokens.size]
    di = (np.arange(BUFFERS)[:, None] * SLOTS + shuffled[None, :]).ravel()
    out1, out2 = np.empty(BATCH, np.int64), np.empty(BATCH, np.int64)

    def batch_ms() -> float:
        times = []
        for _ in range(50):
            t = time.perf_counter()
            for a in range(0, si.size, BATCH):
                np.take(src, si[a : a + BATCH], out=out1)
                np.take(dst, di[a : a + BATCH], out=out2)
            times.append((time.perf_counter() - t) / (si.size // BATCH))
        return 1e3 * sorted(times)[len(times) // 2]

    stop = threading.Event()

    def busy() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    print(f"alone: {batch_ms():.4f} ms a batch (two gathers of {BATCH} rows)")
    for interval in (0.005, 0.0001):
        sys.setswitchinterval(interval)
        stop.clear()
        t = threading.Thread(target=busy)
        t.start()
        print(f"beside a thread running Python, {interval * 1e6:.0f} us interval: "
              f"{batch_ms():.4f} ms a batch")  # fmt: skip
        stop.set()
        t.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
