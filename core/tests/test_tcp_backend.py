"""``tcp``-specific tests the conformance suite cannot express.

The suite only drives backends through the public API, where the initiator checks remote
rows itself. Here hand-crafted ZeroMQ frames (see :mod:`kvwire.backends.tcp.wire`) play a
hostile or broken initiator or target, so the *target's* own checks, the I/O thread's
robustness, part splitting and metadata validation are tested directly. Agents run in this
process (two agents in one process talk over real sockets all the same).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvwire.backend import XferOp, XferState
from kvwire.backends.tcp import TcpBackend, wire
from kvwire.backends.tcp.backend import METADATA_VERSION
from kvwire.descriptors import make_table
from kvwire.errors import PeerError
from kvwire.layout import MemoryRegion
from kvwire.testing.conformance import wait_terminal

GUARD = 4096
MakeBackend = Callable[..., TcpBackend]


def addr_of(arr: np.ndarray) -> int:
    return int(arr.ctypes.data)


# ------------------------------------------------------------------------------ helpers


def wait_until(pred: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.001)


def drain_notifications(backend: TcpBackend, count: int, timeout: float = 5.0) -> list[Any]:
    """Notifications until ``count`` arrived (fails the test after ``timeout``)."""
    out: list[Any] = []

    def arrived() -> bool:
        out.extend(backend.get_notifications())
        return len(out) >= count

    wait_until(arrived, f"{count} notification(s)", timeout)
    return out


def recv(sock: zmq.Socket[Any], timeout: float = 5.0) -> list[bytes]:
    """One multipart message, or fail the test after ``timeout``."""
    if not sock.poll(int(timeout * 1000), zmq.POLLIN):
        pytest.fail(f"no message within {timeout}s")
    return list(sock.recv_multipart())


def rows(*pairs: tuple[int, int]) -> bytes:
    a = np.array([p[0] for p in pairs], dtype=np.uint64)
    n = np.array([p[1] for p in pairs], dtype=np.uint64)
    return wire.rows_to_bytes(a, n)


def request(
    xid: int, d: bytes, *, part: int = 0, nparts: int = 1, note: bytes | None = None
) -> bytes:
    return wire.pack(
        {"v": wire.VERSION, "x": xid, "f": "intruder", "d": d, "p": part, "np": nparts, "n": note}
    )


def dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


class Target:
    """A tcp agent with one registered region between guard bytes, plus unregistered memory."""

    def __init__(self, backend: TcpBackend) -> None:
        self.backend = backend
        self.buf = np.full(3 * GUARD, 0x77, dtype=np.uint8)
        self.region = MemoryRegion.from_pointer(addr_of(self.buf) + GUARD, GUARD, 1)
        self.foreign = np.full(GUARD, 0x33, dtype=np.uint8)  # writable, never registered
        backend.register([self.region])

    def untouched(self) -> bool:
        return bool((self.buf == 0x77).all() and (self.foreign == 0x33).all())


@pytest.fixture
def target(make_backend: MakeBackend) -> Target:
    return Target(make_backend("target"))


# ----------------------------------------------------------- target-side region checks
def test_raw_write_inside_region_is_accepted(target: Target, zctx: zmq.Context[Any]) -> None:
    """Control for the refusal tests: the same hand-crafted frames, aimed inside the region,
    are accepted, so a refusal below is the region check and not a malformed frame."""
    sock = dealer(zctx, target.backend.endpoint)
    payload = np.arange(128, dtype=np.uint8)
    sock.send_multipart(
        [
            wire.WRITE,
            request(1, rows((target.region.addr + 64, 128)), note=b"hi"),
            payload.tobytes(),
        ]
    )
    kind, header = recv(sock)
    assert kind == wire.ACK
    assert wire.unpack(header) == {"v": wire.VERSION, "x": 1, "p": 0, "ok": True}
    assert (target.buf[GUARD + 64 : GUARD + 192] == payload).all()
    assert (target.buf[: GUARD + 64] == 0x77).all() and (target.buf[GUARD + 192 :] == 0x77).all()
    assert [(n.peer, n.payload) for n in target.backend.get_notifications()] == [
        ("intruder", b"hi")
    ]
    assert target.backend.refused_messages == 0


def test_a_note_is_delivered_unanswered_and_garbage_notes_are_refused(
    target: Target, zctx: zmq.Context[Any]
) -> None:
    """A note (kind ``N``: a notification alone, what ``cudaipc`` sends once its kernel ended)
    is delivered and never answered, touching no memory; a note whose notification is not
    bytes, or whose header is not a map with a sender, is refused and counted, delivers
    nothing and is not answered either."""
    sock = dealer(zctx, target.backend.endpoint)
    note = {"v": wire.VERSION, "x": 7, "f": "intruder", "n": b"landed"}
    sock.send_multipart([wire.NOTE, wire.pack(note)])
    sock.send_multipart([wire.NOTE, wire.pack({**note, "n": 12345})])
    sock.send_multipart([wire.NOTE, wire.pack({"v": wire.VERSION, "x": 8, "n": b"x"})])
    sock.send_multipart([wire.NOTE, b"\xc1 not msgpack"])
    got: list[tuple[str, bytes]] = []
    for _ in range(500):
        got += [(n.peer, n.payload) for n in target.backend.get_notifications()]
        if target.backend.refused_messages >= 3:
            break
        time.sleep(0.01)
    got += [(n.peer, n.payload) for n in target.backend.get_notifications()]
    assert got == [("intruder", b"landed")]
    assert target.backend.refused_messages == 3
    assert not sock.poll(200, zmq.POLLIN), "a note was answered"
    assert target.untouched()


OUT_OF_REGION: dict[str, Callable[[Target], list[tuple[int, int]]]] = {
    "straddles the start": lambda t: [(t.region.addr - 64, 128)],
    "straddles the end": lambda t: [(t.region.end - 64, 128)],
    "guard before": lambda t: [(addr_of(t.buf), 256)],
    "guard after": lambda t: [(t.region.end, 256)],
    "unregistered process memory": lambda t: [(addr_of(t.foreign), GUARD)],
    "wraps past 2**64": lambda t: [((1 << 64) - 16, 32)],
    "one good row, one bad row": lambda t: [(t.region.addr, 64), (t.region.end - 8, 64)],
}


@pytest.mark.parametrize("case", OUT_OF_REGION, ids=list(OUT_OF_REGION))
def test_target_refuses_raw_write_outside_regions(
    target: Target, zctx: zmq.Context[Any], case: str
) -> None:
    """A hostile initiator that skips its own check cannot write outside the target's
    registered regions: NACK, counted, no byte changed (all-or-nothing), no notification."""
    sock = dealer(zctx, target.backend.endpoint)
    spans = OUT_OF_REGION[case](target)
    payload = np.full(sum(n for _, n in spans), 0xEE, dtype=np.uint8)
    sock.send_multipart([wire.WRITE, request(42, rows(*spans), note=b"no"), payload.tobytes()])
    reply = recv(sock)
    assert len(reply) == 2 and reply[0] == wire.ACK
    h = wire.unpack(reply[1])
    assert h["ok"] is False and h["x"] == 42
    assert "outside the target's registered regions" in h["e"]
    assert target.untouched(), "a refused write changed memory"
    assert target.backend.refused_messages == 1
    assert target.backend.get_notifications() == []


def test_target_refuses_raw_read_outside_regions(target: Target, zctx: zmq.Context[Any]) -> None:
    """A READ of unregistered memory is refused and leaks no bytes (no payload frame)."""
    target.foreign[:] = 0x42
    sock = dealer(zctx, target.backend.endpoint)
    sock.send_multipart([wire.READ, request(7, rows((addr_of(target.foreign), 64)))])
    reply = recv(sock)
    assert len(reply) == 2, "a refused READ must not carry data"
    h = wire.unpack(reply[1])
    assert (h["ok"], h["x"]) == (False, 7)
    assert target.backend.refused_messages == 1


def test_target_refuses_when_initiator_trusts_forged_metadata(
    target: Target, make_backend: MakeBackend
) -> None:
    """An initiator fooled by metadata claiming the whole address space passes its own
    check; the target still refuses, and the transfer ends FAILED with the target's reason."""
    meta = msgpack.unpackb(target.backend.local_metadata())
    meta["regions"] = [[0, (1 << 63), 0, 0]]
    initiator = make_backend("initiator")
    src = np.full(256, 0xEE, dtype=np.uint8)
    initiator.register([MemoryRegion.from_tensor(src)])
    peer = initiator.add_peer(msgpack.packb(meta))
    pair = initiator.prepare(
        peer, make_table([addr_of(src)], 256), make_table([addr_of(target.foreign)], 256)
    )
    handle = initiator.submit(XferOp.WRITE, pair, [0], [0], b"note")
    assert wait_terminal(initiator, handle, 10) is XferState.FAILED
    assert handle.error is not None and "peer refused" in handle.error
    assert "outside the target's registered regions" in handle.error
    assert target.untouched()
    assert target.backend.refused_messages == 1
    assert target.backend.get_notifications() == []
    initiator.release(handle)


