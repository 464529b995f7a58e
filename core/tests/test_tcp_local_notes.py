"""Notes between ``tcp`` backends of one host over a UNIX datagram socket
(:mod:`kvwire.backends.tcp.local_notes`): what ``cudaipc`` sends once its kernel ended.

A note to a peer on this host leaves from the queueing thread as a datagram; every case where
that way cannot take it (the option off, another host, the peer's socket gone, its queue full)
still delivers the note over ZeroMQ, so none is lost; a peer cannot point notes at another
program's socket; garbage on the socket is refused and counted. Only a class that sends
notes alone opens the socket: ``cudaipc``, which needs a GPU, is played here by a ``tcp``
subclass that says so; plain ``tcp`` opens none. The latency this buys is a benchmark
(``scripts/note_latency.py``), not a test."""

from __future__ import annotations

import pathlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest

from kvwire.backends.tcp import TcpBackend, wire
from kvwire.backends.tcp.options import TcpOptions
from kvwire.errors import PeerError

MakeBackend = Callable[..., TcpBackend]


class NotingTcp(TcpBackend):
    """A ``tcp`` backend that sends notes alone, as ``cudaipc`` does after its kernel."""

    sends_notes = True


@pytest.fixture
def make_backend() -> Iterator[MakeBackend]:
    """Factory of in-process :class:`NotingTcp` agents, closed at teardown."""
    made: list[TcpBackend] = []

    def make(name: str, **options: Any) -> TcpBackend:
        b = NotingTcp(name, TcpOptions(**options))
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def test_plain_tcp_opens_no_notes_socket() -> None:
    """``tcp`` carries its notifications in its transfers' last parts: no socket, thread or
    directory for notes, and none offered in its metadata."""
    b = TcpBackend("plain", TcpOptions())
    try:
        assert b._local is None
        assert "notes_path" not in msgpack.unpackb(b.local_metadata())
        assert not [t for t in threading.enumerate() if t.name == "kvwire-notes-plain"]
    finally:
        b.close()


def received(backend: TcpBackend, count: int, timeout: float = 10.0) -> list[tuple[str, bytes]]:
    """The notifications ``backend`` queued until ``count`` arrived (bounded by progress:
    fails only when none arrives for ``timeout`` seconds)."""
    got: list[tuple[str, bytes]] = []
    woke = threading.Event()
    backend.set_notification_waker(woke.set)
    while len(got) < count:
        more = [(n.peer, n.payload) for n in backend.get_notifications()]
        got += more
        if not more and len(got) < count:
            assert woke.wait(timeout), f"{len(got)} of {count} notes arrived"
            woke.clear()
    return got


def linked(make_backend: MakeBackend, **options: object) -> tuple[TcpBackend, TcpBackend, str]:
    """A sender and a receiver on this host, the sender knowing the receiver as a peer."""
    tx, rx = make_backend("tx", **options), make_backend("rx", **options)
    return tx, rx, tx.add_peer(rx.local_metadata())


def test_a_note_to_a_peer_on_this_host_goes_over_its_datagram_socket(
    make_backend: MakeBackend,
) -> None:
    tx, rx, peer = linked(make_backend)
    meta = msgpack.unpackb(rx.local_metadata())
    assert meta["host"] == tx.host and meta["notes_path"].endswith("/n")
    x = tx._queue_note(peer, b"landed-1")
    assert x.status.name == "DONE"  # handed over: nothing answers a note
    assert received(rx, 1) == [("tx", b"landed-1")]
    assert tx._local is not None and (tx._local.sent, tx._local.fallbacks) == (1, 0)


@pytest.mark.parametrize("case", ["option off", "another host"])
def test_without_the_local_way_notes_still_arrive_over_zeromq(
    make_backend: MakeBackend, case: str
) -> None:
    if case == "option off":
        tx, rx, peer = linked(make_backend, local_notes=False)
        assert "notes_path" not in msgpack.unpackb(rx.local_metadata())
        assert tx._local is None
    else:
        tx, rx = make_backend("tx"), make_backend("rx")
        meta = msgpack.unpackb(rx.local_metadata())
        meta["host"] = {**meta["host"], "boot_id": "another-boot"}
        peer = tx.add_peer(msgpack.packb(meta))
    for i in range(3):
        tx._queue_note(peer, b"n%d" % i)
    assert sorted(received(rx, 3)) == [("tx", b"n0"), ("tx", b"n1"), ("tx", b"n2")]
    if tx._local is not None:
        assert tx._local.sent == 0


