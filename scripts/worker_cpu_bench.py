"""CPU per request of each kvwire thread of an in-process prefill/decode pair (tcp, one
transfer worker), for A/B work on the request path's Python on a CPU host.

    python3 scripts/worker_cpu_bench.py [--requests N] [--concurrency C] [--rounds R]
        [--backend tcp|cudaipc] [--skip-copy]

Both managers run in this process (:mod:`kvwire.testing.pair`: real tcp backend, bootstrap and
control channels), with a secret; requests of one small page are kept C in flight by this
thread, which plays both engines. Prints, per round, the CPU milliseconds per request of each
kvwire thread (``pthread_getcpuclockid``; the engine thread, this one, apart), every request
checked Success on both sides. The tcp backend's own threads move the bytes; the prefill
worker's figure is the session layer's per-request work plus tcp's submit and poll. With
``--backend cudaipc`` the pair links over ``cudaipc`` on host stand-ins
(:mod:`kvwire_cudaipc.host_stand_ins`): the worker's figure is then the path a GPU host's
worker runs (page writes held and launched per turn, the note after the event), less the
launch itself and the GIL's hand-offs.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvwire.session import KVPoll, KVReceiver, KVSender
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


@dataclass
class _Live:
    """One request in flight: its two handles, its page slot, whether prefill sent."""

    tx: KVSender
    rx: KVReceiver
    slot: int
    sent: bool = False


def run(p: Pair, n: int, conc: int, first_room: int) -> None:
    """``n`` requests of one page, ``conc`` in flight; each Success on both sides."""
    live: collections.deque[_Live] = collections.deque()
    room, done, free = first_room, 0, list(range(conc))
    while done < n:
        while free and room - first_room < n:
            slot = free.pop()
            rx = p.decode.receiver(room, p.addr)
            rx.init()
            rx.send_metadata(np.array([10 + slot]), aux_index=slot)
            live.append(_Live(p.prefill.sender(room), rx, slot))
            room += 1
        for _ in range(len(live)):
            q = live.popleft()
            ss = q.tx.poll()
            if ss == KVPoll.WaitingForInput and not q.sent:
                q.tx.init(1, aux_index=q.slot)
                q.tx.send(np.array([q.slot]), last=True)
                q.sent = True
            rs = q.rx.poll()
            if KVPoll.Failed in (ss, rs):
                raise RuntimeError(f"room {q.tx.room} failed")
            if ss == KVPoll.Success and rs == KVPoll.Success:
                q.tx.clear()
                q.rx.clear()
                free.append(q.slot)
                done += 1
            else:
                live.append(q)
        time.sleep(0.0001)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--backend",
        default="tcp",
        choices=("tcp", "cudaipc"),
        help="cudaipc: its page writes on host stand-ins (kvwire_cudaipc.host_stand_ins: pools "
        "registered as GPU memory, a mover that copies on the host, events done at once)",
    )
    ap.add_argument(
        "--skip-copy",
        action="store_true",
        help="cudaipc: the stand-in mover moves no byte of a batched page write (the worker's "
        "Python alone; the requests still end Success, their bytes are not read)",
    )
    a = ap.parse_args()
    registered = None
    if a.backend == "cudaipc":
        from kvwire_cudaipc import host_stand_ins

        host_stand_ins.install_for_managers(setattr, copies=not a.skip_copy)
        registered = host_stand_ins.vram_layout
    cfg = config(secret="worker-cpu-bench", backend=a.backend, staging="direct", num_workers=1)
    p = Pair(cfg, slots=64, registered=registered)
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
