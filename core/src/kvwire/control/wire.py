"""The control-plane wire schema: pydantic models encoded with msgpack, versioned, optionally
authenticated.

A frame is a msgpack array ``[major, minor, kind, body, mac]``, plus ``fresh`` when signed:

* ``major``/``minor``: the sender's protocol version. A different ``major`` is refused; any
  ``minor`` is accepted (a newer minor only adds optional fields, which older readers ignore,
  and an older minor omits them, which newer readers fill with defaults).
* ``kind``: the message type name (:attr:`Message.kind`).
* ``body``: the msgpack encoding of the model's fields.
* ``mac``: ``HMAC-SHA256(secret, [major, minor, kind] packed + fresh packed + body)`` when a
  shared secret is configured, else empty bytes. With a secret, a frame whose MAC is missing or
  wrong is refused.
* ``fresh`` (1.3, signed frames only): ``[origin, seq, sent_at, to]``, the replay-protection
  stamp (:mod:`kvwire.control.freshness`). A receiver that passes its endpoint to
  :meth:`Codec.decode` refuses a signed frame that is replayed, stale, unstamped or addressed
  to another endpoint.

Never pickle: everything here is plain data validated by pydantic on arrival. The same codec
encodes the notification payloads that ride on the data plane (:class:`ChunkNote`).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, Self

import msgpack
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvwire.control.freshness import FreshnessError, ReplayGuard
from kvwire.control.wire_base import Message as Message
from kvwire.control.wire_base import known_fields as known_fields
from kvwire.control.wire_base import pages_from_bytes as pages_from_bytes
from kvwire.control.wire_base import pages_to_bytes as pages_to_bytes
from kvwire.errors import ProtocolError
from kvwire.layout import (
    KVLayout,
    MemoryRegion,
    RankPosition,
)

#: Protocol version spoken by this kvwire. Bump ``MINOR`` for added optional fields, ``MAJOR``
#: for anything an older peer would misread. What each minor added, and how older peers read
#: it, is in docs/control-plane.md ("Wire format"); each released version's messages are
#: stored under core/tests/fixtures/wire/. 1.10: pools named by string (``Hello.pools``).
#: 1.11: the aux row carried in the last chunk's note (``Hello.aux_in_note``, ``ChunkNote.aux``).
#: 1.12: a chunk's pieces checked on arrival (``ChunkNote.piece_layers``).
#: 1.13: control frames over a UNIX socket between peers of one host (``Hello.local_control``,
#: ``HelloAck.local_control``).
#: 1.14: buffer groups checksummed (``HelloAck.group_checksum``; sums on the state note).
PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 14

#: Largest frame accepted (layouts of deep models with many buffers stay far below this).
MAX_FRAME_BYTES = 16 << 20

_EMPTY = b""


#: A pool's name on the wire: "kv" (every rank's KV pool) or an extra pool a decode rank
#: announced in ``Hello.pools``. (1.10; 1.1-1.9 knew only "kv" and "host")
PoolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]

#: A rank's local control name (:mod:`kvwire.control.local_way`), "" for none. (1.13)
LocalName = Annotated[str, Field(max_length=64, pattern=r"^(kvwire-ctl-[0-9a-f]{32})?$")]

#: The extra pool 1.1-1.9 peers knew, under the fields ``Hello.host_layout``/``host_staging``.
LEGACY_POOL = "host"


class BackendOffer(BaseModel):
    """One backend a decode rank announces: its name and its metadata. (1.8)"""

    model_config = ConfigDict(extra="ignore", frozen=True)
    name: str = Field(min_length=1)
    metadata: bytes


class Hello(Message):
    """Decode rank -> prefill rank, once per (decode rank, prefill rank) incarnation pair:
    who the decode rank is, its KV layout, its aux rows and its backend's metadata."""

    kind: ClassVar[str] = "hello"
    session: str
    agent: str
    endpoint: str
    rank: RankPosition
    layout: KVLayout
    layout_hash: str
    backend: str
    backend_metadata: bytes
    aux_regions: list[MemoryRegion] = Field(default_factory=list)
    #: Room for a staging strategy's decode-side description (ring base and size).
    staging: dict[str, Any] | None = None
    #: 1.1-1.9: decode's one extra pool, named ``LEGACY_POOL``. A 1.10 decode still fills it
    #: (from ``pools``) so that a 1.9 prefill serves that pool; a 1.10 prefill reads it only
    #: from a hello without ``pools`` (see :meth:`extra_pools`).
    host_layout: KVLayout | None = None
    #: 1.2-1.9: that pool's strategy description (see ``pool_staging``).
    host_staging: dict[str, Any] | None = None
    #: Decode's extra pools by name (never "kv", which is ``layout``), each with its own page
    #: size: requests name one in ``TransferRequest.pool``. (1.10)
    pools: dict[PoolName, KVLayout] = Field(default_factory=dict)
    #: Each extra pool's strategy description (e.g. a shared-memory pool that a prefill rank
    #: on the same host may map); a pool with nothing to share is absent. (1.10)
    pool_staging: dict[PoolName, dict[str, Any]] = Field(default_factory=dict)
    #: Decode asks for a checksum of every KV chunk (``ControlOptions.kv_checksum``). (1.7)
    checksum: bool = False
    #: Every backend decode has, in its preference order (the first is ``backend``). (1.8)
    backends: list[BackendOffer] = Field(default_factory=list)
    #: The decode rank's host identity (``{"boot_id", "hostname"}``). (1.8)
    host: dict[str, str] = Field(default_factory=dict)
    #: Decode takes the aux row from the last chunk's note (``ChunkNote.aux``; aux rows in
    #: host memory); older ranks get it as a transfer of its own. (1.11)
    aux_in_note: bool = False
    #: Decode's local control name: a prefill rank in its network namespace sends it
    #: control frames over that UNIX socket after the handshake ("": none). (1.13)
    local_control: LocalName = ""

    def offers(self) -> list[tuple[str, bytes]]:
        """``(name, metadata)`` of each backend decode announced (a 1.7 hello: its one)."""
        if self.backends:
            return [(b.name, b.metadata) for b in self.backends]
        return [(self.backend, self.backend_metadata)]

    def extra_pools(self) -> dict[str, tuple[KVLayout, dict[str, Any] | None]]:
        """Decode's extra pools with their strategy descriptions (a 1.9 hello: its host pool
        under ``LEGACY_POOL``, if it has one)."""
        if self.pools:
            return {n: (lay, self.pool_staging.get(n)) for n, lay in self.pools.items()}
        if self.host_layout is not None:
            return {LEGACY_POOL: (self.host_layout, self.host_staging)}
        return {}

    @field_validator("layout", "host_layout", mode="before")
    @classmethod
    def _lenient_layout(cls, v: Any) -> Any:
        return known_fields(KVLayout, v)

    @field_validator("pools", mode="before")
    @classmethod
    def _lenient_pools(cls, v: Any) -> Any:
        if isinstance(v, dict):
            if "kv" in v:
                raise ValueError("pools must not name 'kv' (the KV pool is Hello.layout)")
            return {k: known_fields(KVLayout, x) for k, x in v.items()}
        return v

    @field_validator("rank", mode="before")
    @classmethod
    def _lenient_rank(cls, v: Any) -> Any:
        return known_fields(RankPosition, v)

    @field_validator("aux_regions", mode="before")
    @classmethod
    def _lenient_regions(cls, v: Any) -> Any:
        return [known_fields(MemoryRegion, x) for x in v] if isinstance(v, list) else v