# ------------------------------------------------------------------ malformed traffic
def test_malformed_requests_dropped_counted_and_io_thread_survives(
    target: Target, zctx: zmq.Context[Any], make_backend: MakeBackend
) -> None:
    """Garbage on the data socket is dropped and counted (NACKed when it names a transfer);
    the I/O thread survives and a good transfer works afterwards."""
    ok_rows = rows((target.region.addr, 64))
    garbage: list[tuple[list[bytes], int | None]] = [
        ([wire.WRITE], None),  # too few frames
        ([wire.WRITE, b"\xc1\xc1\xc1", b"x"], None),  # undecodable msgpack
        ([wire.WRITE, msgpack.packb([1, 2, 3]), b"x"], None),  # header not a map
        ([wire.WRITE, msgpack.packb({"v": 99, "x": 1}), b"x"], None),  # wrong version
        ([wire.WRITE, wire.pack({"v": 1, "x": "abc", "p": 0, "np": 1}), b"x"], None),
        ([wire.WRITE, wire.pack({"v": 1, "x": 1}), b"x"], None),  # missing keys
        ([wire.WRITE, request(101, b"short"), b"x"], 101),  # rows not 16-byte pairs
        ([wire.WRITE, request(102, rows((target.region.addr, 0))), b""], 102),  # zero-length
        ([wire.WRITE, request(103, ok_rows), b"x" * 10], 103),  # payload size mismatch
        ([wire.WRITE, request(104, ok_rows)], 104),  # write without payload
        ([b"Z", request(105, ok_rows), b"x" * 64], 105),  # unknown request kind
        ([wire.WRITE, request(106, ok_rows, note=b"\x00"), b"x" * 64, b"extra"], 106),
    ]
    sock = dealer(zctx, target.backend.endpoint)
    for frames, _ in garbage:
        sock.send_multipart(frames)
    wait_until(lambda: target.backend.refused_messages == len(garbage), "every bad message counted")
    nacked = sorted(wire.unpack(recv(sock)[1])["x"] for _ in [x for _, x in garbage if x])
    assert nacked == sorted(x for _, x in garbage if x is not None)
    assert not sock.poll(100, zmq.POLLIN), "unexpected extra reply"
    assert target.backend._loop.is_alive(), "the I/O thread died"
    assert target.untouched()
    assert target.backend.get_notifications() == []
    # A well-formed transfer still works.
    initiator = make_backend("initiator")
    src = np.arange(GUARD, dtype=np.uint8)
    initiator.register([MemoryRegion.from_tensor(src)])
    peer = initiator.add_peer(target.backend.local_metadata())
    pair = initiator.prepare(
        peer, make_table([addr_of(src)], GUARD), make_table([target.region.addr], GUARD)
    )
    handle = initiator.submit(XferOp.WRITE, pair, [0], [0], b"after-garbage")
    assert wait_terminal(initiator, handle, 10) is XferState.DONE
    assert (target.buf[GUARD : 2 * GUARD] == src).all()
    assert [n.payload for n in drain_notifications(target.backend, 1)] == [b"after-garbage"]
    assert target.backend.refused_messages == len(garbage)


