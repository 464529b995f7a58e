"""Bulk staging, sending (prefill) side: asks for ring space, gathers into private buffers,
writes one block per chunk.

Lock contract: ``_lock`` guards the asks, the offers, the watermark views and the free buffer
lists; it is held only for table updates, never across a gather, a send or a call into core.
Called from the
engine thread (``on_queued``, ``release``), the transfer workers (``plan``, ``on_sent``,
``abandon``), the liveness thread (``on_message``) and the progress thread (``peer_lost``,
``tick``). A grant (or an offer taken by ``on_queued``) lets the chunk's worker go at once:
``on_message`` wakes the workers through ``StagingContext.wake_fn``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import Counter
from pydantic import ValidationError

from kvwire.control.wire import StagingMessage, WritesDone
from kvwire.errors import TransferError
from kvwire.index.base import IndexMapper
from kvwire.layout import MemoryRegion
from kvwire.staging.base import ChunkPlan, LayerPlan, QueuedChunk, StagingContext
from kvwire.staging.bulk_ring import block_bytes, staged, unit_owners, unit_tokens
from kvwire.staging.bulk_wire import MESSAGES, Ask, BulkMessage, Deny, Grant, Watermark
from kvwire.staging.kernels import KVTensors
from kvwire.staging.ring import Allocation, WatermarkView
from kvwire.staging.spans import Spans, span_rows

logger = logging.getLogger(__name__)

#: Order-0 spans: a row per block, at the block's position, which is where every span
#: table starts. The rows of a chunk whose link's spans are gone (its decode rank evicted
#: while the chunk was planned): longer, still right.
_BLOCKS = Spans(1 << 62, 0)

#: Staged chunks 0 by what became of decode's offer: ``taken`` (no ask sent), ``other_pages``
#: (the chunk covers other pages: asked), ``none`` (no offer had come: asked).
OFFERS = Counter(
    "kvwire_staging_offers", "Staged first chunks by what became of decode's offer", ["result"]
)


@dataclass
class _Ask:
    """One staged chunk's request, until it is written."""

    msg: Ask
    endpoint: str
    sent: float
    deadline: float
    grant: Allocation | None = None
    denied: str | None = None


def src_units(mapper: IndexMapper, src: Any) -> Any:
    """Prefill, per staged chunk: the source units to gather, in order: the chunk's pages,
    or, where the link converts page sizes, the granules of its granule stream that this
    chunk writes (:mod:`kvwire.index.paging`: ``-1`` marks granules it does not)."""
    units = np.asarray(src, dtype=np.int64)
    return units[units >= 0] if mapper.paging is not None else units


def chunk_units(chunk: QueuedChunk) -> tuple[int, int]:
    """Prefill, engine thread: a queued chunk's unit count and its first destination unit,
    as the ask carries them: pages from ``dst_start``, or, where the link converts page
    sizes, granules counted from the first granule of destination page ``dst_start`` (the
    stream's leading ``-1`` s are granules of a page an earlier chunk began)."""
    p = chunk.mapper.paging
    if p is None:
        return chunk.npages, chunk.dst_start
    if chunk.units is None:
        raise TransferError("a page-converting chunk was queued without its granule stream")
    units = np.asarray(chunk.units, dtype=np.int64)
    count = int((units >= 0).sum())
    return count, chunk.dst_start * p.dst_granules + (units.size - count)


def _matches(offer: Grant, ask: Ask) -> bool:
    """Whether space offered ahead fits a chunk exactly (the pages decode placed it for)."""
    return (offer.dst_start, offer.npages, offer.nbytes) == (ask.dst_start, ask.npages, ask.nbytes)


