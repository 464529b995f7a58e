"""Local notes' datagram send beside a thread that runs Python without pause (an engine's
scheduler): Python's ``socket.sendto`` against :class:`kvwire.backends.tcp.held_send.HeldSender`
(the GIL kept). A child process drains the socket. Prints, per path, microseconds per send
and the rounds the busy thread ran meanwhile (the GIL it took in the sends' gaps).

    uv run --frozen --no-sync python scripts/held_send_probe.py [--n 2000] [--interval-ms 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from busy_gil import BusyThread

from kvwire.backends.tcp.held_send import HeldSender

CHILD = """
import socket, sys
rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
rx.bind(sys.argv[1])
while rx.recv(16) != b"q":
    pass
"""


def retrying(fn: Callable[[], None]) -> Callable[[], None]:
    def call() -> None:
        while True:
            try:
                fn()
                return
            except BlockingIOError:  # the child's queue is full: it drains
                continue

    return call


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--interval-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    path = os.path.join(tempfile.mkdtemp(), "n")
    child = subprocess.Popen([sys.executable, "-c", CHILD, path])
    while not os.path.exists(path):
        time.sleep(0.01)
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    held = HeldSender(tx)
    sys.setswitchinterval(a.interval_ms / 1e3)
    for r in range(a.rounds):
        with BusyThread() as busy:
            py = busy.measure(retrying(lambda: tx.sendto(b"n", socket.MSG_DONTWAIT, path)), a.n)
            kept = busy.measure(retrying(lambda: held.send(path, b"n")), a.n)
        print(
            f"round {r + 1}: socket.sendto {py[1]:.1f} us/send, busy thread {py[0]} rounds; "
            f"held {kept[1]:.1f} us/send, busy thread {kept[0]} rounds",
            flush=True,
        )
    tx.sendto(b"q", path)
    child.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
