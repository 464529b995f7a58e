"""How long after a small copy kernel ends does a host thread learn of it, per way of waiting?

`cudaipc`'s kernel watcher (``kvwire_cudaipc.watcher``) blocks in ``Event.synchronize`` on a
``blocking=True`` event (no spinning core); the request's note leaves only once it returns.
This probe times, on one GPU, a 2 MiB device copy launched every ``--gap-ms`` (a C=1
request's rhythm: the threads have slept between requests), from the host's record of the
event to the moment the waiting thread runs again, for:

* ``block``: the launching thread calls ``synchronize`` on a blocking event;
* ``spin``: the same on a default (spinning) event;
* ``query``: the launching thread polls ``query`` with ``time.sleep(0)`` between polls;
* ``watch-block``: a second thread blocked in a blocking event's ``synchronize`` wakes the
  launching thread through a ``threading.Event`` (the watcher's shape today);
* ``watch-query``: the second thread polls ``query`` with ``sleep(0)`` instead.

The GPU's own time for the copy (CUDA events with timing) is printed beside them.

    python3 scripts/gpu_event_wake_probe.py --json $OUT/event_wake.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=2)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--gap-ms", type=float, default=1.5)
    p.add_argument("--json", default="")
    a = p.parse_args()

    import torch

    dev = torch.device("cuda", 0)
    n = a.mib << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    stream = torch.cuda.Stream(device=dev)

    def launch(ev: Any) -> float:
        with torch.cuda.stream(stream):
            dst.copy_(src)
            ev.record(stream)
        return time.perf_counter()

    def sleepy_query(ev: Any) -> None:
        while not ev.query():
            time.sleep(0)

    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "mib": a.mib}

    # the GPU's time for the copy
    t0e, t1e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu_ms = []
    for _ in range(50):
        with torch.cuda.stream(stream):
            t0e.record(stream)
            dst.copy_(src)
            t1e.record(stream)
        t1e.synchronize()
        gpu_ms.append(t0e.elapsed_time(t1e))
    out["gpu_copy_us"] = 1e3 * statistics.median(gpu_ms)

    def same_thread(blocking: bool, wait: Callable[[Any], None]) -> list[float]:
        ev = torch.cuda.Event(blocking=blocking)
        us = []
        for _ in range(a.rounds):
            time.sleep(a.gap_ms / 1e3)
            t = launch(ev)
            wait(ev)
            us.append(1e6 * (time.perf_counter() - t))
        return us

    def watcher(blocking: bool, wait: Callable[[Any], None]) -> list[float]:
        ev = torch.cuda.Event(blocking=blocking)
        go, done = threading.Event(), threading.Event()
        stop = False

        def run() -> None:
            torch.cuda.set_device(dev)
            while True:
                go.wait()
                go.clear()
                if stop:
                    return
                wait(ev)
                done.set()

        th = threading.Thread(target=run, daemon=True)
        th.start()
        us = []
        for _ in range(a.rounds):
            time.sleep(a.gap_ms / 1e3)
            t = launch(ev)
            go.set()
            done.wait()
            done.clear()
            us.append(1e6 * (time.perf_counter() - t))
        stop = True
        go.set()
        th.join()
        return us

    cases: dict[str, Callable[[], list[float]]] = {
        "block": lambda: same_thread(True, lambda e: e.synchronize()),
        "spin": lambda: same_thread(False, lambda e: e.synchronize()),
        "query": lambda: same_thread(False, sleepy_query),
        "watch-block": lambda: watcher(True, lambda e: e.synchronize()),
        "watch-spin": lambda: watcher(False, lambda e: e.synchronize()),
        "watch-query": lambda: watcher(False, sleepy_query),
    }
    res: dict[str, dict[str, float]] = {}
    for rnd in range(2):  # two passes, the cases interleaved
        for name, fn in cases.items():
            us = sorted(fn())
            k = f"{name}#{rnd}"
            res[k] = {
                "p50_us": us[len(us) // 2],
                "p90_us": us[int(len(us) * 0.9)],
                "mean_us": statistics.mean(us),
            }
            print(
                f"{k:<16} p50 {res[k]['p50_us']:8.1f} us  p90 {res[k]['p90_us']:8.1f}  "
                f"mean {res[k]['mean_us']:8.1f}",
                flush=True,
            )
    out["cases"] = res
    print(f"GPU copy of {a.mib} MiB: {out['gpu_copy_us']:.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
