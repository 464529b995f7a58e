"""One-way latency of a ``tcp`` note between two processes (``TcpBackend._queue_note``, what
``cudaipc`` sends once its kernel ended): the sender queues a note carrying its
``time.perf_counter()``, the receiver's waiting thread (woken by the notification waker, as
decode's progress thread is) takes it; one clock on one host.

    python3 scripts/note_latency.py [--notes 600] [--secret S] [--busy 2] [--tree core/src]
                                    [--zmq]

``--tree`` puts another tree's ``core/src`` first on the path (an exported older commit), so
two trees can be compared in alternation; ``--busy`` adds busy Python threads to both processes;
``--zmq`` turns the local notes socket off (``local_notes``), the ZeroMQ way on one host.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
from typing import Any


def _busy() -> None:
    while True:
        sum(range(1000))
        time.sleep(0.0002)


def _backend(a: argparse.Namespace, name: str) -> Any:
    if a.tree:
        sys.path.insert(0, a.tree)
    from kvwire.backends.tcp.backend import TcpBackend
    from kvwire.backends.tcp.options import TcpOptions

    class NotingTcp(TcpBackend):  # sends notes alone, as cudaipc does (needs no GPU)
        sends_notes = True

    opts = TcpOptions(secret=a.secret or None)
    if a.zmq:  # notes over ZeroMQ even between peers on this host
        opts = opts.model_copy(update={"local_notes": False})
    return NotingTcp(name, opts)


def _receiver(a: argparse.Namespace, meta: Any, peer: Any, out: Any) -> None:
    b = _backend(a, "recv")
    meta.put(b.local_metadata())
    b.add_peer(peer.get())
    for _ in range(a.busy):
        threading.Thread(target=_busy, daemon=True).start()
    wake = threading.Event()
    b.set_notification_waker(wake.set)
    lat: list[float] = []
    while len(lat) < a.notes:
        wake.wait(1.0)
        wake.clear()
        now = time.perf_counter()
        lat += [now - float(n.payload.decode()) for n in b.get_notifications()]
    out.put(lat)
    b.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--notes", type=int, default=600)
    p.add_argument("--secret", default="", help="CURVE on the data plane")
    p.add_argument("--busy", type=int, default=0, help="busy Python threads per process")
    p.add_argument("--tree", default="", help="a core/src to import kvwire from")
    p.add_argument(
        "--zmq", action="store_true", help="local_notes off: notes over ZeroMQ on one host too"
    )
    a = p.parse_args()
    meta, peer, out = mp.Queue(), mp.Queue(), mp.Queue()
    proc = mp.Process(target=_receiver, args=(a, meta, peer, out))
    proc.start()
    b = _backend(a, "send")
    peer.put(b.local_metadata())
    name = b.add_peer(meta.get())
    for _ in range(a.busy):
        threading.Thread(target=_busy, daemon=True).start()
    time.sleep(0.5)
    for _ in range(a.notes):
        b._queue_note(name, str(time.perf_counter()).encode())
        time.sleep(0.002)
    lat = sorted(out.get()[20:])  # the first notes warm the sockets
    proc.join()
    b.close()
    ms = [1e3 * lat[int(q * (len(lat) - 1))] for q in (0.5, 0.9, 0.0)]
    print(f"notes {len(lat)} busy {a.busy} secret {bool(a.secret)}: p50 {ms[0]:.3f} ms "
          f"p90 {ms[1]:.3f} min {ms[2]:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