class FakeTarget:
    """A raw ROUTER posing as a tcp agent, to feed the initiator hand-made replies."""

    def __init__(self, ctx: zmq.Context[Any], regions: list[list[int]]) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.metadata: bytes = msgpack.packb(
            {
                "v": METADATA_VERSION,
                "backend": "tcp",
                "name": "fake-target",
                "endpoint": f"tcp://127.0.0.1:{port}",
                "incarnation": "x",
                "regions": regions,
            }
        )

    def recv_request(self) -> tuple[bytes, bytes, dict[str, Any], list[bytes]]:
        ident, kind, header, *rest = recv(self.sock)
        return ident, kind, wire.unpack(header), rest

    def reply(self, ident: bytes, *frames: bytes) -> None:
        self.sock.send_multipart([ident, *frames])


@pytest.fixture
def write_to_fake(
    make_backend: MakeBackend, zctx: zmq.Context[Any]
) -> Callable[..., tuple[TcpBackend, FakeTarget, Any, np.ndarray, np.ndarray]]:
    """Initiator + fake target + a pending WRITE of ``nbytes`` (split as options say)."""

    def make(
        nbytes: int = 256, spans: list[tuple[int, int]] | None = None, **options: Any
    ) -> tuple[TcpBackend, FakeTarget, Any, np.ndarray, np.ndarray]:
        remote = np.zeros(nbytes + GUARD, dtype=np.uint8)  # only its address range is used
        fake = FakeTarget(zctx, [[addr_of(remote), remote.size, 0, 0]])
        initiator = make_backend("initiator", **options)
        src = np.frombuffer(np.random.default_rng(5).bytes(nbytes), dtype=np.uint8)
        initiator.register([MemoryRegion.from_tensor(src)])
        peer = initiator.add_peer(fake.metadata)
        spans = spans or [(0, nbytes)]
        offs = np.array([s for s, _ in spans])
        lens = np.array([n for _, n in spans])
        pair = initiator.prepare(
            peer,
            make_table(addr_of(src) + offs, lens),
            make_table(addr_of(remote) + offs + 8, lens),  # shifted: no accidental identity
        )
        idx = np.arange(len(spans))
        handle = initiator.submit(XferOp.WRITE, pair, idx, idx)
        return initiator, fake, handle, src, remote

    return make


