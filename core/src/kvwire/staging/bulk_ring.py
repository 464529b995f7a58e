"""Bulk staging, receiving (decode) side: the staging ring, grants and scatters.

Lock contract: ``_lock`` guards the ring, the allocations, the links and the per-request
bookkeeping; it is held only for table updates, never across a scatter, a send or a call into
core. Called from the liveness thread (asks, links, ``writes_ended``), the progress thread
(``tick``, ``peer_lost``, arrivals of backend notifications) and the engine thread
(``release``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from prometheus_client import Counter
from pydantic import ValidationError

from kvwire.control.wire import StagingMessage, WritesQuery
from kvwire.errors import KVWireError, TransferError
from kvwire.index.base import IndexMapper, StagedSlice
from kvwire.layout import MemoryRegion
from kvwire.staging.base import ArrivedChunk, StagingContext
from kvwire.staging.bulk_wire import Ask, BulkMessage, Deny, Grant, Watermark
from kvwire.staging.kernels import KVTensors
from kvwire.staging.ring import Allocation, RingAllocator

logger = logging.getLogger(__name__)

STAGED = Counter("kvwire_staged_chunks", "Chunks moved through the staging ring")

#: (room, writer session, chunk id): one staged chunk's ring allocation.
Key = tuple[int, str, int]


#: Each link's staged slice (None: the link is not staged), found once: a mapper's answer does
#: not change after the handshake built it, and both sides ask for it several times per chunk.
_SLICES: weakref.WeakKeyDictionary[IndexMapper, tuple[StagedSlice | None]] = (
    weakref.WeakKeyDictionary()
)


def slice_of(mapper: IndexMapper) -> StagedSlice | None:
    """The mapper's :meth:`~kvwire.index.base.IndexMapper.staged_slice`, asked once."""
    got = _SLICES.get(mapper)
    if got is None:
        got = _SLICES[mapper] = (mapper.staged_slice(),)
    return got[0]


def staged(mapper: IndexMapper) -> StagedSlice:
    """The mapper's staged slice; a link that reached staging has one."""
    sl = slice_of(mapper)
    if sl is None:
        raise TransferError(f"the {mapper.name} mapper's links are not staged")
    return sl


def unit_tokens(mapper: IndexMapper) -> int:
    """Tokens of one unit of a staged block: a page, or, where the link converts page sizes,
    a granule (:attr:`~kvwire.index.paging.PageConversion.granule`: the gcd of both page
    sizes for whole rows, one token for head slices) -- the block is then gathered in token
    order from prefill's pages and scattered into decode's pages of another size."""
    return mapper.paging.granule if mapper.paging is not None else mapper.src.model.page_size


def block_bytes(mapper: IndexMapper, npages: int) -> int:
    """Bytes of a staged block: every pair's slice (head slice, or whole row for equal TP)
    of every token of ``npages`` units (pages, or granules: :func:`unit_tokens`)."""
    return mapper.num_pairs * npages * unit_tokens(mapper) * staged(mapper).nbytes


def chunk_limit(mapper: IndexMapper, buffer_bytes: int) -> int | None:
    """The most prefill pages of one staged chunk over ``mapper`` that a staging buffer of
    ``buffer_bytes`` holds (every pair's slice of every token of the page), or None where not
    even one page fits (such a chunk moves per descriptor, counted as a fallback). Both sides
    use it: prefill cuts longer chunks there, decode offers space for the first one."""
    per_page = mapper.num_pairs * mapper.src.model.page_size * staged(mapper).nbytes
    return buffer_bytes // per_page if per_page <= buffer_bytes else None


def dst_units(mapper: IndexMapper, pages: NDArray[np.int64], start: int, count: int) -> Any:
    """Decode, per staged chunk: the destination units ``[start, start + count)`` of the
    request's destination ``pages``: pages, or, where the link converts page sizes, the
    granules of those pages in order (``page * granules_per_page + k``). NumPy only."""
    if mapper.paging is None:
        return pages[start : start + count]
    r = mapper.paging.dst_granules
    every = (pages[:, None] * r + np.arange(r, dtype=np.int64)[None, :]).ravel()
    return every[start : start + count]


