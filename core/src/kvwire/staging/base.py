"""The :class:`StagingStrategy` seam between the KV pool and the wire.

A strategy decides which rows a chunk's transfer moves. ``direct`` moves rows of the KV pool
itself (through the mapper's tables). A staging strategy (``bulk``, :mod:`kvwire.staging.bulk`)
gathers a chunk into memory it allocated, moves that with one row per (source rank,
destination rank, chunk), and scatters it on arrival. Memory a strategy allocates reaches the
engine only through the :class:`StagingContext` callbacks (``register_fn``), so a backend
plugin contributes no staging code.

Call order (who calls, from which side):

1. both sides, at manager start: :meth:`StagingStrategy.setup` with a context whose
   ``register_fn`` registers memory with the selected backend;
2. receiving side, at handshake: :meth:`StagingStrategy.describe` (sent to the sender);
   sending side: :meth:`StagingStrategy.link_tables`; receiving side, once the sender said
   the link stages: :meth:`StagingStrategy.on_link`;
3. sending side, engine thread, per chunk queued: :meth:`StagingStrategy.on_queued`; then,
   transfer worker: :meth:`StagingStrategy.plan` (maps pages, and gathers into staging memory
   if the strategy stages; None means "wait") before the submit;
4. sending side, after the transfer is terminal: :meth:`StagingStrategy.on_sent`;
5. receiving side, on each chunk notification: :meth:`StagingStrategy.on_arrival` (scatter);
6. both sides, on every terminal path of a request: :meth:`StagingStrategy.release`; the
   sending side tells the receiver with :meth:`StagingStrategy.on_abandoned` when a failed
   request's writes ended, the receiver hears it in :meth:`StagingStrategy.writes_ended`.

Throughout: :meth:`StagingStrategy.on_message` receives the strategy's own messages (sent
with :meth:`StagingContext.post`, carried by core in a
:class:`~kvwire.control.wire.StagingMessage` envelope), :meth:`StagingStrategy.tick` runs on
the progress thread, and :meth:`StagingStrategy.peer_lost` drops what a dead peer held. Core
session code knows none of a strategy's messages or state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
from pydantic import BaseModel

from kvwire.backend import NoOptions
from kvwire.control.wire import StagingMessage
from kvwire.descriptors import IndexArray
from kvwire.errors import TransferError
from kvwire.index.base import IndexMapper, TablePair
from kvwire.layout import KVLayout, MemoryRegion
from kvwire.page_form import PageChunk
from kvwire.regions import MemKind

#: Registers (or deregisters) memory a strategy allocated with the selected backend.
RegisterFn = Callable[[Sequence[MemoryRegion]], None]


def _no_send(endpoint: str, msg: Any) -> bool:
    return False


def _no_room(room: int) -> Any:
    return None


def _no_wake() -> None:
    return None


@dataclass
class StagingContext:
    """What core hands a strategy at setup: the local layout, the memory callbacks, the way
    to talk to peers, and what a staging strategy needs to size itself."""

    layout: KVLayout
    register_fn: RegisterFn
    deregister_fn: RegisterFn
    #: Republishes local metadata after registration (peers must see new regions).
    publish_fn: Callable[[], None] = lambda: None
    #: "prefill" or "decode".
    role: str = "prefill"
    #: Transfer workers of a prefill manager (one private staging buffer set each).
    num_workers: int = 1
    #: The engine's KV tensors (layout order, or one stacked tensor) for gather/scatter.
    kv_tensors: Any = None
    #: Sends a control message to a peer endpoint (non-blocking; False if not queued). Core
    #: messages (``WritesDone``, ``WritesQuery``) go out with it directly; a strategy's own
    #: messages go through :meth:`post`.
    send_fn: Callable[[str, Any], bool] = _no_send
    #: The layout of the extra pool this strategy serves (decode; None for the "kv" pool,
    #: whose layout is ``layout``, and on prefill).
    pool_layout: KVLayout | None = None
    #: This rank's session id (messages carry it) and which pool the strategy serves.
    session: str = ""
    pool: str = "kv"
    #: Receiving side, any thread: the destination pages of live request ``room`` whose
    #: pages are known (a NumPy int64 array, in the pool's page units), or None when the
    #: request is unknown here, terminal, or has no pages yet.
    room_pages: Callable[[int], Any] = _no_room
    #: Sending side, any thread (quick, never blocking): a chunk waiting for staging space may
    #: go now (a grant came): the transfer workers look at their waiting chunks at once
    #: instead of at their next poll.
    wake_fn: Callable[[], None] = _no_wake

    def post(self, endpoint: str, strategy: str, type: str, body: BaseModel) -> bool:
        """Send one of the strategy's own messages to the peer at ``endpoint`` (any thread,
        non-blocking). The peer's strategy of the same pool gets it in
        :meth:`StagingStrategy.on_message`."""
        msg = StagingMessage(
            session=self.session,
            pool=self.pool,
            strategy=strategy,
            type=type,
            body=body.model_dump(mode="python"),
        )
        return self.send_fn(endpoint, msg)


@dataclass(frozen=True)
class ArrivedChunk:
    """A chunk whose every segment landed on the receiving side (see
    :meth:`StagingStrategy.on_arrival`)."""

    room: int
    #: The writing rank's session and the chunk's id among its chunks of the request.
    session: str
    chunk_id: int
    #: What the note says landed: "kv" (rows already in the pool) or "staged" (a block the
    #: receiving strategy must place).
    what: str
    #: The request's destination pages on this rank.
    dst_pages: Any


class LocalCopy(Protocol):
    """A copy a strategy started itself (e.g. into a peer's shared host pool on the same
    machine) instead of submitting rows to the backend. The pipeline polls :meth:`done` from
    the transfer worker and tells decode with a control-channel note once it is True."""

    #: Bytes and rows moved (metrics).
    nbytes: int
    num_rows: int

    def done(self) -> bool:
        """Non-blocking: True once every byte is visible to the peer. Raises
        :class:`~kvwire.errors.TransferError` if the copy failed."""
        ...


_NO_ROWS: IndexArray = np.empty(0, dtype=np.int64)


class _Rows:
    """Index arrays given, or expanded once from a page form when first read (a chunk in
    page form submitted to a backend with page writes never expands them). One thread
    owns a plan (its transfer worker)."""

    _src: IndexArray | None
    _dst: IndexArray | None
    pages: PageChunk | None

    def _set_rows(
        self, src_idx: IndexArray | None, dst_idx: IndexArray | None, pages: PageChunk | None
    ) -> None:
        if pages is None and (src_idx is None or dst_idx is None):
            raise ValueError("rows or a page form are required")
        self._src, self._dst, self.pages = src_idx, dst_idx, pages

    def _expand(self) -> tuple[IndexArray, IndexArray]:
        if self._src is None or self._dst is None:
            assert self.pages is not None
            self._src, self._dst = self.pages.rows()
        return self._src, self._dst

    @property
    def src_idx(self) -> IndexArray:
        """Rows of the source table (expanded from :attr:`pages` when first read)."""
        return self._expand()[0]

    @property
    def dst_idx(self) -> IndexArray:
        """Rows of the destination table (expanded from :attr:`pages` when first read)."""
        return self._expand()[1]


class Segment(_Rows):
    """One part of a chunk with its own completion: rows of one (source kind, destination
    kind), submitted through the prepared pair ``table``, or a :class:`LocalCopy` the strategy
    already started (``copy``). ``pages``: the same rows in page form (the mapper's own
    table only), which the pipeline submits as pages to a backend with page writes."""

    def __init__(
        self,
        label: str,
        table: str = "",
        src_idx: IndexArray | None = None,
        dst_idx: IndexArray | None = None,
        copy: LocalCopy | None = None,
        pages: PageChunk | None = None,
    ) -> None:
        self.label, self.table, self.copy = label, table, copy
        if pages is None and src_idx is None and dst_idx is None:
            src_idx = dst_idx = _NO_ROWS
        self._set_rows(src_idx, dst_idx, pages)

    def __repr__(self) -> str:
        return f"Segment({self.label!r}, {self.table!r}, pages={self.pages is not None})"


@dataclass
class LayerPlan:
    """A staged layer-wise chunk (:meth:`StagingStrategy.plan_layers`): ``plan`` is the whole
    chunk's plan (its ``token`` comes back in :meth:`StagingStrategy.on_sent`, once); group
    ``g``'s rows of ``plan.table`` are ``rows[g]`` (empty: its bytes travel with a later
    group); ``fill(g)`` stages group ``g``'s bytes, called by the transfer worker once those
    layers are computed, before group ``g``'s rows are posted (and only then)."""

    plan: ChunkPlan
    rows: list[tuple[IndexArray, IndexArray]]
    fill: Callable[[int], None]


