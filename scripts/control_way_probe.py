"""One way latency of a small frame between two processes: ZeroMQ PUSH -> PULL over loopback
TCP against a UNIX sequenced-packet connection, the receiver polling both in one
``zmq.Poller`` (as kvwire's liveness thread polls its PULL socket and the local way's
listener). The figure behind ``kvwire.control.local_way`` (docs/benchmarks.md, "The control
channel's local way").

    uv run --frozen --no-sync python scripts/control_way_probe.py [--frames 400] [--rounds 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time
from typing import Any

import zmq


def receiver(name: str, n: int, q: Any) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lst.bind("\0" + name)
    lst.listen(8)
    lst.setblocking(False)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(lst.fileno(), zmq.POLLIN)
    q.put(port)
    conns: dict[int, socket.socket] = {}
    lat: list[float] = []
    while len(lat) < n:
        ready = dict(poller.poll(1000))
        now = time.time()
        if pull in ready:
            lat.append(now - float(pull.recv()))
        if lst.fileno() in ready:
            c, _ = lst.accept()
            c.setblocking(False)
            conns[c.fileno()] = c
            poller.register(c.fileno(), zmq.POLLIN)
        for fd, c in list(conns.items()):
            if fd in ready:
                try:
                    m = c.recv(65536)
                except BlockingIOError:
                    continue
                if not m:
                    poller.unregister(fd)
                    del conns[fd]
                    continue
                lat.append(now - float(m))
    q.put(lat)
    ctx.destroy(linger=0)


def one(way: str, n: int) -> tuple[float, float]:
    name = f"kvwire-probe-{os.getpid()}-{way}"
    q: Any = mp.Queue()
    p = mp.Process(target=receiver, args=(name, n, q))
    p.start()
    port = q.get()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect("\0" + name)
    time.sleep(0.3)
    for _ in range(n):
        m = repr(time.time()).encode()
        if way == "zmq":
            push.send(m)
        else:
            s.send(m)
        time.sleep(0.002)  # one frame at a time: the receiver waits in its poll for each
    lat = sorted(q.get())
    p.join()
    ctx.destroy(linger=0)
    s.close()
    return lat[len(lat) // 2] * 1e6, lat[int(len(lat) * 0.9)] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    for r in range(a.rounds):
        for way in ("zmq", "unix"):
            p50, p90 = one(way, a.frames)
            print(f"round {r + 1} {way:>4}: p50 {p50:.1f} us, p90 {p90:.1f} us", flush=True)


if __name__ == "__main__":
    main()