def test_malformed_replies_dropped_counted_and_transfer_completes(
    write_to_fake: Callable[..., Any],
) -> None:
    """Bad replies to the initiator are dropped and counted, a late reply for an unknown
    transfer is ignored, and the real ACK that follows completes the transfer."""
    initiator, fake, handle, _, _ = write_to_fake()
    ident, kind, h, rest = fake.recv_request()
    assert kind == wire.WRITE and len(rest) == 1
    bad_replies = [
        [wire.ACK, b"\xc1\xc1"],  # undecodable
        [b"X", wire.pack({"v": 1, "x": h["x"], "p": 0, "ok": True})],  # not an ACK
        [wire.ACK],  # too short
        [wire.ACK, msgpack.packb({"v": 99, "x": h["x"], "ok": True})],  # wrong version
    ]
    for frames in bad_replies:
        fake.reply(ident, *frames)
    fake.reply(ident, wire.ACK, wire.pack({"v": 1, "x": 10**9, "p": 0, "ok": True}))  # unknown
    wait_until(lambda: initiator.refused_messages == len(bad_replies), "bad replies counted")
    assert initiator.poll(handle) is XferState.PENDING, "a bad reply completed the transfer"
    fake.reply(ident, wire.ACK, wire.pack({"v": 1, "x": h["x"], "p": h["np"] - 1, "ok": True}))
    assert wait_terminal(initiator, handle, 10) is XferState.DONE
    assert initiator.refused_messages == len(bad_replies)
    assert initiator._loop.is_alive()