class ChunkPlan(_Rows):
    """What the transfer worker submits for one chunk.

    ``table`` names the prepared pair to use: ``"kv"`` for the mapper's KV tables, or a name
    the strategy registered. ``src_idx``/``dst_idx`` index into that pair (given, or expanded
    from ``pages`` when first read). ``token`` is opaque strategy state handed back to
    :meth:`StagingStrategy.on_sent`. ``what``: the notification kind decode sees: "kv" (rows
    landed in the pool) or "staged" (a block landed in the staging ring and must be
    scattered). ``segments``: set when the strategy splits the chunk itself: each segment
    completes on its own and decode counts the chunk once every segment's note arrived
    (``table``/``src_idx``/``dst_idx`` are then unused). ``pages``: the chunk in page form
    (:mod:`kvwire.page_form`; ``table`` "kv" only), for a backend with page writes.
    """

    def __init__(
        self,
        table: str,
        src_idx: IndexArray | None = None,
        dst_idx: IndexArray | None = None,
        token: Any = None,
        what: str = "kv",
        segments: list[Segment] | None = None,
        pages: PageChunk | None = None,
    ) -> None:
        self.table, self.token, self.what, self.segments = table, token, what, segments
        if segments is not None and src_idx is None and pages is None:
            src_idx = dst_idx = _NO_ROWS
        self._set_rows(src_idx, dst_idx, pages)

    def __repr__(self) -> str:
        return f"ChunkPlan({self.table!r}, what={self.what!r}, pages={self.pages is not None})"

    @classmethod
    def direct(cls, mapper: IndexMapper, src_pages: Any, dst_pages: Any) -> ChunkPlan:
        """The chunk's rows in the mapper's KV tables, moved in place (no staging): in page
        form where the link's mapping is regular (rows expanded only if read), else rows."""
        pages = mapper.page_chunk(src_pages, dst_pages)
        if pages is not None:
            return cls(table="kv", pages=pages)
        src_idx, dst_idx = mapper.map_chunk(src_pages, dst_pages)
        return cls(table="kv", src_idx=src_idx, dst_idx=dst_idx)

    def segment(self, table: str) -> Segment:
        """The plan's rows (or page form) as one segment of prepared pair ``table``, rows
        not expanded (the prefill worker, when the strategy gave no segments)."""
        return Segment("", table, self._src, self._dst, pages=self.pages)

    @property
    def empty(self) -> bool:
        """No rows to move (dummy sender, or a chunk of zero pages)."""
        if self.segments is not None:
            return not self.segments
        if self.pages is not None:
            return self.pages.src_pages.size == 0
        return self.src_idx.size == 0