def test_a_peer_whose_socket_is_gone_gets_its_notes_over_zeromq(
    make_backend: MakeBackend,
) -> None:
    tx, rx, peer = linked(make_backend)
    assert rx._local is not None
    rx._local.close()  # its datagram socket gone, its data plane alive
    tx._queue_note(peer, b"after")
    assert received(rx, 1) == [("tx", b"after")]
    assert tx._local is not None and (tx._local.sent, tx._local.fallbacks) == (0, 1)


def test_a_full_socket_sends_the_rest_over_zeromq_and_no_note_is_lost(
    make_backend: MakeBackend,
) -> None:
    """The receiver's thread is held while 200 notes are queued: the kernel's queue of the
    datagram socket fills (a few datagrams), the rest go over ZeroMQ; once released every
    note is delivered exactly once."""
    tx, rx, peer = linked(make_backend)
    held, entered = threading.Event(), threading.Event()
    deliver = rx._on_local_note

    def slow(datagram: bytes) -> None:
        entered.set()
        held.wait()
        deliver(datagram)

    assert rx._local is not None
    rx._local._deliver = slow
    tx._queue_note(peer, b"first")
    assert entered.wait(10)
    for i in range(200):
        tx._queue_note(peer, b"%d" % i)
    assert tx._local is not None and tx._local.fallbacks > 0
    over_zmq = received(rx, tx._local.fallbacks)  # delivered while the socket is held
    held.set()
    rest = received(rx, 201 - len(over_zmq))
    got = sorted(p for _, p in over_zmq + rest)
    assert got == sorted([b"first", *(b"%d" % i for i in range(200))])
    assert not rx.get_notifications()


@pytest.mark.parametrize(
    "path",
    ["/dev/log", "relative/kvwire-notes-x/n", "/tmp/kvwire-notes-x/other", "/tmp/elsewhere/n", 7],
)
def test_a_peer_cannot_point_notes_at_another_socket(
    make_backend: MakeBackend, path: object
) -> None:
    tx, rx = make_backend("tx"), make_backend("rx")
    meta = msgpack.unpackb(rx.local_metadata())
    meta["notes_path"] = path
    with pytest.raises(PeerError, match="notes_path"):
        tx.add_peer(msgpack.packb(meta))
    assert tx.peers() == []


def test_garbage_on_the_socket_is_refused_counted_and_notes_still_arrive(
    make_backend: MakeBackend,
) -> None:
    tx, rx, peer = linked(make_backend)
    assert rx._local is not None and rx._local.address is not None
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        for junk in (b"\xc1 not msgpack", b"", wire.pack({"v": wire.VERSION, "x": 1})):
            raw.sendto(junk, rx._local.address)
    finally:
        raw.close()
    tx._queue_note(peer, b"good")
    assert received(rx, 1) == [("tx", b"good")]
    assert rx.refused_messages == 3


def test_close_removes_the_socket_and_its_directory(make_backend: MakeBackend) -> None:
    import os

    b = make_backend("one")
    assert b._local is not None and b._local.address is not None
    folder = os.path.dirname(b._local.address)
    assert os.stat(folder).st_mode & 0o777 == 0o700  # same user only
    b.close()
    assert not os.path.exists(folder)


def test_directories_left_by_killed_backends_are_removed_live_ones_kept(
    tmp_path: pathlib.Path,
) -> None:
    """A backend killed before its close leaves its notes directory: the next one to start
    removes it once it is old enough, and keeps a young one (a backend between mkdir and
    bind) and one whose socket is bound."""
    import os

    from kvwire.backends.tcp.local_notes import PREFIX, STALE_AFTER_S, remove_stale

    old = time.time() - 2 * STALE_AFTER_S

    def made(name: str, bound: bool, age: float) -> tuple[pathlib.Path, socket.socket | None]:
        d = tmp_path / f"{PREFIX}{name}"
        d.mkdir()
        sock = None
        if bound:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(str(d / "n"))
        else:
            (d / "n").touch()  # a socket file nobody is bound to any more
        os.utime(d, (age, age))
        return d, sock

    dead, _ = made("dead", False, old)
    young, _ = made("young", False, time.time())
    live, sock = made("live", True, old)
    other = tmp_path / "not-ours"
    other.mkdir()
    os.utime(other, (old, old))
    try:
        assert remove_stale(str(tmp_path)) == 1
    finally:
        assert sock is not None
        sock.close()
    assert not dead.exists() and young.exists() and live.exists() and other.exists()
