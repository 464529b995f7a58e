"""What a prefill transfer worker's parts hand each other, and the narrow interfaces between
them.

* :class:`WorkerSide` is all a worker's :class:`~kvwire.session.prefill.pipeline.Pipeline`
  needs from the prefill side (a Protocol that
  :class:`~kvwire.session.prefill.side.PrefillSide` satisfies): liveness of a request,
  failing it, accounting, and the end of a destination. The worker never reaches further.
* :class:`ChunkPoster` is what layer-wise posting
  (:class:`~kvwire.session.prefill.layerwise.LayerPosting`) needs from the pipeline that
  composes it: a chunk's plan, its segments, and posting them.
* :class:`Tail` (per request and destination on one worker), :class:`PlanRef` (a plan whose
  segments are in flight) and :class:`SegmentPost` (some segments of one chunk, to post) are
  the values passed between them.

Everything here belongs to one worker thread (no lock), except what :class:`WorkerSide`'s
methods document and the piece-sum threads (:meth:`SegmentPost.piece_fields`), which only
read.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvwire.backend import LaterNote, Note, PreparedPair, TransferBackend, TransferHandle, XferOp
from kvwire.control.wire import ChunkNote, Codec
from kvwire.errors import TransferError
from kvwire.integrity import LayerSums, OrderedSums, add_sums
from kvwire.session.aux_note import read_row
from kvwire.session.handshake import slot_rows
from kvwire.session.layers import LayeredChunk
from kvwire.session.metrics import ChunkDone
from kvwire.session.prefill.links import PoolLink
from kvwire.session.prefill.rooms import Dest, Job, SendRoom
from kvwire.staging.base import ChunkPlan, LocalCopy, Segment, StagingStrategy

if TYPE_CHECKING:
    from kvwire.session.checksums import SentSums
    from kvwire.session.context import RankContext
    from kvwire.session.prefill.writes import Ended


@dataclass(eq=False)
class PlanRef:
    """A chunk plan whose segments are in flight: the strategy hears :meth:`on_sent` once,
    after the last of them is terminal."""

    strategy: StagingStrategy
    plan: ChunkPlan
    room: int
    remaining: int = 0
    ok: bool = True
    #: More segments will be posted (a layer-wise chunk whose later groups are not computed
    #: yet): the strategy hears only once it is sealed.
    open: bool = False

    def ended(self, ok: bool) -> None:
        """A posted segment is terminal."""
        self.remaining -= 1
        self.ok &= ok
        if self.remaining == 0 and not self.open:
            self.strategy.on_sent(self.room, self.plan, self.ok)

    def seal(self, ok: bool = True) -> None:
        """No more segments will be posted (``ok=False``: posting failed or was given up);
        the strategy hears now when none is in flight any more."""
        self.open = False
        self.ok &= ok
        if self.remaining == 0:
            self.strategy.on_sent(self.room, self.plan, self.ok)


@dataclass
class Tail:
    """Per (request, destination) on one worker: jobs not posted yet (in order), chunks in
    flight, and the last job."""

    room: SendRoom
    dest: Dest
    target: PoolLink
    queue: deque[Job] = field(default_factory=deque)
    inflight: int = 0
    last: Job | None = None
    aux_posted: bool = False
    staged: bool = False
    groups_done: bool = False
    #: The head job's layer-wise posting, while its later layer groups are not computed.
    layered: LayeredChunk[PlanRef] | None = None

    @property
    def key(self) -> tuple[int, str]:
        """The worker's key of this tail: (room, destination session)."""
        return (self.room.room, self.dest.session)


@dataclass(eq=False)
class Posted:
    """One transfer (or one segment of a chunk) a prefill worker's pipeline has in flight."""

    handle: TransferHandle
    key: tuple[int, str]
    room: SendRoom
    ref: PlanRef | None
    t_start: float
    t_posted: float
    t_enqueued: float | None
    deadline: float
    what: str
    #: A copy the strategy runs itself; decode hears of it through ``note`` on the control
    #: channel once it is done (backend transfers carry their note themselves).
    copy: LocalCopy | None = None
    note: ChunkNote | None = None
    endpoint: str = ""
    #: The request was failed for this copy's deadline; it is still polled to the end, because
    #: decode may reuse the pages only when nothing writes them any more.
    overdue: bool = False
    #: Accounted as a transfer once done (not a chunk's sums part, which moves no bytes).
    counted: bool = True