@dataclass(frozen=True)
class LinkStaging:
    """What a strategy does with one link (:meth:`StagingStrategy.link_staging`): the extra
    table pairs to prepare (empty: rows move in place) and why, in words."""

    tables: dict[str, Any]
    why: str

    @property
    def staged(self) -> bool:
        return bool(self.tables)


@dataclass(frozen=True)
class QueuedChunk:
    """A chunk with data just queued for one destination (see
    :meth:`StagingStrategy.on_queued`)."""

    room: int
    chunk_id: int
    mapper: IndexMapper
    #: Source pages of the chunk, and where they start among the destination's units.
    npages: int
    dst_start: int
    #: The destination (decode session) and its control endpoint.
    dest: str
    endpoint: str
    #: This sender's id and session (for messages the strategy sends).
    sender_id: int
    session: str
    timeout_s: float
    #: The chunk's source units as the worker will get them: its pages, or, for a link that
    #: converts page sizes (``mapper.paging``), its granule stream (``-1``: a granule of a
    #: destination page an earlier chunk writes); ``npages`` is its length.
    units: Any = None


@dataclass(frozen=True)
class PlanRequest:
    """One chunk to plan (sending side, transfer worker): what :meth:`StagingStrategy.plan`
    and :meth:`StagingStrategy.plan_layers` are asked about.

    ``room`` and ``chunk_id`` name the chunk; ``mapper`` is the link's mapper of the pool;
    ``src_pages``/``dst_pages`` the chunk's pages on both sides; ``dest`` the destination
    (decode session); ``worker`` the transfer worker asking (strategies keep staging space per
    worker); ``edges`` (layer-wise chunks only) the first layer of each layer group and the
    end: group ``g`` is model layers ``[edges[g], edges[g+1])``."""

    room: int
    chunk_id: int
    mapper: IndexMapper
    src_pages: Any
    dst_pages: Any
    dest: str = ""
    worker: int = 0
    edges: Any = None