class HelloAck(Message):
    """Prefill rank -> decode rank: the handshake was accepted."""

    kind: ClassVar[str] = "hello_ack"
    session: str
    agent: str
    endpoint: str
    rank: RankPosition
    sender_id: int
    layout_hash: str
    #: This prefill rank sends no KV to that decode rank (another rank sends the same bytes);
    #: it still reports completion.
    dummy: bool = False
    #: The decode session this answers (a restarted decode rank ignores stale answers).
    peer_session: str = ""
    #: The prefill rank's layout (decode needs it to scatter staged chunks).
    layout: KVLayout | None = None
    #: Whether this prefill rank will stage its chunks into decode's ring (bulk staging).
    staged: bool = False
    #: Whether this prefill rank moves buffer-group bytes (state, sliding window, draft
    #: layers) to that decode rank: one ``ChunkNote(what="state")`` per request. (1.4)
    groups: bool = False
    #: This prefill rank will send per-layer checksums with its KV chunks, as decode asked.
    #: A decode rank that asked and reads False (an older prefill) refuses the link. (1.7)
    checksum: bool = False
    #: The backend prefill chose for this link, and its fallbacks in order ("" and [] from a
    #: 1.7 prefill: the one both had). (1.8)
    backend: str = ""
    fallbacks: list[str] = Field(default_factory=list)
    #: The prefill rank's local control name, as ``Hello.local_control``. (1.13)
    local_control: LocalName = ""
    #: With ``checksum`` and ``groups``: each state note carries the sums of the group rows
    #: it moved (``ChunkNote.sum_layers``/``sums``, keyed per group and layer:
    #: :mod:`kvwire.session.group_sums`), and decode checks them. A decode rank that reads
    #: False (an older prefill) checks that link's KV and not its groups. (1.14)
    group_checksum: bool = False

    @field_validator("rank", mode="before")
    @classmethod
    def _lenient_rank(cls, v: Any) -> Any:
        return known_fields(RankPosition, v)

    @field_validator("layout", mode="before")
    @classmethod
    def _lenient_layout(cls, v: Any) -> Any:
        return known_fields(KVLayout, v)


