"""Faults a test can inject into the rank processes of :mod:`kvwire.testing.cluster`, to prove
that verification catches them. Selected with the ``KVWIRE_TESTING_FAULT`` environment variable
(inherited by spawned ranks); never used outside tests.

Also garbage for a rank's control endpoint (:func:`garbage_frames`, :func:`flood`): frames that
no manager may act on, sent from a plain ZeroMQ PUSH socket, with the drop counters they must
produce (:func:`expected_drops`).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from kvwire.index.head_slice import HeadSliceMapper

if TYPE_CHECKING:
    from kvwire.session.checksums import LandedSums


def _head_slice_offset(role: str) -> None:
    """Prefill's head-slice mapper writes every slice at destination head 0 (in bounds, so only
    the decode side's element check can notice)."""
    if role != "prefill":
        return
    original = HeadSliceMapper.__init__

    def broken(self: HeadSliceMapper, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.dst_start = 0

    HeadSliceMapper.__init__ = broken  # type: ignore[method-assign]


def _lossy_staging(role: str) -> None:
    """Every staging control message is lost with probability 1/4 and sent twice with
    probability 1/4 (both sides): the lifecycle must retry, ignore duplicates and never hang."""
    import random

    from kvwire.control import wire
    from kvwire.control.channel import ControlChannel

    kinds = (
        wire.StagingMessage,
        wire.WritesDone,
        wire.WritesQuery,
    )
    rng = random.Random(f"lossy-{role}")
    original = ControlChannel.tell

    def lossy(self: ControlChannel, endpoint: str, msg: wire.Message) -> bool:
        if isinstance(msg, kinds):
            r = rng.random()
            if r < 0.25:
                return True  # lost on the way
            if r < 0.5:
                original(self, endpoint, msg)  # delivered twice
        return original(self, endpoint, msg)

    ControlChannel.tell = lossy  # type: ignore[method-assign]


#: Rooms from here on (65,536 of them) are the victims of ``aux_submit_fails``.
AUX_FAIL_ROOMS = 0x7A11 << 40


def _refused_aux(note: bytes) -> int | None:
    """The room of a notification that carries a victim room's aux row (the aux row as a
    write of its own, or riding in the last chunk's note, protocol 1.11), else None."""
    outer = msgpack.unpackb(note, raw=False)
    body = msgpack.unpackb(outer[3], raw=False)
    room = int(body.get("room", -1))
    carries_aux = body.get("what") == "aux" or body.get("aux") is not None
    if 0 <= room - AUX_FAIL_ROOMS < 1 << 16 and outer[2] == "note" and carries_aux:
        return room
    return None


def _flaky_backend(role: str) -> None:
    """Either role: the ``flaky`` test backend (:mod:`kvwire.testing.flaky`) joins this
    process's plugin registry, so ``--transfer-backend flaky,tcp`` builds; with
    :data:`~kvwire.testing.flaky.FLAG_DIR_ENV` set, a flag file breaks it (the soak's
    ``dead_backend``)."""
    from kvwire import plugins
    from kvwire.testing import flaky

    plugins._registry = plugins.PluginRegistry(extra=[("flaky", flaky)])


def _aux_submit_fails(role: str) -> None:
    """Prefill's backend refuses to post the aux write of the rooms from
    :data:`AUX_FAIL_ROOMS` on (``submit`` raises :class:`~kvwire.errors.PeerError`, as a backend
    does when the engine refuses a post): the aux row's own write, or the last chunk's write
    whose note carries it (protocol 1.11); every other transfer goes through."""
    if role != "prefill":
        return
    from kvwire.backend import TransferBackend
    from kvwire.errors import PeerError
    from kvwire.transfers import note_bytes

    def refuse(method: Callable[..., Any], note_at: int) -> Callable[..., Any]:
        """``method``, refusing a victim's aux write (the notification is argument
        ``note_at`` after self, or the keyword)."""

        def refusing(self: TransferBackend, *args: Any, **kwargs: Any) -> Any:
            note = note_bytes(args[note_at] if len(args) > note_at else kwargs.get("notification"))
            room = _refused_aux(note) if note else None  # a later note is made now
            if room is not None:
                raise PeerError(f"injected: the engine refused room {room}'s aux write")
            return method(self, *args, **kwargs)

        return refusing

    TransferBackend.submit = refuse(TransferBackend.submit, 4)  # type: ignore[method-assign]
    # A list of backends posts through its members' submit: refused there, the refusal would
    # read as a broken link and move the link to its fallback. Refused by the list itself,
    # the request fails as with one backend.
    from kvwire.backends.multi import MultiBackend

    MultiBackend.submit = refuse(MultiBackend.submit, 4)  # type: ignore[method-assign]
    MultiBackend.submit_pages = refuse(MultiBackend.submit_pages, 3)  # type: ignore[method-assign]


def flip_landed(
    landed: LandedSums,
    num_pages: int,
    dst_pages: Any,
    cached_tokens: int | None,
    span: tuple[int, int],
    layers: tuple[int, int] | None = None,
    *,
    layer: int | None = None,
    offset: int = 0,
) -> int | None:
    """Flip one bit (bit 0 of byte ``offset``) of the first destination row, in row order, that
    the chunk of request pages ``span`` wrote on this decode rank (as ``landed``, the link's
    :class:`~kvwire.session.checksums.LandedSums`, finds its rows), among the rows of layers
    ``[a, b)`` when ``layers`` is given (one piece) and of ``layer`` when given; returns the
    row's layer, or None when no row qualifies. Host memory only (``ctypes``)."""
    import ctypes

    import numpy as np

    from kvwire.descriptors import ADDR, LEN

    start, end = span
    placeholder = np.zeros(end - start, dtype=np.int64)
    src_units, lo, hi = landed.mapper.chunk_slice(
        num_pages, dst_pages, placeholder, start, end, cached_tokens
    )
    _, dst_idx = landed.mapper.map_chunk(src_units, dst_pages[lo:hi])
    idx = np.asarray(dst_idx, dtype=np.int64)
    row_layers = landed.hasher.row_layers(landed.dst, idx)
    keep = np.ones(idx.size, dtype=bool)
    if layers is not None:
        keep &= (row_layers >= layers[0]) & (row_layers < layers[1])
    if layer is not None:
        keep &= row_layers == layer
    if not keep.any():
        return None
    first = int(np.flatnonzero(keep)[0])
    row = landed.dst[int(idx[first])]
    byte = ctypes.c_uint8.from_address(int(row[ADDR]) + offset % int(row[LEN]))
    byte.value ^= 0x01
    return int(row_layers[first])


def landed_flipper(
    *,
    layer: int | None = None,
    offset: int = 0,
    spans: Callable[[tuple[int, int]], bool] | None = None,
) -> Callable[..., Any]:
    """A replacement for :meth:`LandedSums.chunk <kvwire.session.checksums.LandedSums.chunk>`
    (the start of decode's check of a landed chunk, or piece) that first corrupts the landed
    rows with :func:`flip_landed` (for the chunks whose request page span ``spans`` accepts),
    then sums them as the original does (the one in place when this is called): exactly what
    a transport that corrupted one byte in flight looks like to the check, whenever and
    however prefill summed the chunk, on every backend, staged or not, whole or in pieces."""
    from kvwire.session.checksums import LandedSums

    original = LandedSums.chunk

    def chunk(
        self: LandedSums,
        num_pages: int,
        dst_pages: Any,
        cached_tokens: int | None,
        span: tuple[int, int],
        layers: tuple[int, int] | None = None,
    ) -> Any:
        if spans is None or spans(span):
            flip_landed(
                self, num_pages, dst_pages, cached_tokens, span, layers, layer=layer, offset=offset
            )
        return original(self, num_pages, dst_pages, cached_tokens, span, layers)

    return chunk


def landed_group_flipper(
    *, key: int | None = None, whole_row: bool = False, seen: list[int] | None = None
) -> Callable[..., Any]:
    """A replacement for :meth:`LandedGroupSums.sums
    <kvwire.session.group_sums.LandedGroupSums.sums>` (decode's check of a sender's landed
    buffer groups) that first damages the first landed row (of dense key ``key``, a (group,
    layer) of :class:`~kvwire.session.group_sums.GroupBuffers`, when given): one bit of its
    byte 1 flipped, or with ``whole_row`` its float32 values overwritten with noise. What a
    transport that corrupted the groups in flight looks like to the check, on every backend.
    Damages one row per process (the first check that has such a row); appends that row's key
    to ``seen``."""
    import ctypes

    import numpy as np

    from kvwire.descriptors import ADDR, LEN
    from kvwire.session.group_sums import LandedGroupSums

    original = LandedGroupSums.sums
    done: list[int] = [] if seen is None else seen

    def sums(self: LandedGroupSums, rows: Any) -> Any:
        idx = np.asarray(rows, dtype=np.int64)
        keys = self.hasher.row_layers(self.dst, idx)
        if key is not None:
            idx, keys = idx[keys == key], keys[keys == key]
        if idx.size and not done:
            addr, n = int(self.dst[idx[0], ADDR]), int(self.dst[idx[0], LEN])
            if whole_row:
                row = np.ctypeslib.as_array((ctypes.c_float * (n // 4)).from_address(addr))
                row[:] = np.random.default_rng(5).standard_normal(row.size) * 10
            else:
                ctypes.c_uint8.from_address(addr + 1).value ^= 0x10
            done.append(int(keys[0]))
        return original(self, rows)

    return sums


def _flip_on_landing(role: str) -> None:
    """Decode flips one bit of the first row each chunk (each piece, when posted in pieces)
    wrote, after the rows landed and before its checksum check sums them: the corruption a
    transport would cause, which only the check can see (host KV pools)."""
    if role != "decode":
        return
    from kvwire.session.checksums import LandedSums

    LandedSums.chunk = landed_flipper()  # type: ignore[method-assign]


#: ``slow_pushes``: the file whose existence turns the delay on (unset: always on).
SLOW_FLAG_ENV = "KVWIRE_TESTING_SLOW_FLAG"
#: ``slow_pushes``: seconds before each KV chunk is posted.
SLOW_PUSH_S = 1.0


def _slow_pushes(role: str) -> None:
    """Prefill's transfer workers wait :data:`SLOW_PUSH_S` before posting each KV chunk while
    the file named by :data:`SLOW_FLAG_ENV` exists, and say on stderr which chunk they post:
    a push slow enough for a test to kill prefill between two chunks, at a chunk it saw
    posted (e.g. a real ``vllm serve``, where the fault is installed by a ``sitecustomize``)."""
    if role != "prefill":
        return
    import os
    import sys

    from kvwire.session.prefill.pipeline import Pipeline
    from kvwire.session.prefill.posting import SegmentPost, Tail
    from kvwire.session.prefill.rooms import Job
    from kvwire.staging.base import ChunkPlan

    flag = os.environ.get(SLOW_FLAG_ENV)
    segments, whole = Pipeline.post_segments, Pipeline._post_whole

    def wait(job: Job) -> None:
        if job.pool == "kv" and (flag is None or os.path.exists(flag)):
            time.sleep(SLOW_PUSH_S)
            print(
                f"kvwire fault slow_pushes: posting chunk {job.chunk_id} of room {job.room.room}",
                file=sys.stderr,
                flush=True,
            )

    def slow_segments(self: Pipeline, post: SegmentPost) -> None:
        if post.first_part == 0:
            wait(post.job)
        segments(self, post)

    def slow_whole(
        self: Pipeline, tail: Tail, job: Job, plan: ChunkPlan, table: str, t_start: float
    ) -> None:
        wait(job)  # a chunk of one segment, posted whole (Pipeline.post_plan's lean path)
        whole(self, tail, job, plan, table, t_start)

    Pipeline.post_segments = slow_segments  # type: ignore[method-assign]
    Pipeline._post_whole = slow_whole  # type: ignore[method-assign]


FAULTS = {
    "slow_pushes": _slow_pushes,
    "flip_on_landing": _flip_on_landing,
    "head_slice_offset": _head_slice_offset,
    "lossy_staging": _lossy_staging,
    "aux_submit_fails": _aux_submit_fails,
    "flaky_backend": _flaky_backend,
}


def apply(name: str, role: str) -> None:
    """Install fault ``name`` in this process (a rank of ``role``); several faults are
    separated by commas (``aux_submit_fails,flip_on_landing``)."""
    for one in filter(None, name.split(",")):
        if one not in FAULTS:
            raise ValueError(f"unknown fault {one!r}; known: {sorted(FAULTS)}")
        FAULTS[one](role)


# ------------------------------------------------------------------ control-endpoint garbage
def _random_object(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-able value (nested a little)."""
    pick = rng.randrange(7 if depth < 2 else 4)
    if pick == 0:
        return rng.randrange(-(1 << 63), 1 << 63)
    if pick == 1:
        return rng.randbytes(rng.randrange(24)).hex()
    if pick == 2:
        return rng.randbytes(rng.randrange(24))
    if pick == 3:
        return rng.choice([None, True, False, 0.5, -1])
    if pick == 4:
        return [_random_object(rng, depth + 1) for _ in range(rng.randrange(6))]
    if pick == 5:
        return {rng.randbytes(4).hex(): _random_object(rng, depth + 1) for _ in range(4)}
    return rng.choice(["hello", "failure", "heartbeat", "goodbye", "transfer_request", "note"])


def _forgeries(rng: random.Random, rooms: Sequence[int]) -> list[Any]:
    """Well-formed kvwire messages naming live ``rooms`` (only ever sent unsigned or signed
    with the wrong key: a manager with a secret must refuse every one)."""
    from kvwire.control import wire

    room = rng.choice(list(rooms)) if rooms else rng.randrange(1 << 63)
    session = rng.randbytes(8).hex()
    return [
        wire.Failure(room=room, session=session, reason="forged", aborted=rng.random() < 0.5),
        wire.Heartbeat(session=session, sent_at=time.time()),
        wire.Goodbye(session=session),
        wire.TransferRequest(room=room, session=session, dst_pages=b"\0" * 16, aux_index=0),
        wire.Completion(room=room, sender_id=0, session=session, data_chunks=1),
        wire.ChunkNote(room=room, sender_id=0, session=session, last=True),
        wire.WritesDone(room=room, sender_id=0, session=session),
        wire.WritesQuery(room=room, session=session),
        wire.StagingMessage(
            session=session, strategy="bulk", type="watermark", body={"round": 1, "tail": 0}
        ),
        wire.HelloReject(session=session, peer_session=session, reason="forged"),
    ]


def _garbage_frame(rng: random.Random, secret: bytes | None, rooms: Sequence[int]) -> bytes:
    """One candidate garbage frame."""
    from kvwire.control.wire import PROTOCOL_MAJOR, PROTOCOL_MINOR, Codec

    pick = rng.randrange(10 if secret else 7)
    if pick == 0:  # random bytes
        return rng.randbytes(rng.randrange(1, 512))
    if pick == 1:  # random msgpack
        return bytes(msgpack.packb(_random_object(rng), use_bin_type=True))
    kind = rng.choice(["heartbeat", "failure", "note", "transfer_request", "bogus", ""])
    body = rng.randbytes(rng.randrange(32))
    if pick == 2:  # another major version
        head: list[Any] = [PROTOCOL_MAJOR + rng.randrange(1, 5), 0, kind, body, b""]
    elif pick == 3:  # an unknown kind
        head = [PROTOCOL_MAJOR, PROTOCOL_MINOR, "no-such-" + kind, body, b""]
    elif pick == 4:  # a known kind whose body is not msgpack of a map
        head = [PROTOCOL_MAJOR, PROTOCOL_MINOR, kind or "failure", body, b""]
    elif pick == 5:  # a known kind whose map lacks or mistypes its fields
        fields = {"room": -rng.randrange(1, 99), "session": rng.randrange(9), "x": body}
        head = [PROTOCOL_MAJOR, PROTOCOL_MINOR, "failure", msgpack.packb(fields), b""]
    elif pick == 6:  # header fields of the wrong types, or too few of them
        head = rng.choice(
            [
                ["1", PROTOCOL_MINOR, "failure", body, b""],
                [PROTOCOL_MAJOR, PROTOCOL_MINOR, 7, body, b""],
                [PROTOCOL_MAJOR, PROTOCOL_MINOR, "failure", {"room": 1}, b""],
                [PROTOCOL_MAJOR, PROTOCOL_MINOR, "failure"],
            ]
        )
    else:  # with a secret: a real message, unsigned (7, 8) or signed with another key (9)
        msg = rng.choice(_forgeries(rng, rooms))
        key = rng.randbytes(16) if pick == 9 else None
        return Codec(key).encode(msg)
    return bytes(msgpack.packb(head, use_bin_type=True))


def garbage_frames(
    n: int, *, secret: bytes | None = None, rooms: Sequence[int] = (), seed: int = 0
) -> list[bytes]:
    """``n`` control frames that a manager configured with ``secret`` must refuse: random
    bytes, random msgpack, msgpack shaped like kvwire frames (another protocol version, an
    unknown kind, bodies that are not maps or miss fields, header fields of the wrong types)
    and, with a secret, real messages (failures and transfer requests for ``rooms`` among
    them) unsigned or signed with another key. Every frame is checked against the codec: one
    that it would accept is never returned."""
    from kvwire.control.wire import Codec
    from kvwire.errors import ProtocolError

    rng = random.Random(seed)
    codec = Codec(secret)
    out: list[bytes] = []
    while len(out) < n:
        frame = _garbage_frame(rng, secret, rooms)
        try:
            codec.decode(frame)
        except ProtocolError:
            out.append(frame)
    return out


def expected_drops(frames: Iterable[bytes], secret: bytes | None) -> Counter[str]:
    """The drop counters (``KVManager.dropped``) these frames must add, by reason."""
    from kvwire.control.channel import drop_reason
    from kvwire.control.wire import Codec
    from kvwire.errors import ProtocolError

    codec = Codec(secret)
    out: Counter[str] = Counter()
    for frame in frames:
        try:
            codec.decode(frame)
        except ProtocolError as exc:
            out[drop_reason(exc)] += 1
        else:
            raise ValueError("a frame the codec accepts is not garbage")
    return out


def flood(
    endpoint: str,
    frames: Sequence[bytes],
    *,
    hwm: int = 64,
    on_sent: Callable[[int], None] | None = None,
    timeout_s: float = 30.0,
) -> float:
    """Send ``frames`` to a control endpoint from a plain ZeroMQ PUSH socket, as fast as the
    receiver takes them (a small high-water mark, so "sent" is close to "received"); returns
    the seconds it took. ``on_sent(i)`` is called after every 1000th frame."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    t0 = time.monotonic()
    try:
        sock.connect(endpoint)
        for i, frame in enumerate(frames, 1):
            sock.send(frame)
            if on_sent is not None and i % 1000 == 0:
                on_sent(i)
    finally:
        sock.close(linger=int(timeout_s * 1000))
        ctx.term()
    return time.monotonic() - t0


def unsigned_hellos(n: int, layout: Any, *, first_port: int = 1) -> list[bytes]:
    """``n`` well-formed handshake hellos WITHOUT a MAC, each naming its own control endpoint
    where nothing listens (``tcp://127.0.0.1:<first_port + i>``); ``layout`` is any valid
    :class:`~kvwire.layout.KVLayout`. A prefill rank with a secret answers such a hello (rate
    limited) to explain the missing secret."""
    import secrets

    from kvwire.control import wire

    codec = wire.Codec(None)
    return [
        codec.encode(
            wire.Hello(
                session=secrets.token_hex(8),
                agent=f"forged-{i}",
                endpoint=f"tcp://127.0.0.1:{first_port + i}",
                rank=layout.rank,
                layout=layout,
                layout_hash="forged",
                backend="tcp",
                backend_metadata=b"",
            )
        )
        for i in range(n)
    ]