class StagingStrategy(ABC):
    """How a chunk's bytes reach the wire. One instance per :class:`~kvwire.KVManager`."""

    name: ClassVar[str] = "abstract"
    options_model: ClassVar[type[BaseModel]] = NoOptions
    #: ``--staging auto`` (the default) picks this strategy for a rank whose KV pool lies
    #: wholly in memory of these kinds (the highest-priority such strategy that sets up;
    #: ``direct`` where none does): bulk staging declares GPU memory.
    auto_memory: ClassVar[frozenset[MemKind]] = frozenset()

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options if options is not None else self.options_model()
        self.context: StagingContext | None = None

    def setup(self, context: StagingContext) -> None:
        """Allocate and register staging memory through ``context.register_fn``. Called once
        on both sides when the manager starts."""
        self.context = context

    @abstractmethod
    def plan(self, req: PlanRequest) -> ChunkPlan | None:
        """Sending side, transfer worker ``req.worker`` thread, per chunk for destination
        ``req.dest`` (the decode session), before submit: decide the rows to move (and
        gather them into staging memory when the strategy stages). None means "not yet"
        (waiting for staging space): the worker asks again later, keeping the destination's
        chunks in order."""

    def plan_layers(self, req: PlanRequest) -> LayerPlan | None:
        """Sending side, transfer worker, for a layer-wise chunk (``send(..., layerwise=True)``)
        before its layers are computed: a plan whose rows are known now and whose staging
        memory is filled one layer group at a time (:class:`LayerPlan`); None means "not yet"
        (as :meth:`plan`). Layer group ``g`` is model layers
        ``[req.edges[g], req.edges[g+1])``.

        The default raises ``NotImplementedError``: a strategy that stages stages a layer-wise
        chunk whole, once every layer is computed (through :meth:`plan`). Core calls this only
        on a strategy that sets :attr:`stages_layers`."""
        raise NotImplementedError(f"the {self.name} strategy does not stage by layer group")

    #: The strategy implements :meth:`plan_layers` (it stages layer-wise chunks group by group).
    stages_layers: ClassVar[bool] = False

    def on_sent(self, room: int, plan: ChunkPlan, ok: bool) -> None:  # noqa: B027 - optional
        """Sending side, after the chunk's transfer is terminal (its buffer may be reused)."""

    def on_arrival(self, chunk: ArrivedChunk) -> None:
        """Receiving side, progress thread (a backend notification) or liveness thread (a
        copy's control note), under the decode side's lock, when every segment of a chunk
        landed: place a staged block into the pool. Raising a ``KVWireError`` fails the
        request on both sides. The default refuses staged blocks (this rank stages none)."""
        if chunk.what == "staged":
            raise TransferError(
                f"a staged chunk {chunk.chunk_id} arrived from {chunk.session}, but this "
                f"rank's {self.name!r} strategy stages nothing (both sides must run the same "
                "--staging)",
                room=chunk.room,
            )

    def release(self, room: int) -> None:  # noqa: B027 - optional hook
        """Both sides, on every terminal path of a request: free what the room holds."""

    # ----------------------------------------------------------- staging lifecycle hooks
    # Strategies that stage (``bulk``) implement these; ``direct`` keeps the defaults.
    def describe(self) -> dict[str, Any] | None:
        """Decode side, at handshake: what prefill must know about this rank's staging memory
        (sent in ``Hello.staging``); None when this rank does not stage."""
        return None

    def link_tables(
        self,
        mapper: IndexMapper,
        remote: dict[str, Any] | None,
        *,
        session: str = "",
        tables: TablePair | None = None,
    ) -> dict[str, Any]:
        """Prefill side, at handshake with one decode rank (decode session ``session``): extra
        descriptor table pairs to prepare for that link (name -> ``TablePair``); empty when the
        link does not stage. ``remote`` is what that rank's strategy :meth:`describe` d;
        ``tables`` the mapper's tables when core already built them (extra-pool links)."""
        return {}

    def link_staging(
        self,
        mapper: IndexMapper,
        remote: dict[str, Any] | None,
        advice: str = "configured",
        *,
        session: str = "",
        tables: TablePair | None = None,
    ) -> LinkStaging:
        """Prefill side, at handshake with one decode rank: :meth:`link_tables` with the
        per-link rule's staging advice (:data:`kvwire.link_choice.StagingAdvice`:
        ``"staged"``, ``"direct"`` or ``"configured"``) and what was applied, in words (the
        startup log and ``kvwire doctor`` print it). The default ignores the advice (a
        strategy that stages nothing has nothing to apply); a staging strategy overrides it."""
        extra = self.link_tables(mapper, remote, session=session, tables=tables)
        why = f"--staging {self.name}: " + ("staged" if extra else "rows move in place")
        return LinkStaging(extra, why)

    def room_tables(self) -> dict[str, int]:
        """Sizes of per-request staging state (leak check)."""
        return {}

    def memory(self) -> str | None:
        """Engine thread, at startup after :meth:`setup`: the memory this strategy took
        beside the pool, in words for the startup log (e.g. ``"decode's staging ring: 1024 MiB
        in cuda:0 (ring_bytes)"``),
        or None when it took none."""
        return None

    def chunk_pages(self, mapper: IndexMapper) -> int | None:
        """Sending side, engine thread inside ``send()`` (under the session lock), for links
        where :meth:`link_tables` returned tables, before the chunk is queued: the most
        prefill pages one chunk to a destination over ``mapper`` may hold, or None (no
        limit, the default). A longer chunk is cut into chunks of that many pages, in order,
        each planned and moved on its own, as if the engine had sent them one by one: a
        large request then overlaps one chunk's gather with the previous chunk's transfer
        and the decode side's scatter. Not asked for layer-wise chunks (their layer groups
        are planned as one chunk)."""
        return None

    def on_queued(self, chunk: QueuedChunk) -> None:  # noqa: B027 - optional hook
        """Sending side, engine thread inside ``send()`` (under the session lock: quick, never
        blocking), for links where :meth:`link_tables` returned tables: a chunk was queued for
        a worker. A strategy that needs the receiver's consent (ring space) asks for it here,
        so the answer is likely back when the worker reaches the chunk. Raising a
        ``KVWireError`` fails the request."""

    def on_requested(  # noqa: B027 - optional hook
        self, room: int, npages: int, writers: Sequence[str]
    ) -> None:
        """Receiving side, under the decode side's room lock (quick, never blocking, calls
        nothing of core but ``StagingContext.post``/``send_fn``), right before the transfer
        request of ``room`` (``npages`` destination pages in this strategy's pool) goes to its
        source ranks, whose sessions are ``writers``. A strategy that needs to consent to each
        chunk may consent ahead here, so a sender whose chunk matches need not ask: bulk
        staging offers ring space for one chunk covering every page. Its messages go ahead of
        the request on the same channel, so the sender has them before it can send (a prefill
        engine that computed already sends as soon as it sees the request). A request sent
        again (a restarted prefill rank) may find its answer asked for already. Raising is
        logged, not fatal."""

    def on_abandoned(  # noqa: B027 - optional hook
        self, room: int, dest: str, endpoint: str, sender_id: int, session: str
    ) -> None:
        """Sending side, worker thread, for links where :meth:`link_tables` returned tables:
        nothing more will be written for ``room`` to ``dest`` (the request failed; its posted
        writes all ended). Free what was asked for it; tell the receiver if it holds space."""

    def on_message(self, peer_endpoint: str, msg: StagingMessage) -> None:  # noqa: B027
        """Either side, liveness thread (quick, never blocking): one of this strategy's own
        messages from the handshaken peer whose control endpoint is ``peer_endpoint``
        (``msg.session``; ``msg.type`` and ``msg.body`` are the strategy's to validate).
        Messages of unknown peers or of another strategy never reach it."""

    def on_link(self, session: str, endpoint: str, mapper: IndexMapper) -> None:  # noqa: B027
        """Receiving side, liveness thread, at handshake: the sender ``session`` (control
        endpoint ``endpoint``) said it will stage its chunks for this rank; ``mapper`` maps
        its pages to ours (for placing staged blocks). Raising a ``KVWireError`` refuses the
        link (the handshake fails naming why)."""

    def writes_ended(self, room: int, session: str) -> None:  # noqa: B027 - optional hook
        """Receiving side, liveness thread: the sender ``session`` confirmed that none of its
        writes for ``room`` (failed or aborted) is in flight or will be made: free what the
        room holds for it."""

    def tick(self, now: float) -> None:  # noqa: B027 - optional hook
        """Either side, progress thread, every turn (cheap when idle): retries, expiries,
        periodic announcements."""

    def peer_lost(self, session: str) -> None:  # noqa: B027 - optional hook
        """Either side, progress thread: a peer was evicted; drop what belongs to it."""

    def close(self) -> None:
        """Deregister and free staging memory (manager shutdown)."""
        self.context = None
