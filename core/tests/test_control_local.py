"""The control channel's local way (kvwire.control.local_way): control frames between managers
of one network namespace over a UNIX sequenced-packet socket. Real channels and managers
(tcp backend, ZeroMQ beside the local way) in one process."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from kvwire.control import local_way
from kvwire.control.channel import ControlChannel
from kvwire.control.wire import Codec, Heartbeat, Message, TransferRequest
from kvwire.errors import ProtocolError
from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster
from kvwire.testing.cluster_spec import ClusterSpec
from kvwire.testing.cluster_suite import assert_all_ok
from kvwire.testing.pair import config, no_rooms, pair

pytestmark = pytest.mark.skipif(not local_way.supported(), reason="Linux UNIX sockets only")

SECRET = b"local-way-secret"
FIXTURES = Path(__file__).parent / "fixtures" / "wire"


@pytest.fixture(params=[None, SECRET], ids=["plain", "secret"])
def two(request: pytest.FixtureRequest) -> Iterator[tuple[ControlChannel, ControlChannel]]:
    secret = request.param
    a = ControlChannel(Codec(secret), agent="a")
    b = ControlChannel(Codec(secret), agent="b")
    yield a, b
    a.close()
    b.close()


def take(ch: ControlChannel, n: int) -> list[Message]:
    """Receive until ``n`` messages came (bounded by progress: fails after 10 s without one)."""
    got: list[Message] = []
    idle_since = time.monotonic()
    while len(got) < n:
        batch = ch.receive(0.05)
        if batch:
            got.extend(batch)
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > 10:
            raise AssertionError(f"{len(got)} of {n} messages arrived")
    return got


def beats(msgs: list[Message]) -> list[float]:
    return [m.sent_at for m in msgs if isinstance(m, Heartbeat)]


def big_request(room: int) -> TransferRequest:
    """A frame above the local way's limit (its dst_pages alone are 300 KiB)."""
    return TransferRequest(room=room, session="s", dst_pages=bytes(300 << 10))


def test_frames_take_the_local_way_after_set_local(
    two: tuple[ControlChannel, ControlChannel],
) -> None:
    a, b = two
    assert local_way.valid_name(b.local_name)
    a.tell(b.endpoint, Heartbeat(session="a", sent_at=-1.0))  # the handshake's: ZeroMQ
    assert beats(take(b, 1)) == [-1.0]
    assert a.local_counts["sent"] == 0
    assert a.set_local(b.endpoint, b.local_name)
    for i in range(50):
        assert a.tell(b.endpoint, Heartbeat(session="a", sent_at=float(i)))
    assert beats(take(b, 50)) == [float(i) for i in range(50)]
    assert a.local_counts["sent"] == 50
    assert b.local_counts["inbound"] == 1
    assert not b.dropped


def test_order_holds_when_a_sender_leaves_the_way(
    two: tuple[ControlChannel, ControlChannel],
) -> None:
    """A frame too large for the local way sends it and every later frame over ZeroMQ; the
    receiver, reading nothing until all were sent, still hands them over in sending order."""
    a, b = two
    assert a.set_local(b.endpoint, b.local_name)
    for i in range(100):
        a.tell(b.endpoint, Heartbeat(session="a", sent_at=float(i)))
    assert a.tell(b.endpoint, big_request(7))
    for i in range(100, 200):
        a.tell(b.endpoint, Heartbeat(session="a", sent_at=float(i)))
    assert a.local_counts == {"sent": 100, "left": 1, "inbound": 0}
    got = take(b, 201)
    kinds = [m.kind for m in got]
    assert kinds.index("transfer_request") == 100
    assert beats(got) == [float(i) for i in range(200)]


def test_a_full_queue_drops_and_counts_without_blocking(
    two: tuple[ControlChannel, ControlChannel],
) -> None:
    a, b = two
    assert a.set_local(b.endpoint, b.local_name)
    sent = 0
    while a.tell(b.endpoint, Heartbeat(session="a", sent_at=float(sent))):
        sent += 1
        assert sent < 1_000_000, "the local queue never filled"
    assert a.dropped["send_full"] == 1
    assert a.local_counts["left"] == 0  # a full queue drops a frame; the way stays
    got = take(b, sent)
    assert beats(got) == [float(i) for i in range(sent)]  # all before the drop, in order
    assert a.tell(b.endpoint, Heartbeat(session="a", sent_at=-2.0))  # room again
    assert beats(take(b, 1)) == [-2.0]
    assert a.local_counts["sent"] == sent + 1


