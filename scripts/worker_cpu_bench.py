"""CPU per request of each kvwire thread of an in-process prefill/decode pair (tcp, one
transfer worker), for A/B work on the request path's Python on a CPU host.

    python3 scripts/worker_cpu_bench.py [--requests N] [--concurrency C] [--rounds R]

Both managers run in this process (:mod:`kvwire.testing.pair`: real tcp backend, bootstrap and
control channels), with a secret; requests of one small page are kept C in flight by this
thread, which plays both engines. Prints, per round, the CPU milliseconds per request of each
kvwire thread (``pthread_getcpuclockid``; the engine thread, this one, apart), every request
checked Success on both sides. The tcp backend's own threads move the bytes; the prefill
worker's figure is the session layer's per-request work plus tcp's submit and poll.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time

import numpy as np

from kvwire.session import KVPoll
from kvwire.testing.pair import Pair, config


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every live thread of this process, by name."""
    out: dict[str, float] = collections.defaultdict(float)
    for t in threading.enumerate():
        if t.ident is None:
            continue
        try:
            out[t.name] += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except OSError:
            continue
    return out


def run(p: Pair, n: int, conc: int, first_room: int) -> None:
    """``n`` requests of one page, ``conc`` in flight; each Success on both sides."""
    live: collections.deque[tuple[object, object]] = collections.deque()
    room, done = first_room, 0
    free = list(range(conc))
    slot_of: dict[int, int] = {}
    while done < n:
        while free and room - first_room < n:
            i = free.pop()
            r = p.decode.receiver(room, p.addr)
            r.init()
            r.send_metadata(np.array([10 + i]), aux_index=i)
            s = p.prefill.sender(room)
            slot_of[room] = i
            live.append((s, r))
            room += 1
        for _ in range(len(live)):
            s, r = live.popleft()
            ss = s.poll()  # type: ignore[attr-defined]
            if ss == KVPoll.WaitingForInput and not getattr(s, "_sent", False):
                i = slot_of[s.room]  # type: ignore[attr-defined]
                s.init(1, aux_index=i)  # type: ignore[attr-defined]
                s.send(np.array([i]), last=True)  # type: ignore[attr-defined]
                s._sent = True  # type: ignore[attr-defined]
            rs = r.poll()  # type: ignore[attr-defined]
            if KVPoll.Failed in (ss, rs):
                raise RuntimeError(f"room {s.room} failed")  # type: ignore[attr-defined]
            if ss == KVPoll.Success and rs == KVPoll.Success:
                s.clear()  # type: ignore[attr-defined]
                r.clear()  # type: ignore[attr-defined]
                free.append(slot_of.pop(s.room))  # type: ignore[attr-defined]
                done += 1
            else:
                live.append((s, r))
        time.sleep(0.0001)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    p = Pair(config(secret="worker-cpu-bench", num_workers=1), slots=64)
    try:
        run(p, 200, a.concurrency, 1)  # warm-up: handshakes, first-use costs
        room = 1_000
        for k in range(a.rounds):
            before, t0 = thread_cpu(), time.perf_counter()
            run(p, a.requests, a.concurrency, room)
            after, wall = thread_cpu(), time.perf_counter() - t0
            room += a.requests
            per = {
                name: (after[name] - before.get(name, 0.0)) * 1e3 / a.requests
                for name in after
                if after[name] - before.get(name, 0.0) > 0
            }
            row = "  ".join(f"{n.split('-')[0] if n.startswith('Thread') else n}={v:.3f}"
                            for n, v in sorted(per.items(), key=lambda kv: -kv[1]))  # fmt: skip
            print(f"round {k}: {a.requests / wall:.0f} req/s; CPU ms/request: {row}")
    finally:
        p.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