@dataclass(frozen=True)
class SegmentPost:
    """Some segments of one chunk to post: parts ``first_part...`` of a chunk of ``parts``
    (the rows of layers ``[a, b)`` when ``layers`` is given: one layer-wise group)."""

    tail: Tail
    job: Job
    ref: PlanRef
    what: str
    segs: list[Segment]
    parts: int
    first_part: int
    t_start: float
    layers: tuple[int, int] | None = None
    #: A chunk posted in pieces (:meth:`kvwire.session.checksums.SentSums.pieces`): each
    #: segment's layer range; its note carries that range and its own rows' sums, not the
    #: first note the chunk's.
    pieces: list[tuple[int, int]] | None = None
    #: A checked whole chunk whose sums go after its rows: a last part of its own, told over
    #: the control channel once summed (:mod:`kvwire.session.prefill.late_sums`); ``parts``
    #: counts it.
    late_sums: bool = False

    #: Sums of the next piece, summed on a piece-sum thread while this one is posted.
    ahead: dict[int, Future[LayerSums]] = field(default_factory=dict, repr=False)

    def piece_fields(self, i: int) -> dict[str, Any]:
        """Prefill worker, just before posting segment ``i`` of a chunk cut in pieces: the
        note fields of that piece, its layer range and its rows' sums. The first piece is
        summed here; each one starts the next piece's sum on a piece-sum thread, which runs
        while this piece is posted (a backend that copies inside its post call, such as NIXL
        on CPU) and in flight (one whose own thread moves the bytes, such as tcp)."""
        check = self.job.link.checksums
        assert self.pieces is not None and check is not None
        ahead = self.ahead.pop(i, None)
        seg = self.segs[i]
        sums = ahead.result() if ahead is not None else check.rows(seg.src_idx, seg.dst_idx)
        if i + 1 < len(self.segs):
            nxt = self.segs[i + 1]
            self.ahead[i + 1] = summer().submit(check.rows, nxt.src_idx, nxt.dst_idx)
        return {
            "sum_layers": list(sums),
            "sums": list(sums.values()),
            "piece_layers": self.pieces[i],
        }


_summer_lock = threading.Lock()
_summer_pool: ThreadPoolExecutor | None = None


def summer() -> ThreadPoolExecutor:
    """The process's piece-sum threads (made on first use), for pieces and for whole chunks
    summed after their rows (:mod:`kvwire.session.prefill.late_sums`): they only read source
    rows and mapper tables, which stay alive while a chunk is posted (a piece whose post
    failed has its sum computed and dropped)."""
    global _summer_pool
    with _summer_lock:
        if _summer_pool is None:
            _summer_pool = ThreadPoolExecutor(2, thread_name_prefix="kvwire-piece-sum")
        return _summer_pool


class WorkerSide(Protocol):
    """What a transfer worker needs from the prefill side. Every method may be called from
    any worker thread; each takes the room lock itself where it needs it."""

    @property
    def sender_id(self) -> int:
        """This rank's sender id (on every note)."""

    def is_dead(self, room: SendRoom) -> bool:
        """The request is terminal or was cleared (its work is skipped)."""

    def fail(self, room: SendRoom, exc: BaseException) -> None:
        """Fail the request (once) and tell its destinations."""

    def writes_posted(self, room: int, dest: str, delta: int) -> None:
        """Count writes in flight per (request, destination)."""

    def ended(self, room: SendRoom, dest: str, done: ChunkDone | None) -> bool:
        """A write to ``dest`` is terminal: no longer in flight, ``done`` accounted (a write
        that moved bytes and succeeded); whether the request is still live."""

    def abandon(self, room: SendRoom, dest: Dest, target: PoolLink) -> None:
        """Nothing more will be written to ``dest`` for this request."""

    def dest_done(self, room: SendRoom, dest: Dest) -> None:
        """A destination has every chunk and its aux row."""

    def start_turn(self, writes: Sequence[tuple[SendRoom, Dest]]) -> list[bool]:
        """Before a lean lane's launch: which requests are live, their writes counted."""

    def end_turn(self, writes: Sequence[Ended]) -> None:
        """A lean lane's writes ended: uncounted, accounted, destinations done or failed."""


class ChunkPoster(Protocol):
    """What layer-wise posting needs from the pipeline that composes it (worker thread)."""

    def plan(self, job: Job) -> ChunkPlan | None:
        """The strategy's plan for a job's whole chunk (None: wait for staging space)."""

    def segments(self, job: Job, plan: ChunkPlan) -> list[Segment]:
        """A plan's rows as segments (split by memory kind)."""

    def post_plan(self, tail: Tail, job: Job, plan: ChunkPlan, t_start: float) -> None:
        """Post a whole chunk's plan."""

    def post_segments(self, post: SegmentPost) -> None:
        """Post some segments of a chunk, each with its note."""


def summed_pieces(
    job: Job, plan: ChunkPlan, segs: list[Segment], evented: bool
) -> tuple[list[Segment], list[tuple[int, int]] | None]:
    """Prefill worker, before posting a chunk: its segments, cut by layers into pieces that
    each carry their own rows' sums, and each piece's layer range (None: not cut). Only rows
    of the mapper's own tables moved in place, checksummed, over a backend whose own thread
    moves the bytes (``evented``): one that copies inside its calls would not move a piece
    while the next one is summed. A hasher that never cuts (a GPU pool's) leaves a page-form
    segment in page form (its rows are not read here)."""
    check = job.link.checksums if job.pool == "kv" else None
    own = plan.table == "kv" and len(segs) == 1 and segs[0].table == job.target.table
    if own and evented and check is not None and check.cuts and segs[0].copy is None:
        seg = segs[0]
        cut = check.pieces(seg.src_idx, seg.dst_idx)
        if cut:
            return [Segment(seg.label, seg.table, a, b) for a, b, _ in cut], [p for *_, p in cut]
    return segs, None