def test_a_closed_inbox_sends_the_sender_back_to_zeromq(
    two: tuple[ControlChannel, ControlChannel],
) -> None:
    a, b = two
    assert a.set_local(b.endpoint, b.local_name)
    a.tell(b.endpoint, Heartbeat(session="a", sent_at=0.0))
    assert beats(take(b, 1)) == [0.0]
    inbox = b._inbox  # its socket and connections go, as if the way broke under the peer
    assert inbox is not None
    inbox.close()
    b._inbox = None
    for i in (1.0, 2.0, 3.0):
        assert a.tell(b.endpoint, Heartbeat(session="a", sent_at=i))
    assert a.local_counts["left"] == 1
    assert beats(take(b, 3)) == [1.0, 2.0, 3.0]  # over ZeroMQ, none lost


def raw_connection(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 << 20)
    s.connect("\0" + name)
    return s


def test_garbage_on_the_local_socket_is_dropped_and_counted() -> None:
    b = ControlChannel(Codec(SECRET), agent="b")
    a = ControlChannel(Codec(SECRET), agent="a")
    unsigned = ControlChannel(Codec(), agent="u")
    try:
        junk = raw_connection(b.local_name)
        junk.send(b"\x00not msgpack at all")
        junk.send(b"\x93\x01\x02")  # msgpack, not a frame
        # a well-formed frame without the secret's MAC
        junk.send(unsigned.codec.encode(Heartbeat(session="u"), to=b.endpoint))
        # a frame for another endpoint: signed, but its stamp names someone else
        junk.send(a.codec.encode(Heartbeat(session="a"), to="tcp://127.0.0.1:1"))
        huge = raw_connection(b.local_name)
        huge.send(bytes(local_way.MAX_LOCAL_FRAME + 10))
        assert a.set_local(b.endpoint, b.local_name)
        a.tell(b.endpoint, Heartbeat(session="a", sent_at=5.0))
        assert beats(take(b, 1)) == [5.0]  # the one authentic frame
        assert b.dropped["malformed"] == 3  # two junk frames and the oversized packet
        assert b.dropped["unauthenticated"] == 1
        assert b.dropped["stale"] == 1
        assert b.local_counts["inbound"] == 2  # the oversized packet's connection was closed
        with pytest.raises(OSError):
            for _ in range(100):
                huge.send(b"x")
                time.sleep(0.01)
        junk.close()  # the kernel marks the connection ended at once: the next drain sees it
        b.receive(1.0)
        assert b.local_counts["inbound"] == 1
    finally:
        a.close()
        b.close()
        unsigned.close()


def test_connections_beyond_the_cap_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_way, "MAX_CONNECTIONS", 3)
    b = ControlChannel(Codec(), agent="b")
    senders = [ControlChannel(Codec(), agent=f"s{i}") for i in range(5)]
    try:
        for i, s in enumerate(senders):
            assert s.set_local(b.endpoint, b.local_name)  # the kernel queues the connection
            s.tell(b.endpoint, Heartbeat(session=f"s{i}", sent_at=float(i)))
        got = take(b, 3)
        assert sorted(beats(got)) == [0.0, 1.0, 2.0]
        assert b.local_counts["inbound"] == 3
        assert b._inbox is not None and b._inbox.refused == 2
        # the refused senders learn it at their next frame and go over ZeroMQ from then on;
        # what they sent before the refusal is lost (the documented limit of the cap)
        for s in senders[3:]:
            assert s.tell(b.endpoint, Heartbeat(session="late", sent_at=9.0))
            assert s.local_counts["left"] == 1
        assert beats(take(b, 2)) == [9.0, 9.0]  # and not the lost 3.0 and 4.0
    finally:
        for s in senders:
            s.close()
        b.close()


def test_only_kvwire_names_in_this_namespace_are_used() -> None:
    a = ControlChannel(Codec(), agent="a")
    off = ControlChannel(Codec(), agent="off", local=False)
    try:
        assert off.local_name == ""
        assert not off.set_local(a.endpoint, a.local_name)  # off here: ZeroMQ both ways
        for bad in ("", "../../tmp/x", "/tmp/.X11-unix/X0", "kvwire-ctl-" + "g" * 32):
            assert not a.set_local(off.endpoint, bad)
        assert not a.set_local(off.endpoint, "kvwire-ctl-" + "0" * 32)  # nobody listens
        assert a.local_counts["sent"] == 0
    finally:
        a.close()
        off.close()


def test_a_hello_with_a_foreign_local_name_is_malformed() -> None:
    """A peer cannot point our frames at another program's socket: the handshake message
    naming one is malformed, dropped as any other."""
    stored = FIXTURES / "v1.13" / "hello.bin"
    outer = msgpack.unpackb(stored.read_bytes())
    body = msgpack.unpackb(outer[3])
    assert local_way.valid_name(body["local_control"])
    for bad in ("/tmp/.X11-unix/X0", "kvwire-ctl-" + "0" * 31, "kvwire-ctl-" + "0" * 33):
        body["local_control"] = bad
        outer[3] = msgpack.packb(body)
        with pytest.raises(ProtocolError, match="local_control"):
            Codec().decode(msgpack.packb(outer))