class HelloReject(Message):
    """Prefill rank -> decode rank: the handshake was refused, with every reason."""

    kind: ClassVar[str] = "hello_reject"
    session: str
    peer_session: str = ""
    reason: str
    problems: list[str] = Field(default_factory=list)


class TransferRequest(Message):
    """Decode rank -> each prefill rank that feeds it, once per request: where to write."""

    kind: ClassVar[str] = "transfer_request"
    room: int = Field(ge=0)
    session: str
    dst_pages: bytes
    aux_index: int = Field(ge=-1, default=-1)
    #: Reserved in 1.0-1.3 and never sent; refused if set (1.4 uses ``group_indices``).
    state_indices: list[int] | None = None
    #: Buffer-group slots on the decode rank, per index name (``BufferGroup.index``: e.g.
    #: "state" for a state slot, "window" for sliding-window pages), as int64 bytes. (1.4)
    group_indices: dict[str, bytes] | None = None
    #: Which decode pool ``dst_pages`` index: "kv" (the KV pool) or an extra pool decode
    #: announced in ``Hello.pools`` (in that pool's page units); prefill fails a request
    #: naming a pool it has no link to.
    pool: PoolName = "kv"
    staging: dict[str, Any] | None = None
    #: Prompt tokens decode keeps cached for this request (``dst_pages`` hold the tokens after
    #: them); None when the engine did not say. Required by prefill when the two sides' page
    #: sizes differ: the page counts alone cannot place the tokens then. (1.5)
    cached_tokens: int | None = Field(default=None, ge=0)


class Completion(Message):
    """Prefill rank -> decode rank, for a sender whose last chunk moved no KV (dummy sender,
    or a prefix fully cached on decode): "no more KV; ``data_chunks`` chunks carried data"."""

    kind: ClassVar[str] = "completion"
    room: int = Field(ge=0)
    sender_id: int
    session: str
    data_chunks: int = Field(ge=0)
    dummy: bool = False


class Failure(Message):
    """Either side -> the peers of a room: the room failed (or was aborted) here."""

    kind: ClassVar[str] = "failure"
    room: int = Field(ge=0)
    session: str
    reason: str
    aborted: bool = False
    #: The room's transfer request was dropped unread: the sender (a prefill rank) does not
    #: count the requesting session as a peer (it evicted it). Nothing of the request was
    #: done there; a 1.9 decode rank handshakes again and repeats the request. (1.9)
    unheard: bool = False


class Heartbeat(Message):
    """Either side -> every peer it knows, every ``heartbeat_interval_s``."""

    kind: ClassVar[str] = "heartbeat"
    session: str
    sent_at: float = 0.0


class Goodbye(Message):
    """Either side -> every peer, when a manager closes cleanly: evict me now."""

    kind: ClassVar[str] = "goodbye"
    session: str


class Evicted(Message):
    """Prefill rank -> a decode rank it evicted (silent past the liveness bound: frozen,
    starved or cut off), answering a frame that session sent afterwards: "I no longer count
    you as a peer, nor any request of yours I held" (those were failed, and their failures
    are sent again with this). The decode rank drops its link to the sender and handshakes
    again before its next request to it. (1.9)"""

    kind: ClassVar[str] = "evicted"
    session: str
    #: The evicted session (a later incarnation of the receiver ignores the message).
    peer_session: str
    reason: str