class WriterSide:
    """The prefill half of :class:`~kvwire.staging.bulk.BulkStaging` (see its module)."""

    def __init__(
        self,
        context: StagingContext,
        kv: KVTensors,
        buffer_bytes: int,
        buffers_per_worker: int,
        block: int,
        retry_s: float,
        post: Callable[[str, BulkMessage], bool],
        offer_ttl_s: float = 90.0,
    ) -> None:
        self.context = context
        self._offer_ttl_s = offer_ttl_s
        self.kv = kv
        self._buffer_bytes = buffer_bytes
        self._per_worker = buffers_per_worker
        self._block = block
        self._retry_s = retry_s
        self._post = post
        n = context.num_workers * buffers_per_worker
        self.buffers: Any = kv.alloc(n * buffer_bytes)
        self.region = MemoryRegion.from_tensor(self.buffers, item_len=block)
        self._lock = threading.Lock()
        self._free = [list(range(buffers_per_worker)) for _ in range(context.num_workers)]
        self._asks: dict[tuple[int, str, int], _Ask] = {}
        self._views: dict[str, WatermarkView] = {}
        #: Space decode offered ahead (unasked grants with ``npages``), until a chunk takes
        #: it, the room is released, or ``offer_ttl_s`` passed (a room never sent here).
        self._offers: dict[tuple[int, str, int], tuple[Grant, float]] = {}
        #: Each staged link's span rows (source, destination), by decode session.
        self._spans: dict[str, tuple[Spans, Spans]] = {}

    # ------------------------------------------------------------------ asks
    def request(self, ask: Ask, dest: str, endpoint: str, transfer_timeout_s: float) -> None:
        """Engine thread: ask decode ``dest`` for ring space for one chunk.

        A request's chunks to one decode rank are asked for one at a time, in order: the next
        goes out when the previous is granted. Allocation order then follows write order, so
        a chunk never waits for ring space held by a later chunk of its own request (that
        would deadlock once the ring wraps)."""
        now = time.monotonic()
        key = (ask.room, dest, ask.chunk_id)
        with self._lock:
            self._views.setdefault(dest, WatermarkView())
            earlier = any(
                k[0] == ask.room and k[1] == dest and a.grant is None for k, a in self._asks.items()
            )
            entry = _Ask(ask, endpoint, 0.0 if earlier else now, now + transfer_timeout_s)
            offer = self._offers.pop(key, None)
            if offer is not None and not earlier and _matches(offer[0], ask):
                g = offer[0]
                entry.grant = Allocation(g.alloc_id, g.round, g.offset, g.end)
            self._asks[key] = entry
        if ask.chunk_id == 0:
            taken = entry.grant is not None
            OFFERS.labels("taken" if taken else "none" if offer is None else "other_pages").inc()
        if entry.grant is None and not earlier:
            self._post(endpoint, ask)

    def on_queued(self, chunk: QueuedChunk, fits: Callable[[IndexMapper, int], bool]) -> None:
        """Engine thread: ask for ring space for a queued chunk now (unless it is too big to
        stage: ``fits`` decides, counting the fallback)."""
        count, dst_start = chunk_units(chunk)
        if not fits(chunk.mapper, count):
            return
        ask = Ask(
            room=chunk.room,
            sender_id=chunk.sender_id,
            chunk_id=chunk.chunk_id,
            nbytes=block_bytes(chunk.mapper, count),
            dst_start=dst_start,
            npages=count,
        )
        self.request(ask, chunk.dest, chunk.endpoint, chunk.timeout_s)

    def _next_unsent(self, room: int, dest: str) -> _Ask | None:
        """Under the lock: the first not-yet-sent ask of (room, dest), marked sent."""
        waiting = [
            (k[2], a)
            for k, a in self._asks.items()
            if k[0] == room and k[1] == dest and a.sent == 0.0
        ]
        if not waiting:
            return None
        ask = min(waiting, key=lambda x: x[0])[1]
        ask.sent = time.monotonic()
        return ask

    def on_message(self, endpoint: str, msg: StagingMessage) -> None:
        """Liveness thread: a decode rank answered an ask or moved its watermark."""
        cls = MESSAGES.get(msg.type)
        if cls is None or cls is Ask:
            logger.warning("bulk staging: dropped a %r message from %s", msg.type, msg.session)
            return
        try:
            body = cls.model_validate(msg.body)
        except ValidationError as exc:
            logger.warning("bulk staging: malformed %r from %s: %s", msg.type, msg.session, exc)
            return
        dest = msg.session
        nxt: _Ask | None = None
        with self._lock:
            view = self._views.setdefault(dest, WatermarkView())
            if isinstance(body, Watermark):
                moved = view.update((body.round, body.tail))
                if not moved or all(a.grant is None for a in self._asks.values()):
                    return
            else:
                assert isinstance(body, Grant | Deny)
                key = (body.room, dest, body.chunk_id)
                ask = self._asks.get(key)
                if isinstance(body, Grant):
                    view.update((body.wm_round, body.wm_tail))
                if ask is None:
                    if isinstance(body, Grant) and body.npages is not None:
                        self._offers[key] = (body, time.monotonic())  # offered ahead
                    return  # else a late or duplicate answer
                if isinstance(body, Deny):
                    ask.denied = body.reason
                elif ask.grant is not None:
                    return  # a duplicate grant (or an offer after the ask: the same space)
                elif body.npages is not None and not _matches(body, ask.msg):
                    return  # an offer for other pages (decode replaces it on the ask)
                else:
                    ask.grant = Allocation(body.alloc_id, body.round, body.offset, body.end)
                    nxt = self._next_unsent(body.room, dest)
        # the worker holding the chunk plans it now (a grant, space freed) or fails it (a
        # deny), not at its next poll
        self.context.wake_fn()
        if nxt is not None:
            self._post(nxt.endpoint, nxt.msg)

    # ---------------------------------------------------------------- writing
    def _acquire(self, ask: _Ask, dest: str, worker: int) -> tuple[int, int] | None:
        """Transfer worker: for a staged chunk's ask, a free buffer of this worker and its
        byte offset, once the space is granted and free (watermark); None: not yet."""
        if ask.denied is not None:
            raise TransferError(f"decode refused staging space: {ask.denied}", room=ask.msg.room)
        now = time.monotonic()
        if ask.grant is None:
            if now > ask.deadline:
                raise TransferError(
                    f"no staging grant for chunk {ask.msg.chunk_id} within the transfer timeout",
                    room=ask.msg.room,
                    peer=dest,
                )
            if ask.sent and now - ask.sent > self._retry_s:
                ask.sent = now
                self._post(ask.endpoint, ask.msg)
            return None
        with self._lock:
            if not self._views[dest].ready(ask.grant) or not self._free[worker]:
                return None
            slot = self._free[worker].pop()
        return slot, (worker * self._per_worker + slot) * self._buffer_bytes

    def _ask(self, room: int, dest: str, chunk_id: int) -> _Ask | None:
        """The chunk's ask; None when the chunk is not staged (equal TP, MLA, an oversize
        fallback)."""
        with self._lock:
            return self._asks.get((room, dest, chunk_id))

    def _gather(self, mapper: IndexMapper, pages: Any, start: int, pairs: Any = None) -> None:
        """Gather the row slices of ``pages`` (units: :func:`unit_tokens`) into the block at
        ``start`` (laid out ``[pair, unit, token, slice]``): every buffer pair, or the pairs
        ``pairs`` (sorted), one contiguous run of pairs at a time; synchronised."""
        ut = unit_tokens(mapper)
        sl = staged(mapper)
        lo = sl.src_lo
        per_pair = pages.size * ut * sl.nbytes  # the block is [pair, unit, token, slice]
        if pairs is None:
            runs = [(0, mapper.num_pairs)]
        else:  # a layer group's pairs: its K run and its V run
            cuts = np.flatnonzero(np.diff(pairs) != 1) + 1
            runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(pairs, cuts) if r.size]
        for a, b in runs:
            self.kv.move_block(mapper.src_buf[a:b], pages, lo, lo + sl.nbytes, self.buffers,
                               start + a * per_pair, ut, to_pool=False)  # fmt: skip

    def link_spans(self, dest: str, src: Spans, dst: Spans) -> None:
        """Prefill, at handshake: the span rows of the staging tables of the link to decode
        rank ``dest`` (:mod:`~kvwire.staging.spans`)."""
        with self._lock:
            self._spans[dest] = (src, dst)

    def _blocks(self, nbytes: int) -> tuple[int, float]:
        """The blocks a staged chunk of ``nbytes`` fills and the share of the last one."""
        nblocks = -(-nbytes // self._block)
        return nblocks, (nbytes - (nblocks - 1) * self._block) / self._block

    def _rows(
        self, ask: _Ask, start: int, units: Any, dest: str, last: float = 1.0
    ) -> tuple[Any, Any]:
        """Source and destination rows of the staging tables that move block ``units`` of
        the chunk: one span row per run of blocks and set bit of its length; the last unit,
        ``last`` of it filled, as a tail row where one covers it (:func:`span_rows`)."""
        assert ask.grant is not None
        b = self._block
        with self._lock:
            spans = self._spans.get(dest, (_BLOCKS, _BLOCKS))
        return span_rows(*spans, start // b + units, ask.grant.offset // b + units, last)

    def plan(
        self,
        room: int,
        chunk_id: int,
        mapper: IndexMapper,
        src_pages: Any,
        dst_pages: Any,
        dest: str,
        worker: int,
    ) -> ChunkPlan | None:
        """Transfer worker: the chunk's rows; a staged chunk once granted, its space free
        (watermark) and a buffer of this worker's free; None means "not yet"."""
        ask = self._ask(room, dest, chunk_id)
        if ask is None:  # not staged (equal TP, MLA, or an oversize fallback)
            return ChunkPlan.direct(mapper, src_pages, dst_pages)
        got = self._acquire(ask, dest, worker)
        if got is None:
            return None
        slot, start = got
        pages = src_units(mapper, src_pages)
        try:
            self._gather(mapper, pages, start)
        except BaseException:
            with self._lock:
                self._free[worker].append(slot)
            raise
        nblocks, last = self._blocks(block_bytes(mapper, pages.size))
        units = np.arange(nblocks, dtype=np.int64)
        src_idx, dst_idx = self._rows(ask, start, units, dest, last)
        token = (worker, slot, (room, dest, chunk_id))
        return ChunkPlan("staging", src_idx, dst_idx, token=token, what="staged")

    def plan_layers(
        self,
        room: int,
        chunk_id: int,
        mapper: IndexMapper,
        src_pages: Any,
        dst_pages: Any,
        edges: Any,
        dest: str,
        worker: int,
    ) -> LayerPlan | None:
        """Transfer worker: a staged layer-wise chunk. Its space and buffer are taken now;
        each layer group's pairs are gathered when the worker calls ``fill(g)``, and each
        block unit of the block goes with the last group that has bytes in it (a unit is
        written once, complete). A chunk that is not staged is cut by the mapper."""
        ask = self._ask(room, dest, chunk_id)
        if ask is None:  # not staged: the mapper's rows, cut by layer
            src_idx, dst_idx = mapper.map_chunk(src_pages, dst_pages)
            plan = ChunkPlan(table="kv", src_idx=src_idx, dst_idx=dst_idx)
            cut = mapper.split_layers(src_idx, dst_idx, edges)
            if cut is None:  # all rows with the last group
                empty = np.empty(0, dtype=np.int64)
                cut = [(empty, empty)] * (edges.size - 2) + [(src_idx, dst_idx)]
            return LayerPlan(plan, cut, lambda g: None)
        got = self._acquire(ask, dest, worker)
        if got is None:
            return None
        slot, start = got
        pages = src_units(mapper, src_pages)
        owner, pair_group = unit_owners(mapper, pages.size, self._block, edges)
        groups = edges.size - 1
        nblocks, last = self._blocks(block_bytes(mapper, pages.size))
        tail = nblocks - 1  # the chunk's last unit, partly filled: its group moves a tail
        units = [np.flatnonzero(owner == g) for g in range(groups)]
        rows = [self._rows(ask, start, u, dest, last if tail in u else 1.0) for u in units]
        every = self._rows(ask, start, np.arange(owner.size, dtype=np.int64), dest, last)
        token = (worker, slot, (room, dest, chunk_id))
        plan = ChunkPlan("staging", *every, token=token, what="staged")

        def fill(g: int) -> None:
            self._gather(mapper, pages, start, np.flatnonzero(pair_group == g))

        return LayerPlan(plan, rows, fill)

    def on_sent(self, plan: ChunkPlan) -> None:
        """Transfer worker: the staged write ended; its buffer may be reused."""
        if plan.token is None:
            return
        worker, slot, key = plan.token
        with self._lock:
            self._free[worker].append(slot)
            self._asks.pop(key, None)

    def abandon(self, room: int, dest: str, endpoint: str, sender_id: int, session: str) -> None:
        """Transfer worker: nothing more will be written for ``room`` to ``dest``: forget its
        asks and let decode free the space (duplicates are harmless)."""
        with self._lock:
            for key in [k for k in self._asks if k[0] == room and k[1] == dest]:
                del self._asks[key]
            for key in [k for k in self._offers if k[0] == room and k[1] == dest]:
                del self._offers[key]
        self.context.send_fn(endpoint, WritesDone(room=room, sender_id=sender_id, session=session))

    def release(self, room: int) -> None:
        """Engine thread, on clear: forget the room's asks and offers (decode frees offered
        space once this side confirms nothing is in flight for the room)."""
        with self._lock:
            for key in [k for k in self._asks if k[0] == room]:
                del self._asks[key]
            for key in [k for k in self._offers if k[0] == room]:
                del self._offers[key]

    def tick(self, now: float) -> None:
        """Progress thread: forget offers no chunk took within ``offer_ttl_s`` (a request
        this rank never got, or failed before it was created here)."""
        with self._lock:
            if not self._offers:
                return
            stale = [k for k, (_, t) in self._offers.items() if now - t > self._offer_ttl_s]
            for key in stale:
                del self._offers[key]

    def peer_lost(self, session: str) -> None:
        """Progress thread: a decode rank was evicted; forget its asks, watermark and span
        rows (a restarted rank comes back under a new session, with its own)."""
        with self._lock:
            self._views.pop(session, None)
            self._spans.pop(session, None)
            for key in [k for k in self._asks if k[1] == session]:
                del self._asks[key]
            for key in [k for k in self._offers if k[1] == session]:
                del self._offers[key]

    def room_tables(self) -> dict[str, int]:
        with self._lock:
            return {"staging_requests": len(self._asks), "staging_offers": len(self._offers)}