def first_sums(
    ctx: RankContext,
    check: SentSums,
    job: Job,
    segs: list[Segment],
    layers: tuple[int, int] | None,
) -> tuple[LayerSums, OrderedSums | None]:
    """Prefill worker, before posting a checksummed chunk's segments (not in pieces, no late
    sums): the sums its first note carries, computed now, or, where :func:`sums_later`
    applies, none now and a call that gives them later. With no segment (a staged layer group
    whose bytes a later group's block units carry) its sums wait for the chunk's next note."""
    pending = sums_later(ctx, check, job, segs, layers)
    if pending is not None:
        return {}, pending
    add_sums(job.unsent_sums, check.chunk(job.src, job.dst, layers))
    if not segs:
        return {}, None
    sums, job.unsent_sums = job.unsent_sums, {}
    return sums, None


def sums_later(
    ctx: RankContext,
    check: SentSums,
    job: Job,
    segs: list[Segment],
    layers: tuple[int, int] | None,
) -> OrderedSums | None:
    """Prefill worker, before posting a checksummed chunk's segments (not in pieces, no late
    sums): its sums ordered on the device (summed in the write's own launch by a backend
    with ``summed_writes``, else started beside it at submit) and waited for by its first
    note, made by the backend once the write ended (:class:`~kvwire.transfers.LaterNote`),
    so the sum runs with the write instead of before it. Only where the backend takes later notes
    (``cudaipc``, or a list holding it), the first segment is posted (not copied) and no sums
    of an earlier call wait for this note; None otherwise (sum now:
    :meth:`SentSums.chunk <kvwire.session.checksums.SentSums.chunk>`)."""
    if not segs or segs[0].copy is not None or job.unsent_sums:
        return None
    if not ctx.backend.capabilities.later_notes:
        return None
    return check.chunk_later(job.src, job.dst, layers)


def encode_note(codec: Codec, note: ChunkNote, sums: OrderedSums | None) -> Note:
    """Prefill worker: ``note`` encoded now, or (``sums`` given: :func:`sums_later`) a
    :class:`~kvwire.transfers.LaterNote` that adds the sums when the backend makes it (sums
    that cannot be computed raise :class:`TransferError`, naming the chunk: the transfer
    fails as any refused post does, also on a backend list's fallback)."""
    if sums is None:
        return codec.encode(note)

    def make() -> bytes:
        try:
            got = sums()
        except Exception as exc:
            raise TransferError(
                f"the checksums of chunk {note.chunk_id} could not be computed: {exc}",
                room=note.room,
            ) from exc
        update = {"sum_layers": list(got), "sums": list(got.values())} if got else {}
        return codec.encode(note.model_copy(update=update))

    return LaterNote(make, sums)


def submit_rows(
    backend: TransferBackend,
    pair: PreparedPair,
    rows: Segment,
    note: Note,
    wake: Callable[[], None],
) -> TransferHandle:
    """Prefill worker: WRITE one segment's rows with its note. A segment in page form goes
    to a backend that declares ``page_writes`` as pages (its rows never expanded); every
    other segment, and every other backend, as rows."""
    if rows.pages is not None and backend.capabilities.page_writes:
        return backend.submit_pages(XferOp.WRITE, pair, rows.pages, note, wake=wake)
    return backend.submit(XferOp.WRITE, pair, rows.src_idx, rows.dst_idx, note, wake=wake)


def aux_segment(n: int, slots: int, src_slot: int, dst_slot: int) -> Segment:
    """The ``n`` rows of aux slot ``src_slot`` to those of ``dst_slot`` (``slots`` per
    table), as a segment to post (prefill worker)."""
    return Segment("aux", "", slot_rows(n, slots, src_slot), slot_rows(n, slots, dst_slot))


def carried_aux(ctx: RankContext, tail: Tail, job: Job) -> list[bytes] | None:
    """Prefill worker: the aux row's bytes for the final data note of the request's last
    chunk, when they ride in it (protocol 1.11: :mod:`kvwire.session.aux_note`): this rank
    sends the aux row to a decode rank that takes it so, and no buffer group must land first.
    Marks the aux row posted; None when it moves as a transfer of its own."""
    link, room = job.link, job.room
    if (
        not job.last
        or tail.aux_posted
        or not (link.aux_in_note and link.sends_aux)
        or room.aux_index is None
        or link.sends_groups
    ):
        return None
    tail.aux_posted = True
    return aux_row(ctx, room)


def aux_row(ctx: RankContext, room: SendRoom) -> list[bytes] | None:
    """Prefill worker: the request's aux row as its last note carries it, stamped with the
    room (None: the request has no aux row on this rank)."""
    if room.aux_index is None:
        return None
    ctx.stamps[room.aux_index, 0] = room.room
    return read_row(ctx.aux_regions, room.aux_index)