class ChunkNote(Message):
    """Notification payload of a data-plane transfer, delivered to decode after the data."""

    kind: ClassVar[str] = "note"
    room: int = Field(ge=0)
    sender_id: int
    session: str
    what: Literal["kv", "aux", "state", "staged"] = "kv"
    chunk_id: int = Field(ge=0, default=0)
    last: bool = False
    #: A chunk moved as several segments (one per (source kind, destination kind), or copies
    #: done by a strategy) sends one note per segment: the chunk counts once all ``parts``
    #: arrived. (1.2)
    parts: int = Field(ge=1, le=64, default=1)
    part: int = Field(ge=0, default=0)
    #: With checksums (1.7): the chunk's request pages ``[start, end)`` and the request's page
    #: count, so decode can find the rows the chunk wrote; and the per-layer sums of the rows
    #: this note's part covers (each part carries the sums of the layers it completed, or
    #: none: decode adds them up over the chunk's parts).
    span: tuple[int, int] | None = None
    num_pages: int | None = Field(default=None, ge=0)
    #: Prefill's page size in tokens. With ``span`` and ``num_pages`` (sent on every KV note
    #: since 1.7, checksums or not) it tells decode which tokens a complete chunk wrote: the
    #: failure report of a request that failed part-way (:mod:`kvwire.session.report`).
    page_size: int | None = Field(default=None, ge=1)
    sum_layers: list[int] = Field(default_factory=list, max_length=4096)
    sums: list[int] = Field(default_factory=list, max_length=4096)
    #: The request's aux row, one bytes value per aux region (room stamp first), on the aux
    #: sender's last note when decode said ``Hello.aux_in_note``: decode writes it into its
    #: aux slot on arrival and the note counts as the aux row's too. (1.11)
    aux: list[bytes] | None = Field(default=None, max_length=64)
    #: A piece of a checksummed chunk (1.12): this part moved every row of the chunk in layers
    #: ``[a, b)`` (and no other), and ``sums`` are those rows' sums, so decode checks these
    #: layers as soon as the note arrives, while the chunk's other pieces are in flight. Every
    #: part of such a chunk is a piece. A 1.11 decode ignores the field: it adds the pieces'
    #: sums over the chunk and checks it whole, which gives the same verdict.
    piece_layers: tuple[int, int] | None = None

    @model_validator(mode="after")
    def _check_sums(self) -> Self:
        if len(self.sum_layers) != len(self.sums):
            raise ValueError("sum_layers and sums differ in length")
        if any(not 0 <= s < 1 << 64 for s in self.sums):
            raise ValueError("a checksum is not a 64-bit unsigned value")
        if self.span is not None and not 0 <= self.span[0] <= self.span[1]:
            raise ValueError(f"chunk span {self.span} is not a page range")
        if self.piece_layers is not None:
            a, b = self.piece_layers
            if not 0 <= a < b or any(not a <= x < b for x in self.sum_layers):
                raise ValueError(f"piece layers {self.piece_layers} do not hold its sums' layers")
        return self


class StagingMessage(Message):
    """A staging strategy's own message, either direction, between two handshaken ranks.

    Core routes it, unread, to the strategy of the named ``pool`` on the receiving rank
    (:meth:`~kvwire.staging.base.StagingStrategy.on_message`); ``type`` and ``body`` belong to
    the strategy (it validates ``body`` with its own models). A strategy that needs
    request/grant messages therefore needs no new wire kind and no edit in ``session/``. (1.3)
    """

    kind: ClassVar[str] = "staging"
    #: The sending rank's session.
    session: str
    #: Which of the receiver's strategies it is for: the pool's name ("kv", or an extra pool
    #: the decode rank announced in ``Hello.pools``); an unknown one is dropped and counted.
    pool: PoolName = "kv"
    #: The sending strategy's name (a receiver running another strategy drops it).
    strategy: str = Field(min_length=1, max_length=64)
    type: str = Field(min_length=1, max_length=64)
    body: dict[str, Any] = Field(default_factory=dict)


class WritesDone(Message):
    """Prefill rank -> decode rank, for a request that failed or was aborted: no write of
    ``room`` from this sender is in flight or will be made, so its destination pages (and any
    staging ring space) may be reused."""

    kind: ClassVar[str] = "writes_done"
    room: int = Field(ge=0)
    sender_id: int
    session: str


class WritesQuery(Message):
    """Decode rank -> a source rank of a failed request (or a staging writer whose ring space a
    cleared request still holds), repeated until answered: "send WritesDone once none of your
    writes for this room is in flight"."""

    kind: ClassVar[str] = "writes_query"
    room: int = Field(ge=0)
    session: str