def test_nack_fails_transfer_with_target_reason(write_to_fake: Callable[..., Any]) -> None:
    initiator, fake, handle, _, _ = write_to_fake()
    ident, _, h, _ = fake.recv_request()
    fake.reply(ident, wire.ACK, wire.pack({"v": 1, "x": h["x"], "p": 0, "ok": False, "e": "nope"}))
    assert wait_terminal(initiator, handle, 10) is XferState.FAILED
    assert handle.error == "peer refused: nope"


def test_silent_target_times_out(write_to_fake: Callable[..., Any]) -> None:
    """A target that never answers makes the transfer FAILED after transfer_timeout_s."""
    t0 = time.monotonic()
    initiator, _, handle, _, _ = write_to_fake(transfer_timeout_s=0.3)
    assert wait_terminal(initiator, handle, 10) is XferState.FAILED
    assert time.monotonic() - t0 >= 0.3
    assert handle.error is not None and "timed out" in handle.error


# ----------------------------------------------------------------------- part splitting
def test_parts_respect_max_part_bytes(write_to_fake: Callable[..., Any]) -> None:
    """With max_part_bytes=4096 a 64 KiB row is cut into 4096 B parts, numbered in order;
    short rows are grouped (a part may reach 2x the limit when a row straddles a boundary);
    reassembled from the parts, the bytes are exactly the source rows."""
    limit = 4096
    spans = [(0, 64 * 1024)] + [(64 * 1024 + i * 3100, 3000) for i in range(10)]
    total = 64 * 1024 + 10 * 3100
    initiator, fake, handle, src, remote = write_to_fake(total, spans, max_part_bytes=limit)
    base = addr_of(remote)
    model = np.zeros(remote.size, dtype=np.uint8)
    got_parts = []
    while True:
        ident, kind, h, rest = fake.recv_request()
        assert kind == wire.WRITE and len(rest) == 1
        addr, lens = wire.rows_from_bytes(h["d"])
        payload = np.frombuffer(rest[0], dtype=np.uint8)
        assert payload.size == int(lens.sum())
        assert payload.size <= 2 * limit
        assert (lens <= limit).all(), "a row longer than max_part_bytes was not split"
        pos = 0
        for a, n in zip(addr.tolist(), lens.tolist(), strict=True):
            model[a - base : a - base + n] = payload[pos : pos + n]
            pos += n
        got_parts.append((h["p"], h["np"], payload.size))
        assert h["n"] is None
        if h["p"] == h["np"] - 1:
            break
    nparts = got_parts[0][1]
    assert [p for p, _, _ in got_parts] == list(range(nparts))
    assert nparts >= 16 + 10 * 3000 // (2 * limit)
    assert all(size == limit for _, _, size in got_parts[:16]), "the long row's parts"
    expected = np.zeros(remote.size, dtype=np.uint8)
    for s, n in spans:
        expected[s + 8 : s + 8 + n] = src[s : s + n]
    assert (model == expected).all(), "reassembled parts differ from the source rows"
    assert initiator.poll(handle) is XferState.PENDING, "DONE before the last part's ACK"
    fake.reply(ident, wire.ACK, wire.pack({"v": 1, "x": h["x"], "p": nparts - 1, "ok": True}))
    assert wait_terminal(initiator, handle, 10) is XferState.DONE


