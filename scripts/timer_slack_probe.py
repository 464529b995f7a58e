"""How late short waits end at the default timer slack and at 1 µs (kvwire.timer_slack).

    python scripts/timer_slack_probe.py [--waits 300]

Times ``time.sleep`` and ``threading.Event.wait`` (nobody sets the event) of 20 µs, 0.2 ms and
1 ms on this thread, first at the slack it started with, then after
``set_thread_slack(1.0)``; prints p50 and p90 in µs.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from kvwire.timer_slack import get_thread_slack_ns, set_thread_slack

CASES = (("sleep", 20e-6), ("sleep", 200e-6), ("Event.wait", 200e-6), ("Event.wait", 1e-3))


def measure(waits: int) -> list[tuple[str, float, float, float]]:
    ev = threading.Event()
    out = []
    for kind, s in CASES:
        xs = []
        for _ in range(waits):
            t = time.perf_counter()
            if kind == "sleep":
                time.sleep(s)
            else:
                ev.wait(s)
            xs.append((time.perf_counter() - t) * 1e6)
        xs.sort()
        out.append((kind, s * 1e6, statistics.median(xs), xs[int(0.9 * len(xs))]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waits", type=int, default=300)
    a = ap.parse_args()
    for label in ("start", "1 us"):
        if label == "1 us" and not set_thread_slack(1.0):
            print("timer slack cannot be set here")
            return 1
        print(f"slack {get_thread_slack_ns()} ns ({label})")
        for kind, asked, p50, p90 in measure(a.waits):
            print(f"  {kind:<10} {asked:7.0f} us asked: p50 {p50:7.1f}  p90 {p90:7.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
