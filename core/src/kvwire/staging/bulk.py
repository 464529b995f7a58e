"""``bulk``: stage heterogeneous-TP head slices through one contiguous write per chunk.

Without staging, a head-sliced (Tp != Td, MHA/GQA) chunk is one descriptor per (layer, K/V,
page, token). With ``bulk``, for every (prefill rank, decode rank, chunk):

1. prefill asks decode for ring space (:class:`~kvwire.control.wire.StagingRequest`, sent when
   the engine calls ``send()``, retried until granted, so a lost message costs a retry);
2. decode allocates it in its staging ring without waiting
   (:class:`~kvwire.staging.ring.RingAllocator`; duplicates get the same allocation) and answers
   with the allocation and its ring watermark (:class:`~kvwire.control.wire.StagingGrant`);
3. a prefill worker waits until the watermark says the allocation's bytes are free, gathers the
   chunk's head slices from every layer into one of its private staging buffers (torch, on the
   pool's device, synchronised), and writes the block with a handful of large descriptors;
4. decode scatters the block into its KV pages when the notification arrives (after the data),
   frees the ring space and, when the watermark moved, broadcasts it to its writers (and again
   every heartbeat, so a lost broadcast only delays).

Every path frees ring space: arrival, a writer's :class:`~kvwire.control.wire.WritesDone`
(sent once its in-flight writes for a failed request ended), a writer's eviction, or — the last
resort — ``release_timeout_s`` after decode cleared the request. A chunk too big for a staging
buffer or the ring takes the per-token path; that choice is made before any allocation and
counted (``kvwire_staging_fallbacks_total``). Equal-TP and MLA links are never staged (their
descriptors are whole pages already).

The only backend-specific part is memory registration, through ``register_fn``.
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
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvwire.control.wire import (
    Message,
    StagingDeny,
    StagingGrant,
    StagingRequest,
    StagingWatermark,
    WritesDone,
)
from kvwire.descriptors import make_table
from kvwire.errors import ConfigError, TransferError
from kvwire.index.base import IndexMapper, TablePair
from kvwire.index.head_slice import HeadSliceMapper
from kvwire.layout import MemoryRegion
from kvwire.staging.base import ChunkPlan, QueuedChunk, StagingContext, StagingStrategy
from kvwire.staging.kernels import KVTensors, block_view
from kvwire.staging.ring import Allocation, RingAllocator, WatermarkView

logger = logging.getLogger(__name__)

MiB = 1 << 20

FALLBACKS = Counter(
    "kvwire_staging_fallbacks", "Chunks sent per token because they exceed staging sizes"
)
STAGED = Counter("kvwire_staged_chunks", "Chunks moved through the staging ring")

#: Sends a control message to an endpoint (set by the manager).
SendFn = Callable[[str, Message], bool]


class BulkOptions(BaseModel):
    """Sizes and timings of bulk staging (``--staging-option key=value``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ring_bytes: int = Field(default=64 * MiB, gt=0, description="Decode staging ring size.")
    block_bytes: int = Field(
        default=64 * 1024, gt=0, description="Ring and buffer granularity (one descriptor)."
    )
    buffer_bytes: int = Field(
        default=16 * MiB, gt=0, description="One prefill staging buffer (largest staged chunk)."
    )
    buffers_per_worker: int = Field(default=2, ge=1, le=64)
    request_retry_s: float = Field(default=0.2, gt=0, description="Resend an unanswered request.")
    release_timeout_s: float = Field(
        default=90.0,
        gt=0,
        description="Decode frees a cleared request's ring space after this even if a writer "
        "never confirmed (a dead writer is evicted sooner).",
    )
    fallback_oversize: bool = Field(
        default=True,
        description="Send a chunk too big to stage per token (counted) instead of failing it.",
    )

    @model_validator(mode="after")
    def _sizes(self) -> BulkOptions:
        b = self.block_bytes
        for name in ("ring_bytes", "buffer_bytes"):
            if getattr(self, name) % b:
                raise ConfigError(f"bulk staging: {name} must be a multiple of block_bytes ({b})")
        if self.buffer_bytes > self.ring_bytes:
            raise ConfigError(
                f"bulk staging: buffer_bytes ({self.buffer_bytes}) exceeds ring_bytes "
                f"({self.ring_bytes}); a full buffer could never be granted"
            )
        return self


@dataclass
class _Space:
    """Decode: one granted allocation and where its chunk goes."""

    alloc: Allocation
    dst_start: int
    npages: int
    released_at: float | None = None
    queried_at: float = 0.0


@dataclass
class _Ask:
    """Prefill: one staged chunk's request, until it is written."""

    msg: StagingRequest
    endpoint: str
    sent: float
    deadline: float
    grant: Allocation | None = None
    denied: str | None = None


def block_bytes(mapper: IndexMapper, npages: int) -> int:
    """Bytes of a staged block: every pair's head slice of every token of ``npages`` pages."""
    assert isinstance(mapper, HeadSliceMapper)
    return mapper.num_pairs * npages * mapper.src.model.page_size * mapper.slice_bytes


class BulkStaging(StagingStrategy):
    """Bulk staging for heterogeneous TP (MHA/GQA); see the module docstring."""

    name = "bulk"
    options_model = BulkOptions

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self.opts: BulkOptions = self.options  # type: ignore[assignment]
        self._lock = threading.Lock()
        self.send_fn: SendFn = lambda endpoint, msg: False
        self.kv: KVTensors | None = None
        self._regions: list[MemoryRegion] = []
        # decode
        self.ring: RingAllocator | None = None
        self._ring_mem: Any = None
        self._space: dict[tuple[int, str, int], _Space] = {}
        # prefill
        self._buffers: Any = None
        self._free: list[list[int]] = []
        self._asks: dict[tuple[int, str, int], _Ask] = {}
        self._views: dict[str, WatermarkView] = {}
        self._transfer_timeout_s = 60.0

    # ------------------------------------------------------------------ setup
    def setup(self, context: StagingContext) -> None:
        super().setup(context)
        self.send_fn = context.send_fn
        if context.kv_tensors is None:
            raise ConfigError(
                "bulk staging gathers and scatters on the KV pool: build the manager with "
                "KVManager(..., kv_tensors=<the KV tensors the layout describes>)"
            )
        self.kv = KVTensors(context.layout, context.kv_tensors)
        o = self.opts
        if context.role == "decode":
            self._ring_mem = self.kv.alloc(o.ring_bytes)
            self.ring = RingAllocator(o.ring_bytes, o.block_bytes)
            self._regions = [MemoryRegion.from_tensor(self._ring_mem, item_len=o.block_bytes)]
        else:
            n = context.num_workers * o.buffers_per_worker
            self._buffers = self.kv.alloc(n * o.buffer_bytes)
            self._free = [list(range(o.buffers_per_worker)) for _ in range(context.num_workers)]
            self._regions = [MemoryRegion.from_tensor(self._buffers, item_len=o.block_bytes)]
        context.register_fn(self._regions)
        context.publish_fn()

    def close(self) -> None:
        if self.context is not None and self._regions:
            try:
                self.context.deregister_fn(self._regions)
            except Exception as exc:  # the backend may be closed already
                logger.debug("bulk staging: deregister: %s", exc)
        self._regions = []
        super().close()

    # ------------------------------------------------------------ decode side
    def describe(self) -> dict[str, Any] | None:
        if self.ring is None:
            return None
        r = self._regions[0]
        return {
            "strategy": "bulk",
            "ring_addr": r.addr,
            "ring_bytes": r.length,
            "block_bytes": self.opts.block_bytes,
            "device_id": r.device_id,
            "kind": int(r.kind),
        }

    @property
    def watermark(self) -> tuple[int, int]:
        assert self.ring is not None
        with self._lock:
            return self.ring.watermark

    def grant(
        self, room: int, session: str, chunk_id: int, nbytes: int, dst_start: int, npages: int
    ) -> Allocation:
        """Decode, control thread: ring space for a staged chunk (idempotent per chunk)."""
        assert self.ring is not None
        key = (room, session, chunk_id)
        with self._lock:
            alloc = self.ring.allocate(nbytes, key)
            self._space.setdefault(key, _Space(alloc, dst_start, npages))
            return alloc

    def scatter(
        self, room: int, session: str, chunk_id: int, mapper: IndexMapper, dst_pages: Any
    ) -> bool:
        """Decode, control thread, on a staged chunk's notification: scatter the block into the
        KV pages and free its ring space; True if the watermark moved."""
        assert self.ring is not None and self.kv is not None
        key = (room, session, chunk_id)
        with self._lock:
            space = self._space.get(key)
        if space is None:
            raise TransferError(
                f"staged chunk {chunk_id} from {session} has no ring allocation", room=room
            )
        assert isinstance(mapper, HeadSliceMapper)
        ps = mapper.dst.model.page_size
        pages = np.asarray(dst_pages, dtype=np.int64)[
            space.dst_start : space.dst_start + space.npages
        ]
        a = space.alloc
        block = block_view(
            self._ring_mem, a.offset, (mapper.num_pairs, pages.size, ps, mapper.slice_bytes)
        )
        lo = mapper.dst_start * mapper.bytes_per_head
        self.kv.scatter(mapper.dst_buf, pages, lo, lo + mapper.slice_bytes, block)
        STAGED.inc()
        with self._lock:
            self._space.pop(key, None)
            return self.ring.free(a.id)

    def free_where(self, pred: Callable[[tuple[int, str, int]], bool]) -> bool:
        """Decode: free every allocation whose key ``(room, session, chunk)`` matches; True if
        the watermark moved."""
        assert self.ring is not None
        with self._lock:
            before = self.ring.watermark
            for key in [k for k in self._space if pred(k)]:
                self.ring.free(self._space.pop(key).alloc.id)
            return self.ring.watermark != before

    def release(self, room: int) -> None:
        """Decode, on clear: space a writer never confirmed is freed after release_timeout_s
        (a writer's release or eviction frees it sooner)."""
        if self.ring is None:
            with self._lock:
                for key in [k for k in self._asks if k[0] == room]:
                    del self._asks[key]
            return
        now = time.monotonic()
        with self._lock:
            for key, space in self._space.items():
                if key[0] == room and space.released_at is None:
                    space.released_at = now

    def expire(self, now: float) -> tuple[bool, list[tuple[int, str]]]:
        """Decode, control thread, for space of cleared requests still held: which writers to
        ask again (``WritesQuery``, every ``request_retry_s``), and — the last resort after
        ``release_timeout_s`` — free it. Returns (watermark moved, (room, writer) to query)."""
        limit, retry = self.opts.release_timeout_s, self.opts.request_retry_s
        stale, query = [], set()
        with self._lock:
            for k, sp in self._space.items():
                if sp.released_at is None:
                    continue
                if now - sp.released_at > limit:
                    stale.append(k)
                elif now - sp.queried_at > retry:
                    sp.queried_at = now
                    query.add((k[0], k[1]))
        if stale:
            logger.warning("bulk staging: freeing %d allocations never released", len(stale))
        return self.free_where(lambda k: k in stale), sorted(query)

    # ------------------------------------------------------------ prefill side
    def link_tables(
        self,
        mapper: IndexMapper,
        remote: dict[str, Any] | None,
        *,
        session: str = "",
        tables: TablePair | None = None,
    ) -> dict[str, Any]:
        if (
            not remote
            or remote.get("strategy") != "bulk"
            or not isinstance(mapper, HeadSliceMapper)
            or mapper.is_dummy
            or self._buffers is None
        ):
            return {}
        b = int(remote["block_bytes"])
        if b != self.opts.block_bytes:
            raise ConfigError(
                f"bulk staging block_bytes differ: prefill={self.opts.block_bytes} decode={b}"
            )
        local = self._regions[0]
        n_local = local.length // b
        n_remote = int(remote["ring_bytes"]) // b
        return {
            "staging": TablePair(
                src=make_table(
                    local.addr + np.arange(n_local, dtype=np.uint64) * np.uint64(b),
                    b,
                    local.device_id,
                ),
                dst=make_table(
                    int(remote["ring_addr"]) + np.arange(n_remote, dtype=np.uint64) * np.uint64(b),
                    b,
                    int(remote["device_id"]),
                ),
            )
        }

    def fits(self, mapper: IndexMapper, npages: int) -> bool:
        """Prefill, engine thread, before any allocation: can this chunk be staged? A chunk
        that cannot is counted and goes per token (or fails, without ``fallback_oversize``)."""
        n = block_bytes(mapper, npages)
        if n <= self.opts.buffer_bytes:
            return True
        if not self.opts.fallback_oversize:
            raise ConfigError(
                f"a chunk of {npages} pages needs {n} staging bytes, above buffer_bytes="
                f"{self.opts.buffer_bytes}; raise it, send smaller chunks, or allow "
                "fallback_oversize"
            )
        FALLBACKS.inc()
        return False

    def request(
        self, msg: StagingRequest, dest: str, endpoint: str, transfer_timeout_s: float
    ) -> None:
        """Prefill, engine thread: ask decode for ring space for one chunk.

        A request's chunks to one decode rank are asked for one at a time, in order: the next
        goes out when the previous is granted. Allocation order then follows write order, so
        a chunk never waits for ring space held by a later chunk of its own request (that
        would deadlock once the ring wraps)."""
        now = time.monotonic()
        key = (msg.room, dest, msg.chunk_id)
        with self._lock:
            self._views.setdefault(dest, WatermarkView())
            earlier = any(
                k[0] == msg.room and k[1] == dest and a.grant is None for k, a in self._asks.items()
            )
            self._asks[key] = _Ask(msg, endpoint, 0.0 if earlier else now, now + transfer_timeout_s)
        if not earlier:
            self.send_fn(endpoint, msg)

    def _next_unsent(self, room: int, dest: str) -> _Ask | None:
        """Under the lock: the first not-yet-sent request of (room, dest), marked sent."""
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

    def on_control(self, msg: Any) -> None:
        """Prefill, control thread: a decode rank answered or moved its watermark."""
        if not isinstance(msg, StagingGrant | StagingDeny | StagingWatermark):
            return
        with self._lock:
            view = self._views.setdefault(msg.session, WatermarkView())
            if isinstance(msg, StagingWatermark):
                view.update((msg.round, msg.tail))
                return
            ask = self._asks.get((msg.room, msg.session, msg.chunk_id))
            if ask is None:
                return  # late or duplicate answer
            if isinstance(msg, StagingDeny):
                ask.denied = msg.reason
                return
            view.update((msg.wm_round, msg.wm_tail))
            if ask.grant is not None:
                return  # a duplicate grant
            ask.grant = Allocation(msg.alloc_id, msg.round, msg.offset, msg.end)
            nxt = self._next_unsent(msg.room, msg.session)
        if nxt is not None:
            self.send_fn(nxt.endpoint, nxt.msg)

    def plan(
        self,
        room: int,
        chunk_id: int,
        mapper: IndexMapper,
        src_pages: Any,
        dst_pages: Any,
        *,
        dest: str = "",
        worker: int = 0,
    ) -> ChunkPlan | None:
        key = (room, dest, chunk_id)
        with self._lock:
            ask = self._asks.get(key)
        if ask is None:  # not staged (equal TP, MLA, or an oversize fallback)
            src_idx, dst_idx = mapper.map_chunk(src_pages, dst_pages)
            return ChunkPlan(table="kv", src_idx=src_idx, dst_idx=dst_idx)
        if ask.denied is not None:
            raise TransferError(f"decode refused staging space: {ask.denied}", room=room)
        now = time.monotonic()
        if ask.grant is None:
            if now > ask.deadline:
                raise TransferError(
                    f"no staging grant for chunk {chunk_id} within the transfer timeout",
                    room=room,
                    peer=dest,
                )
            if ask.sent and now - ask.sent > self.opts.request_retry_s:
                ask.sent = now
                self.send_fn(ask.endpoint, ask.msg)
            return None
        with self._lock:
            if not self._views[dest].ready(ask.grant) or not self._free[worker]:
                return None
            slot = self._free[worker].pop()
        assert self.kv is not None and isinstance(mapper, HeadSliceMapper)
        o = self.opts
        pages = np.asarray(src_pages, dtype=np.int64)
        ps = mapper.src.model.page_size
        n = block_bytes(mapper, pages.size)
        start = (worker * o.buffers_per_worker + slot) * o.buffer_bytes
        out = block_view(
            self._buffers, start, (mapper.num_pairs, pages.size, ps, mapper.slice_bytes)
        )
        lo = mapper.src_start * mapper.bytes_per_head
        try:
            self.kv.gather(mapper.src_buf, pages, lo, lo + mapper.slice_bytes, out)
        except BaseException:
            with self._lock:
                self._free[worker].append(slot)
            raise
        b = o.block_bytes
        nblocks = -(-n // b)
        src_idx = start // b + np.arange(nblocks, dtype=np.int64)
        dst_idx = ask.grant.offset // b + np.arange(nblocks, dtype=np.int64)
        return ChunkPlan("staging", src_idx, dst_idx, token=(worker, slot, key), what="staged")

    def on_sent(self, room: int, plan: ChunkPlan, ok: bool) -> None:
        """Prefill: the staged write ended; its buffer may be reused."""
        if plan.token is None:
            return
        worker, slot, key = plan.token
        with self._lock:
            self._free[worker].append(slot)
            self._asks.pop(key, None)

    def on_queued(self, chunk: QueuedChunk) -> None:
        """Prefill, engine thread: ask decode for ring space for a queued chunk now (unless
        the chunk is too big to stage)."""
        if not self.fits(chunk.mapper, chunk.npages):
            return
        msg = StagingRequest(
            room=chunk.room,
            sender_id=chunk.sender_id,
            session=chunk.session,
            chunk_id=chunk.chunk_id,
            nbytes=block_bytes(chunk.mapper, chunk.npages),
            dst_start=chunk.dst_start,
            npages=chunk.npages,
        )
        self.request(msg, chunk.dest, chunk.endpoint, chunk.timeout_s)

    def on_abandoned(
        self, room: int, dest: str, endpoint: str, sender_id: int, session: str
    ) -> None:
        """Prefill, worker: see :meth:`abandon`."""
        self.abandon(room, dest, endpoint, sender_id, session)

    def abandon(self, room: int, dest: str, endpoint: str, sender_id: int, session: str) -> None:
        """Prefill, worker: nothing more will be written for ``room`` to ``dest``: forget its
        requests and let decode free the space (duplicates are harmless)."""
        with self._lock:
            for key in [k for k in self._asks if k[0] == room and k[1] == dest]:
                del self._asks[key]
        self.send_fn(endpoint, WritesDone(room=room, sender_id=sender_id, session=session))

    def peer_lost(self, session: str) -> None:
        """A peer was evicted: prefill forgets its requests and watermark; decode frees the
        ring space the dead writer held."""
        if self.ring is not None:
            self.free_where(lambda k: k[1] == session)
            return
        with self._lock:
            self._views.pop(session, None)
            for key in [k for k in self._asks if k[1] == session]:
                del self._asks[key]

    def room_tables(self) -> dict[str, int]:
        with self._lock:
            if self.ring is not None:
                return {"staging_allocations": len(self._space)}
            return {"staging_requests": len(self._asks)}