def test_transfer_larger_than_max_part_bytes_arrives_intact(make_backend: MakeBackend) -> None:
    """Between real agents, WRITE and READ of rows far above max_part_bytes (and many rows
    straddling part boundaries) arrive intact, and the notification comes after all parts."""
    limit = 4096
    initiator = make_backend("initiator", max_part_bytes=limit)
    target = make_backend("target")
    rng = np.random.default_rng(3)
    n = 1 << 20
    src = np.frombuffer(bytearray(rng.bytes(n)), dtype=np.uint8)
    dst = np.zeros(n + GUARD, dtype=np.uint8)
    back = np.zeros(n, dtype=np.uint8)
    initiator.register([MemoryRegion.from_tensor(src), MemoryRegion.from_tensor(back)])
    target.register([MemoryRegion.from_tensor(dst)])
    peer = initiator.add_peer(target.local_metadata())
    # One 512 KiB row, then 100 rows of 3000 B with gaps, shuffled onto the target.
    offs = np.concatenate(([0], (1 << 19) + np.arange(100) * 5000))
    lens = np.concatenate(([1 << 19], np.full(100, 3000)))
    roffs = offs + 100
    pair = initiator.prepare(
        peer, make_table(addr_of(src) + offs, lens), make_table(addr_of(dst) + roffs, lens)
    )
    order = np.random.default_rng(1).permutation(lens.size)  # submitted in shuffled order
    expected = np.zeros_like(dst)
    for o, ro, ln in zip(offs.tolist(), roffs.tolist(), lens.tolist(), strict=True):
        expected[ro : ro + ln] = src[o : o + ln]
    handle = initiator.submit(XferOp.WRITE, pair, order, order, b"all-parts")
    assert wait_terminal(initiator, handle, 30) is XferState.DONE
    notes = drain_notifications(target, 1)
    assert (dst == expected).all(), "a split WRITE did not arrive intact"
    assert [x.payload for x in notes] == [b"all-parts"]
    initiator.release(handle)
    # READ it back through the same split path.
    pair2 = initiator.prepare(
        peer, make_table(addr_of(back) + offs, lens), make_table(addr_of(dst) + roffs, lens)
    )
    idx = np.arange(lens.size)
    handle = initiator.submit(XferOp.READ, pair2, idx, idx)
    assert wait_terminal(initiator, handle, 30) is XferState.DONE
    for o, ro, ln in zip(offs.tolist(), roffs.tolist(), lens.tolist(), strict=True):
        assert (back[o : o + ln] == dst[ro : ro + ln]).all(), "a split READ did not arrive intact"


# --------------------------------------------------------------------------- metadata
def _good_meta() -> dict[str, Any]:
    return {
        "v": METADATA_VERSION,
        "backend": "tcp",
        "name": "peer",
        "endpoint": "tcp://127.0.0.1:5555",
        "incarnation": "x",
        "regions": [[4096, 4096, 0, 0]],
    }


INVALID_METADATA: dict[str, tuple[bytes, str]] = {
    "not msgpack": (b"\xc1\xc1", "not valid msgpack"),
    "not a map": (msgpack.packb([1, 2]), "not produced by a tcp backend"),
    "other backend": (msgpack.packb({**_good_meta(), "backend": "nixl"}), "not produced by a tcp"),
    "other version": (msgpack.packb({**_good_meta(), "v": 99}), "version 99"),
    "no endpoint": (
        msgpack.packb({k: v for k, v in _good_meta().items() if k != "endpoint"}),
        "lacks 'endpoint'",
    ),
    "no name": (
        msgpack.packb({k: v for k, v in _good_meta().items() if k != "name"}),
        "lacks 'name'",
    ),
    "empty name": (msgpack.packb({**_good_meta(), "name": ""}), "names no agent"),
    "endpoint not tcp": (msgpack.packb({**_good_meta(), "endpoint": "garbage"}), "tcp://"),
    "endpoint without port": (
        msgpack.packb({**_good_meta(), "endpoint": "tcp://127.0.0.1"}),
        "cannot connect to endpoint",
    ),
    "regions not a list": (msgpack.packb({**_good_meta(), "regions": "x"}), "regions must be"),
    "region of two ints": (msgpack.packb({**_good_meta(), "regions": [[1, 2]]}), "regions must"),
    "region of unknown kind": (
        msgpack.packb({**_good_meta(), "regions": [[4096, 16, 0, 7]]}),
        "invalid region",
    ),
    "negative region": (
        msgpack.packb({**_good_meta(), "regions": [[-1, 16, 0, 0]]}),
        "invalid region",
    ),
}