# ---------------------------------------------------------------------- through managers
def test_requests_take_the_local_way_between_managers() -> None:
    with pair(config()) as p:
        for room in (1, 2, 3):
            p.transfer(room, pages=5, chunks=(2, 0, 3))
        assert no_rooms(p.prefill) and no_rooms(p.decode)
        assert p.decode.channel.local_counts["sent"] >= 3  # the transfer requests at least
        assert p.prefill.channel.local_counts["inbound"] == 1
        assert p.prefill.channel.local_counts["left"] == 0


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_one_side_off_keeps_both_on_zeromq(side: str) -> None:
    off = config(local_control=False)
    on = config()
    with pair(off if side == "prefill" else on, on if side == "prefill" else off) as p:
        p.transfer(1)
        p.transfer(2)
        for mgr in (p.prefill, p.decode):
            assert mgr.channel.local_counts["sent"] == 0
            assert mgr.channel.local_counts["inbound"] == 0


def test_secret_on_both_sides_over_the_local_way() -> None:
    with pair(config(secret="s3cret")) as p:
        p.transfer(1)
        p.transfer(2)
        assert p.decode.channel.local_counts["sent"] >= 2
        assert not p.prefill.dropped


def test_a_peer_in_another_network_namespace_stays_on_zeromq() -> None:
    """An abstract name lives in its network namespace: a peer in another one (another
    container, or a partition test's host) is not reachable so, and its frames keep going
    over ZeroMQ (over whatever network joins the two)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a network namespace of its own")
    child = subprocess.Popen(
        [
            "unshare",
            "--net",
            sys.executable,
            "-c",
            "import sys\n"
            "from kvwire.control.channel import ControlChannel\n"
            "from kvwire.control.wire import Codec\n"
            "ch = ControlChannel(Codec(), agent='elsewhere')\n"
            "print(ch.local_name, flush=True)\n"
            "sys.stdin.read()\n"
            "ch.close()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    here = ControlChannel(Codec(), agent="here")
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip()
        assert local_way.valid_name(name), name  # it has a local name, in its namespace
        assert not here.set_local("tcp://10.0.0.2:5555", name)
        assert here.local_counts["sent"] == 0
    finally:
        here.close()
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)


def test_python_socket_calls_serve_where_the_c_library_has_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where ``kvwire.held_io`` finds no C function, the local way uses Python's socket
    methods: the same frames, the same order, the same drop of an oversized packet."""
    monkeypatch.setattr(local_way, "_send_fn", lambda: None)
    monkeypatch.setattr(local_way, "_recv_fn", lambda: None)
    a = ControlChannel(Codec(SECRET), agent="a")
    b = ControlChannel(Codec(SECRET), agent="b")
    try:
        assert a._outbox._send is None and b._inbox is not None and b._inbox._recv is None
        assert a.set_local(b.endpoint, b.local_name)
        for i in range(20):
            a.tell(b.endpoint, Heartbeat(session="a", sent_at=float(i)))
        a.tell(b.endpoint, big_request(3))  # leaves for ZeroMQ
        a.tell(b.endpoint, Heartbeat(session="a", sent_at=20.0))
        got = take(b, 22)
        assert beats(got) == [float(i) for i in range(21)]
        assert [m.kind for m in got].index("transfer_request") == 20
        assert a.local_counts["sent"] == 20
        huge = raw_connection(b.local_name)
        huge.send(bytes(local_way.MAX_LOCAL_FRAME + 10))
        b.receive(0.05)
        assert b.dropped["malformed"] == 1
        huge.close()
    finally:
        a.close()
        b.close()


def test_rank_processes_use_the_local_way() -> None:
    """Real rank processes (prefill TP 2 -> decode TP 1) on one host: their control frames
    take the local way both ways (each rank's channel counts), and every request's elements
    are right."""
    model = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype="int32", page_size=2)
    spec = ClusterSpec(
        model=model, slots=64, aux_slots=16, prefill_tp=2, decode_tp=1, config=config()
    )
    with Cluster(spec) as c:
        assert_all_ok(c.run(c.plans(8), concurrency=4))
        stats = c.rank_stats()
    decode = [v for k, v in stats.items() if k.startswith("kvwire-decode")]
    prefill = [v for k, v in stats.items() if k.startswith("kvwire-prefill")]
    assert len(decode) == 1 and len(prefill) == 2, sorted(stats)
    assert decode[0]["local_sent"] >= 8  # a transfer request to each source, at least
    assert decode[0]["local_inbound"] == 2  # both prefill ranks connected back
    for p in prefill:
        assert p["local_inbound"] == 1 and p["local_left"] == 0