MESSAGE_TYPES: dict[str, type[Message]] = {
    m.kind: m
    for m in (
        Hello,
        HelloAck,
        HelloReject,
        TransferRequest,
        Completion,
        Failure,
        Heartbeat,
        Goodbye,
        Evicted,
        ChunkNote,
        StagingMessage,
        WritesDone,
        WritesQuery,
    )
}


#: Kinds earlier protocol minors had and this one retired (kind -> the minor that retired it).
#: A frame of one is refused with a message that says so (never misread).
RETIRED_KINDS: dict[str, int] = {
    "staging_request": 3,
    "staging_grant": 3,
    "staging_deny": 3,
    "staging_watermark": 3,
}


class Codec:
    """Encodes and decodes frames; holds the shared secret (if any), this process's origin id
    and message counter for freshness stamps, and the replay window of what it received.

    One instance per manager, used from any thread (the counter and the replay guard are
    thread-safe).
    """

    def __init__(self, secret: bytes | None = None, clock: Callable[[], float] = time.time) -> None:
        self._key = secret or None
        self._clock = clock
        #: Random id of this codec: the sender identity of its freshness stamps.
        self.origin = secrets.token_bytes(8)
        self._seq = itertools.count(1)
        #: Replay window of frames decoded with a destination (the control channel's).
        self.guard = ReplayGuard(clock=clock)
        #: The MAC keyed once; each frame's MAC starts from a copy (keying HMAC-SHA256 anew
        #: hashes two more blocks). Never updated itself, so any thread may copy it.
        self._keyed = hmac.new(secret, digestmod=hashlib.sha256) if secret else None
        #: This version's packed ``[major, minor, kind]`` heads, by kind (the MAC's prefix).
        self._heads = {k: msgpack.packb([PROTOCOL_MAJOR, PROTOCOL_MINOR, k]) for k in MESSAGE_TYPES}

    @property
    def authenticated(self) -> bool:
        """Whether frames carry (and must carry) an HMAC."""
        return self._key is not None

    def _mac(self, major: int, minor: int, kind: str, body: bytes, fresh: bytes = _EMPTY) -> bytes:
        assert self._keyed is not None
        head = self._heads.get(kind) if (major, minor) == (PROTOCOL_MAJOR, PROTOCOL_MINOR) else None
        mac = self._keyed.copy()
        mac.update(head if head is not None else msgpack.packb([major, minor, kind]))
        mac.update(fresh)
        mac.update(body)
        return mac.digest()

    def encode(self, msg: Message, to: str = "") -> bytes:
        """Frame ``msg`` with this side's protocol version (and, with a secret, a freshness
        stamp addressed to ``to`` and the MAC). ``to`` is the receiver's control endpoint;
        ``""`` for payloads that do not travel on the control channel (notifications). Any
        thread."""
        body = msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)
        return self.frame(msg.kind, body, to)

    def frame(self, kind: str, body: bytes, to: str = "") -> bytes:
        """Frame an already packed ``body`` of message ``kind`` as :meth:`encode` frames a
        model (``to`` likewise). For a hot path that packs a known kind's fields itself
        (prefill's data notes: :class:`~kvwire.session.prefill.notes.NoteFrames`); the caller
        answers for the body holding that kind's fields, and the receiver validates it as
        any frame's. Any thread."""
        if self._key is None:
            frame: bytes = msgpack.packb([PROTOCOL_MAJOR, PROTOCOL_MINOR, kind, body, _EMPTY])
            return frame
        fresh = msgpack.packb([self.origin, next(self._seq), self._clock(), to])
        mac = self._mac(PROTOCOL_MAJOR, PROTOCOL_MINOR, kind, body, fresh)
        frame = msgpack.packb([PROTOCOL_MAJOR, PROTOCOL_MINOR, kind, body, mac, fresh])
        return frame

    def _check_fresh(self, kind: str, fresh: bytes, to: str) -> None:
        if not fresh:
            raise FreshnessError(
                "stale",
                f"unstamped {kind!r} message: signed frames must carry a freshness stamp "
                f"(the peer runs kvwire older than protocol {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}; "
                "upgrade both sides together)",
            )
        try:
            origin, seq, ts, dest = msgpack.unpackb(fresh, raw=False)
            ok = isinstance(origin, bytes) and isinstance(seq, int) and isinstance(dest, str)
            ts = float(ts)
        except Exception as exc:
            raise ProtocolError(f"malformed {kind!r} freshness stamp: {exc}") from exc
        if not ok:
            raise ProtocolError(f"malformed {kind!r} freshness stamp (field types)")
        if dest != to:
            raise FreshnessError(
                "stale", f"{kind!r} message addressed to {dest!r} arrived at {to!r} (replayed?)"
            )
        self.guard.check(origin, seq, ts)

    def decode_unverified(self, frame: bytes, kinds: frozenset[str]) -> Message | None:
        """Parse a frame of one of ``kinds`` WITHOUT checking its MAC, or None. Only for
        explaining a failure (an unsigned answer to a signed handshake), never for acting on
        a message as if it were authentic."""
        try:
            outer = msgpack.unpackb(frame, raw=False, max_bin_len=MAX_FRAME_BYTES)
            kind, body = outer[2], outer[3]
            if kind not in kinds or not isinstance(body, bytes):
                return None
            fields = msgpack.unpackb(body, raw=False)
            return MESSAGE_TYPES[kind].model_validate(fields)
        except Exception:  # anything malformed: nothing to explain with
            return None

    def decode(self, frame: bytes, to: str | None = None) -> Message:
        """Parse and check a frame. Raises :class:`ProtocolError` naming what is wrong.

        With a secret and ``to`` (the receiving control endpoint; the channel's liveness
        thread), the frame must also be fresh: stamped, addressed to ``to``, recent and not
        seen before (:class:`~kvwire.control.freshness.FreshnessError` otherwise). Without
        ``to`` (notification payloads, stored fixtures) only the MAC is checked; the data
        plane that carried the payload is what protects it (docs/security.md)."""
        if len(frame) > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        try:
            outer = msgpack.unpackb(frame, raw=False, max_bin_len=MAX_FRAME_BYTES)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"not a kvwire frame (msgpack: {exc})") from exc
        if not isinstance(outer, list) or len(outer) < 5:
            raise ProtocolError("not a kvwire frame: expected [major, minor, kind, body, mac]")
        major, minor, kind, body, mac = outer[:5]
        fresh = outer[5] if len(outer) > 5 else _EMPTY
        if not (isinstance(major, int) and isinstance(minor, int) and isinstance(kind, str)):
            raise ProtocolError("malformed frame header (version or kind has the wrong type)")
        if not isinstance(body, bytes) or not isinstance(mac, bytes):
            raise ProtocolError("malformed frame: body and mac must be bytes")
        if major != PROTOCOL_MAJOR:
            raise ProtocolError(
                f"peer speaks kvwire protocol {major}.{minor}, this side speaks "
                f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}; upgrade the older side"
            )
        if self._key is not None:
            if not mac:
                raise ProtocolError(
                    f"unauthenticated {kind!r} message: a shared secret is configured here but "
                    "the peer sent no MAC (set KVWIRE_SECRET on both sides)"
                )
            if not isinstance(fresh, bytes):
                raise ProtocolError(f"malformed {kind!r} frame: freshness stamp must be bytes")
            if not hmac.compare_digest(mac, self._mac(major, minor, kind, body, fresh)):
                raise ProtocolError(
                    f"{kind!r} message failed authentication (wrong shared secret, or tampered)"
                )
            if to is not None:
                self._check_fresh(kind, fresh, to)
        cls = MESSAGE_TYPES.get(kind)
        if cls is None and kind in RETIRED_KINDS:
            raise ProtocolError(
                f"message kind {kind!r} was retired in protocol {PROTOCOL_MAJOR}."
                f"{RETIRED_KINDS[kind]} (staging messages now travel in 'staging' envelopes); "
                f"the peer speaks {major}.{minor}: run the same kvwire version on both sides"
            )
        if cls is None:
            raise ProtocolError(f"unknown message kind {kind!r} (from a newer peer?)")
        try:
            fields = msgpack.unpackb(body, raw=False)
            if not isinstance(fields, dict):
                raise ProtocolError(f"{kind!r} body is not a map")
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise ProtocolError(
                f"malformed {kind!r} message: {exc.errors(include_url=False)}"
            ) from exc
        except ProtocolError:
            raise
        except Exception as exc:
            raise ProtocolError(f"malformed {kind!r} body (msgpack: {exc})") from exc