@pytest.mark.parametrize("case", INVALID_METADATA, ids=list(INVALID_METADATA))
def test_invalid_metadata_rejected(make_backend: MakeBackend, case: str) -> None:
    """add_peer with bad metadata raises PeerError naming the problem, adds no peer, leaks
    nothing (close() returns promptly afterwards) and leaves the agent usable."""
    metadata, message = INVALID_METADATA[case]
    b = make_backend()
    with pytest.raises(PeerError, match=message):
        b.add_peer(metadata)
    assert b.peers() == []
    assert b.add_peer(msgpack.packb(_good_meta())) == "peer"
    closer = threading.Thread(target=b.close, daemon=True)
    closer.start()
    closer.join(timeout=5)
    assert not closer.is_alive(), "close() hangs after a failed add_peer (leaked socket)"


def test_wakers_fire_on_completion_failure_and_notification(make_backend: MakeBackend) -> None:
    """tcp pushes events: a write's ``wake`` is called once when it ends (done or failed,
    with the handle already terminal), and the target's notification waker once its
    notification is queued: owners sleep on these instead of polling on a timer."""
    assert TcpBackend.pushes_events
    initiator = make_backend("initiator")
    target = make_backend("target")
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    initiator.register([MemoryRegion.from_tensor(src)])
    target.register([MemoryRegion.from_tensor(dst)])
    noted = threading.Event()
    target.set_notification_waker(noted.set)
    peer = initiator.add_peer(target.local_metadata())
    pair = initiator.prepare(
        peer, make_table([addr_of(src)], [4096]), make_table([addr_of(dst)], [4096])
    )
    calls: list[int] = []
    done = threading.Event()

    def wake() -> None:
        calls.append(1)
        done.set()

    handle = initiator.submit(XferOp.WRITE, pair, [0], [0], b"n", wake=wake)
    assert done.wait(10), "the submitter was not woken when its write ended"
    assert noted.wait(10), "the notification waker was not called"
    assert initiator.poll(handle) is XferState.DONE  # terminal by the time it is woken
    assert [n.payload for n in drain_notifications(target, 1)] == [b"n"]
    assert (dst == src).all()
    initiator.release(handle)
    # a write that fails (its peer is removed while it cannot be delivered) wakes too
    failed = threading.Event()
    target.close()
    h = initiator.submit(XferOp.WRITE, pair, [0], [0], wake=failed.set)
    initiator.remove_peer(peer)
    assert failed.wait(10), "a failed write did not wake its submitter"
    assert initiator.poll(h) is XferState.FAILED
    assert calls == [1]  # once per write


# ------------------------------------------------------------- late writes (outages)
def test_a_write_part_past_its_write_by_time_is_dropped(
    target: Target, zctx: zmq.Context[Any]
) -> None:
    """A write part whose ``t`` (the time it had to land by) has passed is refused before any
    byte lands and its notification is not delivered; one still in time is written."""
    sock = dealer(zctx, target.backend.endpoint)
    late = wire.unpack(request(7, rows((target.region.addr, 64)), note=b"late"))
    late["t"] = time.time() - 0.001
    sock.send_multipart([wire.WRITE, wire.pack(late), bytes(range(64))])
    kind, header = recv(sock)
    reply = wire.unpack(header)
    assert kind == wire.ACK and reply["ok"] is False
    assert reply["e"] == "refused: the write arrived after the time it had to land by"
    assert target.untouched() and target.backend.get_notifications() == []
    assert target.backend.refused_messages == 1
    # the same part in time lands (so the refusal above is the time check)
    early = dict(late, x=8, t=time.time() + 60, n=b"early")
    sock.send_multipart([wire.WRITE, wire.pack(early), bytes(range(64))])
    assert wire.unpack(recv(sock)[1])["ok"] is True
    assert (target.buf[GUARD : GUARD + 64] == np.arange(64, dtype=np.uint8)).all()
    assert [n.payload for n in drain_notifications(target.backend, 1)] == [b"early"]


