"""How much longer a small kvwire call takes after its thread slept: ``Codec.encode`` of a
chunk note (3 us in a loop) timed right after sleeps of 0, 1 and 5 ms, and after a 5 ms sleep
followed by a spin of 0.2 or 1 ms (the first call after the gap, the second, and the mean of
the next five, medians of 300 rounds, us). On the development VM the first call after 5 ms
took 33 us and a spin before it did not help: the call's code and data are no longer in the
caches (docs/benchmarks.md, "Cold calls"), which is what makes a request's Python on prefill
several times slower in a rank process than in a loop.

    uv run --frozen --no-sync python scripts/cold_call_cost.py
"""

from __future__ import annotations

import statistics
import time

from kvwire.control.wire import ChunkNote, Codec


def med_us(x: list[float]) -> float:
    return round(statistics.median(x) * 1e6, 1)


c = Codec(None)
msg = ChunkNote(room=1, sender_id=2, session="s" * 16, span=(0, 1), num_pages=1, page_size=16)


def run(gap: float, busy_us: int = 0) -> tuple[float, float, float]:
    a: list[float] = []
    b: list[float] = []
    d: list[float] = []
    for _ in range(300):
        time.sleep(gap)
        if busy_us:
            t = time.perf_counter()
            while time.perf_counter() - t < busy_us * 1e-6:
                pass
        t = time.perf_counter()
        c.encode(msg)
        t1 = time.perf_counter()
        c.encode(msg)
        t2 = time.perf_counter()
        for _ in range(5):
            c.encode(msg)
        t3 = time.perf_counter()
        a.append(t1 - t)
        b.append(t2 - t1)
        d.append((t3 - t2) / 5)
    return med_us(a), med_us(b), med_us(d)


print("gap 0      first/second/next", run(0))
print("gap 1ms   ", run(0.001))
print("gap 5ms   ", run(0.005))
print("gap 5ms + 200us spin", run(0.005, 200))
print("gap 5ms + 1ms spin", run(0.005, 1000))