def units_of(mapper: IndexMapper, pages: NDArray[np.int64]) -> int:
    """Decode: how many destination units the request's ``pages`` hold."""
    return pages.size * (mapper.paging.dst_granules if mapper.paging is not None else 1)


def unit_owners(
    mapper: IndexMapper, npages: int, block: int, edges: NDArray[np.int64]
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """For a staged block written layer group by layer group (``[pair, page, token, slice]``,
    groups of model layers cut at ``edges``): the group that writes each ``block``-byte unit
    (the last group with bytes in it: the unit is written once, complete) and the group of
    each buffer pair. NumPy only."""
    layer = mapper.src.buffer_keys[mapper.src_buf, 0]
    pair_group = (np.searchsorted(edges, layer, side="right") - 1).astype(np.int64)
    per = npages * unit_tokens(mapper) * staged(mapper).nbytes  # bytes of one pair
    n = mapper.num_pairs * per
    units = -(-n // block)
    first = np.arange(mapper.num_pairs, dtype=np.int64) * per // block
    last = (np.arange(1, mapper.num_pairs + 1, dtype=np.int64) * per - 1) // block
    counts = last - first + 1
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    owner = np.full(units, -1, dtype=np.int64)
    np.maximum.at(owner, np.repeat(first, counts) + offsets, np.repeat(pair_group, counts))
    return owner, pair_group


@dataclass
class _Space:
    """One granted allocation and where its chunk goes."""

    alloc: Allocation
    dst_start: int
    npages: int
    released_at: float | None = None
    queried_at: float = 0.0


@dataclass
class _Writer:
    """A prefill rank that stages into this ring."""

    endpoint: str
    mapper: IndexMapper


class RingSide:
    """The decode half of :class:`~kvwire.staging.bulk.BulkStaging` (see its module)."""

    def __init__(
        self,
        context: StagingContext,
        kv: KVTensors,
        ring_bytes: int,
        block: int,
        retry_s: float,
        release_timeout_s: float,
        watermark_every_s: float,
        post: Callable[[str, BulkMessage], bool],
    ) -> None:
        self.context = context
        self.kv = kv
        self.mem: Any = kv.alloc(ring_bytes)
        self.ring = RingAllocator(ring_bytes, block)
        self.region = MemoryRegion.from_tensor(self.mem, item_len=block)
        self._retry_s = retry_s
        self._release_timeout_s = release_timeout_s
        self._watermark_every_s = watermark_every_s
        self._post = post
        self._lock = threading.Lock()
        self._space: dict[Key, _Space] = {}
        self._writers: dict[str, _Writer] = {}
        #: Staged chunks already scattered, per room: a late duplicate ask for one of them
        #: must not allocate again (the space would never be written or freed).
        self._done: dict[int, set[tuple[str, int]]] = {}
        self._next_watermark = 0.0

    # ------------------------------------------------------------------ links
    def on_link(self, session: str, endpoint: str, mapper: IndexMapper) -> None:
        """Liveness thread, at handshake: ``session`` stages into this ring."""
        if mapper.staged_slice() is None:
            raise TransferError(
                f"bulk staging scatters row slices; the {mapper.name} mapper of {session} "
                "moves by descriptors only"
            )
        with self._lock:
            self._writers[session] = _Writer(endpoint, mapper)

    def peer_lost(self, session: str) -> None:
        """Progress thread: a writer was evicted; free the ring space it held."""
        with self._lock:
            self._writers.pop(session, None)
        if self._free_where(lambda k: k[1] == session):
            self.broadcast()

    # --------------------------------------------------------------- messages
    def on_message(self, endpoint: str, msg: StagingMessage) -> None:
        """Liveness thread: a writer asks for ring space (the only message decode gets)."""
        if msg.type != Ask.type:
            logger.warning("bulk staging: dropped a %r message from %s", msg.type, msg.session)
            return
        try:
            ask = Ask.model_validate(msg.body)
        except ValidationError as exc:
            logger.warning("bulk staging: malformed ask from %s: %s", msg.session, exc)
            return
        answer = self._answer(msg.session, ask)
        if answer is not None:
            self._post(endpoint, answer)

    def offer(
        self,
        room: int,
        npages: int,
        writers: Sequence[str],
        first: Callable[[IndexMapper, int], int],
    ) -> None:
        """Decode, under the room lock, right before the request of ``room`` goes out: offer each
        staging writer among ``writers`` the space of its chunk 0 (a ``grant`` with
        ``npages``: see :mod:`~kvwire.staging.bulk_wire`), of the units ``first`` says that
        writer's chunk 0 covers of the request's ``npages`` (every page, or as many as the
        writer's staging buffer holds where it cuts the request in chunks; 0: it would not
        stage, no offer), where the space is free now (an offer never waits on the watermark,
        so it never holds up other requests' chunks behind a request that may be computed
        much later)."""
        offers: list[tuple[str, Grant]] = []
        with self._lock:
            for session in writers:
                writer = self._writers.get(session)
                if writer is None:
                    continue
                units = first(writer.mapper, npages)
                if units <= 0:
                    continue
                key = (room, session, 0)
                if key in self._space or (session, 0) in self._done.get(room, ()):
                    continue
                nbytes = block_bytes(writer.mapper, units)
                if not self.ring.ready_now(nbytes):
                    continue
                alloc = self.ring.allocate(nbytes, key)
                wm = self.ring.watermark
                self._space[key] = _Space(alloc, 0, units)
                grant = Grant(
                    room=room, chunk_id=0, alloc_id=alloc.id, round=alloc.round,
                    offset=alloc.offset, end=alloc.end, wm_round=wm[0], wm_tail=wm[1],
                    dst_start=0, npages=units, nbytes=nbytes,
                )  # fmt: skip
                offers.append((writer.endpoint, grant))
        for endpoint, grant in offers:
            self._post(endpoint, grant)

    def _answer(self, session: str, ask: Ask) -> BulkMessage | None:
        """The grant or deny for one ask (None for a duplicate of a chunk already placed).
        An ask for a chunk whose offered space covers other pages replaces the offer."""
        with self._lock:
            writer = self._writers.get(session)
            done = (session, ask.chunk_id) in self._done.get(ask.room, ())
        pages = self.context.room_pages(ask.room)
        reason = None
        if writer is None:
            reason = "this decode rank does not stage for that sender"
        elif pages is None:
            reason = "the request is not live on decode"
        elif done:
            return None
        elif ask.dst_start + ask.npages > units_of(writer.mapper, pages):
            what = "pages" if writer.mapper.paging is None else "granules of decode's pages"
            reason = (
                f"{what} [{ask.dst_start}, {ask.dst_start + ask.npages}) are outside the "
                f"{units_of(writer.mapper, pages)} destination {what}"
            )
        elif ask.nbytes != block_bytes(writer.mapper, ask.npages):
            reason = f"a block of {ask.npages} pages is not {ask.nbytes} bytes"
        if reason is None:
            key = (ask.room, session, ask.chunk_id)
            replaced = False
            try:
                with self._lock:
                    old = self._space.get(key)
                    if old is not None and (old.dst_start, old.npages) != (
                        ask.dst_start,
                        ask.npages,
                    ):  # an offer for other pages: the writer's chunk is smaller
                        del self._space[key]
                        replaced = self.ring.free(old.alloc.id)
                    alloc = self.ring.allocate(ask.nbytes, key)
                    self._space.setdefault(key, _Space(alloc, ask.dst_start, ask.npages))
                    wm = self.ring.watermark
            except KVWireError as exc:
                reason = str(exc)
            else:
                if replaced:  # the offer was the oldest allocation: other writers may go
                    self.broadcast()
                return Grant(
                    room=ask.room,
                    chunk_id=ask.chunk_id,
                    alloc_id=alloc.id,
                    round=alloc.round,
                    offset=alloc.offset,
                    end=alloc.end,
                    wm_round=wm[0],
                    wm_tail=wm[1],
                )
        return Deny(room=ask.room, chunk_id=ask.chunk_id, reason=reason)

    # --------------------------------------------------------------- arrivals
    def on_arrival(self, chunk: ArrivedChunk) -> None:
        """A staged block landed (under the decode side's lock): scatter it into the
        request's pages and free its ring space."""
        key = (chunk.room, chunk.session, chunk.chunk_id)
        with self._lock:
            space = self._space.get(key)
            writer = self._writers.get(chunk.session)
        if space is None or writer is None:
            raise TransferError(
                f"staged chunk {chunk.chunk_id} from {chunk.session} has no ring allocation",
                room=chunk.room,
            )
        m = writer.mapper
        ut = unit_tokens(m)
        pages = dst_units(
            m, np.asarray(chunk.dst_pages, dtype=np.int64), space.dst_start, space.npages
        )
        a = space.alloc
        sl = staged(m)
        self.kv.move_block(m.dst_buf, pages, sl.dst_lo, sl.dst_lo + sl.nbytes, self.mem,
                           a.offset, ut, to_pool=True)  # fmt: skip
        STAGED.inc()
        with self._lock:
            self._space.pop(key, None)
            self._done.setdefault(chunk.room, set()).add((chunk.session, chunk.chunk_id))
            moved = self.ring.free(a.id)
        if moved:
            self.broadcast()

    def writes_ended(self, room: int, session: str) -> None:
        """Liveness thread: the writer's writes for ``room`` ended; free its space there."""
        if self._free_where(lambda k: k[0] == room and k[1] == session):
            self.broadcast()

    def release(self, room: int) -> None:
        """Engine thread, on clear: space a writer never confirmed is freed after
        ``release_timeout_s`` (a writer's ``writes_ended`` or eviction frees it sooner)."""
        now = time.monotonic()
        with self._lock:
            self._done.pop(room, None)
            for key, space in self._space.items():
                if key[0] == room and space.released_at is None:
                    space.released_at = now

    # ----------------------------------------------------------------- timing
    def tick(self, now: float) -> None:
        """Progress thread: ask the writers of cleared requests' space whether their writes
        ended (every ``request_retry_s``), free it after ``release_timeout_s`` (the last
        resort), and broadcast the watermark when it moved or periodically (so a lost
        broadcast only delays)."""
        stale: list[Key] = []
        query: set[tuple[int, str]] = set()
        with self._lock:
            for k, sp in self._space.items():
                if sp.released_at is None:
                    continue
                if now - sp.released_at > self._release_timeout_s or k[1] not in self._writers:
                    stale.append(k)
                elif now - sp.queried_at > self._retry_s:
                    sp.queried_at = now
                    query.add((k[0], k[1]))
            endpoints = {s: w.endpoint for s, w in self._writers.items()}
        if stale:
            logger.warning("bulk staging: freeing %d allocations never released", len(stale))
        moved = self._free_where(lambda k: k in stale) if stale else False
        for room, writer in sorted(query):
            ep = endpoints.get(writer)
            if ep is not None:
                self.context.send_fn(ep, WritesQuery(room=room, session=self.context.session))
        if moved or now >= self._next_watermark:
            self._next_watermark = now + self._watermark_every_s
            self.broadcast()

    def broadcast(self) -> None:
        """Tell every writer where the ring's free space starts (any thread)."""
        with self._lock:
            wm = self.ring.watermark
            endpoints = [w.endpoint for w in self._writers.values()]
        msg = Watermark(round=wm[0], tail=wm[1])
        for ep in endpoints:
            self._post(ep, msg)

    def _free_where(self, pred: Callable[[Key], bool]) -> bool:
        """Free every allocation whose key matches; True if the watermark moved."""
        with self._lock:
            before = self.ring.watermark
            for key in [k for k in self._space if pred(k)]:
                self.ring.free(self._space.pop(key).alloc.id)
            return self.ring.watermark != before

    def room_tables(self) -> dict[str, int]:
        with self._lock:
            return {"staging_allocations": len(self._space), "staging_done": len(self._done)}
