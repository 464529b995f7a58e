"""kvwire.backends.tcp.held_send: local notes' datagram send with the GIL kept."""

from __future__ import annotations

import ctypes
import errno
import socket
from collections.abc import Iterator

import pytest

from kvwire.backends.tcp.held_send import HeldSender

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
