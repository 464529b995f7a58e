"""kvwire.backends.tcp.held_send: local notes' datagram send with the GIL kept."""

from __future__ import annotations

import ctypes
import errno
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvwire.backends.tcp.held_send import HeldSender
from kvwire.backends.tcp.local_notes import LocalNotes

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="UNIX sockets only")


@pytest.fixture
def pair(tmp_path: object) -> Iterator[tuple[socket.socket, str, HeldSender, socket.socket]]:
    path = f"{tmp_path}/n"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(path)
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    held = HeldSender(tx)
    yield rx, path, held, tx
    rx.close()
    tx.close()


def test_a_datagram_arrives_whole(
    pair: tuple[socket.socket, str, HeldSender, socket.socket],
) -> None:
    rx, path, held, _ = pair
    assert held.ok  # Linux: the C library's sendto is found
    for payload in (b"x", bytes(range(256)) * 100):
        held.send(path, payload)
        assert rx.recv(1 << 16) == payload


def test_errors_are_the_system_calls(
    pair: tuple[socket.socket, str, HeldSender, socket.socket],
) -> None:
    rx, path, held, _ = pair
    with pytest.raises(OSError) as gone:
        held.send(path + "-missing", b"x")
    assert gone.value.errno == errno.ENOENT
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with pytest.raises(OSError) as full:  # the receiver never reads: its queue fills
        for _ in range(100_000):
            held.send(path, b"y" * 1024)
    assert full.value.errno == errno.EAGAIN  # never blocks
    with pytest.raises(OSError) as long:
        held.send("/" + "a" * 200, b"x")
    assert long.value.errno == errno.ENAMETOOLONG


def test_the_send_keeps_the_gil(pair: tuple[socket.socket, str, HeldSender, socket.socket]) -> None:
    """The call goes through a ``ctypes.PyDLL`` function (ctypes then keeps the GIL around the
    system call; a ``CDLL`` function would let go of it). Beside a busy thread that is what
    makes the difference: scripts/held_send_probe.py counts it (not a timed test)."""
    _, _, held, _ = pair
    fn = held._fn
    assert fn is not None
    assert fn._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]


def test_a_send_racing_close_is_delivered_or_refused_never_lost_or_raised() -> None:
    """A note sent while its backend closes either reaches the peer or is refused (the caller
    then sends it the other way): the raw send never runs on a closed descriptor."""
    got: list[bytes] = []
    rx = LocalNotes("rx", got.append)
    tx = LocalNotes("tx", lambda _: None)
    assert rx.address is not None and tx.address is not None
    results: list[bool] = []
    errors: list[BaseException] = []
    closed = threading.Event()

    def sender() -> None:
        try:
            i = 0
            while not closed.is_set():  # sends until the close, whatever the load
                results.append(tx.send(rx.address or "", i.to_bytes(8, "little")))
                i += 1
            results.append(tx.send(rx.address or "", b"after"))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=sender)
    t.start()
    while len(results) < 200 or True not in results:  # the sender is under way
        time.sleep(0.001)
    tx.close()
    closed.set()
    t.join()
    assert not errors
    assert results[-1] is False  # after the close every send is refused
    delivered = results.count(True)
    assert 1 <= delivered < len(results)  # (a full receiver queue refuses some: EAGAIN)
    seen, idle = -1, 0
    while len(got) < delivered and idle < 100:  # bounded by progress, not a deadline
        idle = idle + 1 if len(got) == seen else 0
        seen = len(got)
        time.sleep(0.05)
    rx.close()
    assert len(got) == delivered  # every accepted note arrived, none invented