def test_bytes_held_up_past_the_deadline_never_land_after_failed(
    make_backend: MakeBackend,
) -> None:
    """An outage in small: the target's I/O thread is held while a write waits in its socket;
    the initiator reports FAILED at its deadline; when the target resumes, the part is dropped.
    Without the write-by time the bytes landed after FAILED (into pages decode may reuse)."""
    initiator = make_backend("initiator", transfer_timeout_s=0.5, late_write_guard_s=0.1)
    target = make_backend("target")
    src = np.full(4096, 0x5A, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    initiator.register([MemoryRegion.from_tensor(src)])
    target.register([MemoryRegion.from_tensor(dst)])
    pair = initiator.prepare(
        initiator.add_peer(target.local_metadata()),
        make_table([addr_of(src)], [4096]),
        make_table([addr_of(dst)], [4096]),
    )
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # runs on the target's I/O thread: nothing is served meanwhile
        held.set()
        release.wait(30)

    target._post(hold)
    assert held.wait(10)
    try:
        handle = initiator.submit(XferOp.WRITE, pair, [0], [0], b"done")
        assert wait_terminal(initiator, handle, 30) is XferState.FAILED
        assert "timed out" in (handle.error or "")
    finally:
        release.set()
    wait_until(lambda: target.refused_messages == 1, "the held part refused", 30)
    assert not dst.any(), "bytes of a FAILED transfer landed after the failure"
    assert target.get_notifications() == []
    initiator.release(handle)


def test_readable_says_whether_a_receive_would_wait_and_skips_a_closed_socket(
    zctx: zmq.Context[Any],
) -> None:
    """``control.reach.readable``, asked before every non-blocking receive of the tcp I/O
    loop and the control channel (and of the liveness thread's connection monitors): True
    only while a message waits; a closed socket reads as not readable instead of raising, so
    one socket in an error state cannot stop the loop's other duties (evicting dead peers)."""
    from kvwire.control.reach import readable

    a, b = zctx.socket(zmq.PAIR), zctx.socket(zmq.PAIR)
    a.bind("inproc://readable-test")
    b.connect("inproc://readable-test")
    assert not readable(a)
    b.send(b"x")
    assert a.poll(5000, zmq.POLLIN)
    assert readable(a)
    assert a.recv() == b"x"
    assert not readable(a)
    a.close(linger=0)
    assert not readable(a)
    b.close(linger=0)


def test_a_note_leaves_from_the_queueing_thread_while_the_io_thread_is_busy(
    make_backend: MakeBackend,
) -> None:
    """``_queue_note`` (``cudaipc``'s notification once its kernel ended) sends on the peer's
    notes socket from the calling thread: the note reaches the target while the initiator's
    I/O thread is held busy, and the transfer is DONE at once. With the notes socket gone
    it falls back to the I/O thread's queue: DONE only once that thread sent it. (Plain
    ``tcp`` opens no local notes socket: test_tcp_local_notes.py.)"""
    a, b = make_backend("notes-a"), make_backend("notes-b")
    peer = a.add_peer(b.local_metadata())
    p = a._peers[peer]
    release, busy = threading.Event(), threading.Event()
    got: list[bytes] = []

    def hold() -> None:  # the I/O thread runs this before its next turn
        busy.set()
        release.wait(30)

    def collect(n: int) -> None:
        for _ in range(2000):
            got.extend(x.payload for x in b.get_notifications())
            if len(got) >= n:
                return
            time.sleep(0.005)

    notes = p.notes
    try:
        a._post(hold)
        assert busy.wait(10)
        x = a._queue_note(peer, b"landed")
        assert x.status is XferState.DONE
        collect(1)
        assert got == [b"landed"], "the note waited for the busy I/O thread"
        with p.notes_lock:  # as if closed: the queue path takes over
            p.notes = None
        y = a._queue_note(peer, b"queued")
        assert y.status is XferState.PENDING  # the I/O thread is still held
    finally:
        release.set()
        with p.notes_lock:
            p.notes = notes  # closed with the peer (an unclosed socket hangs the context)
    for _ in range(2000):
        if y.status is not XferState.PENDING:
            break
        time.sleep(0.005)
    assert y.status is XferState.DONE
    collect(2)
    assert got == [b"landed", b"queued"]
