"""``bulk``: stage a chunk through one contiguous write per (source rank, destination rank).

Without staging, a head-sliced (Tp != Td, MHA/GQA) chunk is one descriptor per (layer, K/V,
page, token), and an equal-TP chunk one per (layer, K/V, page). With ``bulk``, for every
(prefill rank, decode rank, chunk):

1. prefill asks decode for ring space (an ``ask``, sent when the engine calls ``send()``,
   retried until granted, so a lost message costs a retry);
2. decode allocates it in its staging ring without waiting
   (:class:`~kvwire.staging.ring.RingAllocator`; duplicates get the same allocation) and answers
   with the allocation and its ring watermark (a ``grant``; a ``deny`` names why not);
3. a prefill worker waits until the watermark says the allocation's bytes are free, gathers the
   chunk's head slices from every layer into one of its private staging buffers (torch, on the
   pool's device, synchronised), and writes the block with a handful of large descriptors;
4. decode scatters the block into its KV pages when the notification arrives (after the data),
   frees the ring space and, when the watermark moved, broadcasts it to its writers (and again
   every ``watermark_every_s``, so a lost broadcast only delays).

The messages (:mod:`kvwire.staging.bulk_wire`) travel in core's generic ``staging`` envelope:
core routes them to this strategy and knows nothing of them. Every path frees ring space:
arrival, a writer's confirmation that its writes for a failed request ended
(:meth:`~kvwire.staging.base.StagingStrategy.writes_ended`), a writer's eviction, or — the last
resort — ``release_timeout_s`` after decode cleared the request. A chunk longer than one
staging buffer holds is cut into chunks that fit (:meth:`BulkStaging.chunk_pages`, before
it is queued), staged one after another, so a large request overlaps one chunk's gather with
the previous chunk's write and scatter; only a chunk of which not one page fits a buffer (or
a layer-wise chunk too big for one) takes the per-token path, chosen before any allocation and
counted (``kvwire_staging_fallbacks_total``). ``--staging auto`` (the default) picks bulk
staging where the KV pool is in GPU memory (:attr:`BulkStaging.auto_memory`), with the sizes of
:data:`GPU_SIZES` unless set. What a link stages is its mapper's
:meth:`~kvwire.index.base.IndexMapper.staged_slice`: head slices (heterogeneous TP; a
``head_rows`` link's head-major side is gathered in token order and scattered into the
destination's page order, :class:`~kvwire.staging.kernels.KVTensors`), or whole rows for
equal TP and MLA (the whole latent row; a dummy sender never stages), staged by the rule of
:meth:`BulkStaging.stages_whole_pages` (GPU pools, or the per-link rule's ``"staged"`` advice,
with descriptors under ``equal_tp_below_bytes``, chunks of at least
``equal_tp_min_chunk_bytes``; host pools keep the per-page path). Where prefill and decode
pages differ in size, a block is cut into granules (:func:`~kvwire.staging.bulk_ring.unit_tokens`)
gathered in token order and scattered into decode's pages of the other size. Dummies and
links that split K and V into planes move by descriptors; :meth:`BulkStaging.decide` says why,
per link, in the startup log. On GPU pools the gather and the scatter are one fused mover
launch per chunk (:mod:`kvwire.movers`).

The decode half lives in :mod:`kvwire.staging.bulk_ring`, the prefill half in
:mod:`kvwire.staging.bulk_writer`; this class picks one by role and forwards the seam's hooks.
The only backend-specific part is memory registration, through ``register_fn``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvwire.control.wire import StagingMessage
from kvwire.errors import ConfigError
from kvwire.index.base import IndexMapper, TablePair
from kvwire.movers.warmup import Warmer
from kvwire.regions import MemKind
from kvwire.staging.base import (
    ArrivedChunk,
    ChunkPlan,
    LayerPlan,
    LinkStaging,
    PlanRequest,
    QueuedChunk,
    StagingContext,
    StagingStrategy,
)
from kvwire.staging.bulk_ring import (
    RingSide,
    block_bytes,
    chunk_limit,
    slice_of,
    staged,
    unit_tokens,
)
from kvwire.staging.bulk_wire import WIRE_VERSION, BulkMessage, RingInfo
from kvwire.staging.bulk_writer import WriterSide, chunk_units
from kvwire.staging.kernels import KVTensors
from kvwire.staging.pool_views import layout_views
from kvwire.staging.spans import Spans, order_for, tails_for

logger = logging.getLogger(__name__)

__all__ = ["FALLBACKS", "BulkOptions", "BulkStaging", "block_bytes"]

MiB = 1 << 20

FALLBACKS = Counter(
    "kvwire_staging_fallbacks", "Chunks sent per token because they exceed staging sizes"
)


#: Bulk staging's sizes on GPU pools, where the options leave them unset: a chunk of up to
#: 128 MiB per (prefill rank, decode rank) in 8 MiB blocks, through a 1 GiB ring on
#: decode; prefill holds ``buffers_per_worker`` buffers per transfer worker (1 GiB with NIXL's
#: four workers). Smaller buffers cost speed (a chunk is a grant, a gather, a write and a
#: scatter: 32 MiB moved a third of 128 MiB's bytes per second on 4 x H200). (The defaults of
#: :class:`BulkOptions` are the host pools'.) docs/staging.md gives the memory and the
#: measured speed of each choice.
GPU_SIZES: dict[str, int] = {
    "block_bytes": 8 * MiB,
    "buffer_bytes": 128 * MiB,
    "ring_bytes": 1024 * MiB,
}


class BulkOptions(BaseModel):
    """Sizes and timings of bulk staging (``--staging-option key=value``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ring_bytes: int = Field(
        default=64 * MiB, gt=0, description="Decode staging ring size (GPU pools: 1 GiB)."
    )
    block_bytes: int = Field(
        default=64 * 1024,
        gt=0,
        description="Ring and buffer granularity; a chunk's blocks go as spans of 2**k "
        "blocks, one descriptor each (GPU pools: 8 MiB).",
    )
    buffer_bytes: int = Field(
        default=16 * MiB,
        gt=0,
        description="One prefill staging buffer: the largest staged chunk; a longer chunk is "
        "cut into chunks of this size (GPU pools: 128 MiB).",
    )
    buffers_per_worker: int = Field(default=2, ge=1, le=64)
    request_retry_s: float = Field(default=0.2, gt=0, description="Resend an unanswered request.")
    release_timeout_s: float = Field(
        default=90.0,
        gt=0,
        description="Decode frees a cleared request's ring space after this even if a writer "
        "never confirmed (a dead writer is evicted sooner).",
    )
    watermark_every_s: float = Field(
        default=1.0, gt=0, description="Decode re-broadcasts its ring watermark this often."
    )
    equal_tp: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Stage whole-row links (equal TP, MLA, page-size conversion with equal "
        "TP): 'auto' does where it is faster -- prefill's KV pool and decode's ring both in "
        "GPU memory (or the per-link rule advised 'staged') and one descriptor (a page of one "
        "buffer, or a granule) below equal_tp_below_bytes; 'always' also on host pools "
        "(tests); 'never' keeps every whole-row link per descriptor.",
    )
    equal_tp_below_bytes: int = Field(
        default=1 << 20,
        gt=0,
        description="'auto' stages equal-TP links whose per-page descriptors are smaller.",
    )
    equal_tp_min_chunk_bytes: int = Field(
        default=8 << 20,
        ge=0,
        description="'auto' sends an equal-TP chunk smaller than this per page (a staged "
        "chunk pays a grant round trip, a gather and a scatter: slower for small chunks).",
    )
    offer_ahead: bool = Field(
        default=True,
        description="Decode offers ring space for a request's whole chunk with its transfer "
        "request, so a sender that sends it in one chunk needs no ask/grant round trip.",
    )
    fallback_oversize: bool = Field(
        default=True,
        description="Send a chunk too big to stage per token (counted) instead of failing it.",
    )

    def for_memory(self, on_device: bool) -> BulkOptions:
        """Setup, on both sides: these options with the sizes of :data:`GPU_SIZES` where the
        pool is in GPU memory and the operator did not set them (a GPU link pays ~6 us per
        descriptor, so a chunk goes in few large blocks; host pools keep the small sizes)."""
        if not on_device:
            return self
        unset = {k: v for k, v in GPU_SIZES.items() if k not in self.model_fields_set}
        if not unset:
            return self
        given = self.model_dump(include=self.model_fields_set)
        return BulkOptions.model_validate({**unset, **given})

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


def descriptor_bytes(mapper: IndexMapper) -> int:
    """Bytes of one descriptor of a whole-row link moved in place: a page of one buffer, or
    one granule of token rows where the link converts page sizes."""
    if mapper.paging is not None:
        return unit_tokens(mapper) * mapper.src.token_row_bytes
    return mapper.src.page_bytes


class BulkStaging(StagingStrategy):
    """Bulk staging (heterogeneous TP, and equal TP on GPUs); see the module docstring.
    Decode managers hold a :class:`~kvwire.staging.bulk_ring.RingSide` (``ring``), prefill
    managers a :class:`~kvwire.staging.bulk_writer.WriterSide` (``writer``)."""

    name = "bulk"
    options_model = BulkOptions
    auto_memory = frozenset({MemKind.VRAM})

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self.opts: BulkOptions = self.options  # type: ignore[assignment]
        self.ring: RingSide | None = None
        self.writer: WriterSide | None = None
        #: Compiles each link's gather (prefill) or scatter (decode) at its handshake.
        self._warmer = Warmer("staging")

    # ------------------------------------------------------------------ setup
    def setup(self, context: StagingContext) -> None:
        super().setup(context)
        tensors = context.kv_tensors
        if tensors is None:  # the engine passed none: views of the layout's own buffers
            tensors = layout_views(context.layout)
        kv = KVTensors(context.layout, tensors)
        o = self.opts = self.opts.for_memory(kv.on_device)
        if context.role == "decode":
            self.ring = RingSide(
                context,
                kv,
                o.ring_bytes,
                o.block_bytes,
                o.request_retry_s,
                o.release_timeout_s,
                o.watermark_every_s,
                self._post,
            )
            region = self.ring.region
        else:
            self.writer = WriterSide(
                context,
                kv,
                o.buffer_bytes,
                o.buffers_per_worker,
                o.block_bytes,
                o.request_retry_s,
                self._post,
                o.release_timeout_s,
            )
            region = self.writer.region
        context.register_fn([region])
        context.publish_fn()
        if kv.moves is not None:  # ahead of any link: one to a rank of this layout (whole rows)
            role = "scatter" if context.role == "decode" else "gather"
            bufs = np.arange(len(context.layout.buffers), dtype=np.int64)
            self._warmer.submit(
                f"bulk staging's {role} for ranks of this layout",
                lambda: kv.warm(bufs, 0, kv.row, kv.page_size, to_pool=role == "scatter"),
            )

    def _post(self, endpoint: str, msg: BulkMessage) -> bool:
        assert self.context is not None
        return self.context.post(endpoint, self.name, msg.type, msg)

    def close(self) -> None:
        side = self.ring or self.writer
        if self.context is not None and side is not None:
            try:
                self.context.deregister_fn([side.region])
            except Exception as exc:  # the backend may be closed already
                logger.debug("bulk staging: deregister: %s", exc)
        self.ring = self.writer = None
        self._warmer.close()
        super().close()

    # -------------------------------------------------------------- handshake
    def describe(self) -> dict[str, Any] | None:
        if self.ring is None:
            return None
        r = self.ring.region
        return {
            "strategy": "bulk",
            "wire": WIRE_VERSION,
            "ring_addr": r.addr,
            "ring_bytes": r.length,
            "block_bytes": self.opts.block_bytes,
            "device_id": r.device_id,
            "kind": int(r.kind),
            # this ring scatters page-size conversion (granule units) and MLA blocks; a
            # decode without the key refuses such links, so prefill keeps them unstaged
            "units": True,
        }

    def link_tables(
        self,
        mapper: IndexMapper,
        remote: dict[str, Any] | None,
        *,
        session: str = "",
        tables: TablePair | None = None,
    ) -> dict[str, Any]:
        return self.link_staging(mapper, remote, session=session, tables=tables).tables

    def link_staging(
        self,
        mapper: IndexMapper,
        remote: dict[str, Any] | None,
        advice: str = "configured",
        *,
        session: str = "",
        tables: TablePair | None = None,
    ) -> LinkStaging:
        """Prefill, at handshake: the staging table pair of a link that stages, and why it
        does or does not (see :meth:`decide`)."""
        staged, why = self.decide(mapper, remote, advice)
        if not staged or self.writer is None or not remote:
            return LinkStaging({}, why)
        if remote.get("wire") != WIRE_VERSION:
            raise ConfigError(
                f"bulk staging messages differ (prefill speaks version {WIRE_VERSION}, decode "
                f"{remote.get('wire', 1)}); run the same kvwire version on both sides"
            )
        try:
            ring = RingInfo.model_validate(remote)
        except ValidationError as exc:
            raise ConfigError(f"decode's bulk staging ring is malformed: {exc}") from exc
        b = ring.block_bytes
        if b != self.opts.block_bytes:  # e.g. one side's pool on a GPU, the other's on host
            return LinkStaging(
                {},
                f"per descriptor: staging block sizes differ (prefill {self.opts.block_bytes} B, "
                f"decode {b} B; set block_bytes alike on both sides to stage this link)",
            )
        local = self.writer.region
        # rows of 2**k blocks up to a full buffer: a chunk is one or a few descriptors
        order, tails = order_for(self.opts.buffer_bytes // b), tails_for(b)
        src = Spans(local.length // b, order, tails)
        dst = Spans(ring.ring_bytes // b, order, tails)
        pair = TablePair(
            src=src.table(local.addr, b, local.device_id),
            dst=dst.table(ring.ring_addr, b, ring.device_id),
        )
        self.writer.link_spans(session, src, dst)
        self._warm(self.writer.kv, mapper, session, to_pool=False)
        return LinkStaging({"staging": pair}, why)

    def _warm(self, kv: KVTensors, mapper: IndexMapper, peer: str, *, to_pool: bool) -> None:
        """Handshake, either side: compile the link's gather (scatter, ``to_pool``) on the
        warm-up thread, so its first staged chunk does not wait for Triton's compile (host
        pools and pools without fused moves compile nothing: no thread is started)."""
        if kv.moves is None:
            return
        sl, unit = staged(mapper), unit_tokens(mapper)
        bufs, lo = (mapper.dst_buf, sl.dst_lo) if to_pool else (mapper.src_buf, sl.src_lo)
        what = f"bulk staging's {'scatter' if to_pool else 'gather'} for {peer}"
        self._warmer.submit(what, lambda: kv.warm(bufs, lo, lo + sl.nbytes, unit, to_pool=to_pool))

    def decide(
        self, mapper: IndexMapper, remote: dict[str, Any] | None, advice: str = "configured"
    ) -> tuple[bool, str]:
        """Prefill, at handshake: does this link go through the ring, and why (one phrase for
        the startup log and ``kvwire doctor``). ``advice`` is the per-link rule's
        (:func:`kvwire.link_choice.choose_link_path`): ``"direct"`` (the link's backend
        writes decode's pages itself, e.g. ``cudaipc``, head slices and whole rows alike in
        page form) keeps every link unstaged (staging head slices through the ring over
        ``cudaipc`` measured 3-6x slower than page form at 128 MiB C=8, docs/benchmarks.md);
        ``"staged"`` (GPU pools without a same-host path) stages whole-row links under
        ``equal_tp="auto"`` as a GPU link would be (:meth:`stages_whole_pages`). Head slices
        (heterogeneous TP) stage whatever the pools; whole rows (equal TP, MLA, page-size
        conversion with equal TP) by the rule; a link whose mapper has no staged slice (a
        dummy, K|V planes) moves by descriptors."""
        if self.writer is None:
            return False, "bulk staging: decode ranks do not send"
        if not remote or remote.get("strategy") != "bulk":
            return False, "per descriptor: decode has no bulk staging ring (--staging bulk there)"
        sl = mapper.staged_slice()
        if sl is None:
            return False, f"per descriptor: {mapper.unstaged_reason()}"
        what = "head slices" if not sl.whole_rows else f"whole rows ({mapper.name})"
        if mapper.paging is not None:
            p = mapper.paging
            what += f", pages {p.src_page} -> {p.dst_page} tokens by {p.granule}-token units"
        if (mapper.paging is not None or mapper.src.model.is_mla) and not remote.get("units"):
            old = "decode's kvwire predates staged page-size conversion and MLA"
            return False, f"per descriptor: {what} ({old})"
        if advice == "direct":  # cudaipc: head slices and whole rows in page form
            return False, "per descriptor: the link's backend writes decode's pages (advice)"
        if not sl.whole_rows:
            return True, f"staged: {what}"
        if self.stages_whole_pages(mapper, remote, advice):
            return True, f"staged: {what} ({self._rule_words(advice)})"
        return False, f"per descriptor: {what} ({self._rule_words(advice)})"

    def _rule_words(self, advice: str) -> str:
        mode = self.opts.equal_tp
        if mode != "auto":
            return f"equal_tp={mode}"
        src = "the link rule's advice" if advice == "staged" else "pool kinds"
        return (
            f"equal_tp=auto by {src}: GPU pools, descriptors under "
            f"{self.opts.equal_tp_below_bytes} B, chunks of >= "
            f"{self.opts.equal_tp_min_chunk_bytes} B"
        )

    def stages_whole_pages(
        self, mapper: IndexMapper, remote: dict[str, Any], advice: str = "configured"
    ) -> bool:
        """Prefill, at handshake: does a whole-row link (equal TP, MLA, page-size conversion
        with equal TP) go through the ring? The rule (``equal_tp="auto"``): where
        per-descriptor costs dominate -- this rank's KV pool and decode's ring in GPU memory
        (or the per-link rule advised ``"staged"``, which it does for GPU pools on both
        sides; a GPU link posts one copy per descriptor, ~6 us each over UCX cuda_ipc) and
        one descriptor of the mapper (a page of one buffer, or a granule where page sizes
        differ) smaller than ``equal_tp_below_bytes`` (1 MiB) -- and never for host pools,
        where a descriptor is cheap and gather + scatter would only add copies."""
        mode = self.opts.equal_tp
        if mode != "auto":
            return mode == "always"
        assert self.writer is not None
        gpu = self.writer.kv.on_device and int(remote.get("kind", 0)) == int(MemKind.VRAM)
        gpu = gpu or advice == "staged"
        return gpu and descriptor_bytes(mapper) < self.opts.equal_tp_below_bytes

    def on_link(self, session: str, endpoint: str, mapper: IndexMapper) -> None:
        if self.ring is None:
            raise ConfigError("this decode rank has no staging ring (run --staging bulk here)")
        self.ring.on_link(session, endpoint, mapper)
        self._warm(self.ring.kv, mapper, session, to_pool=True)

    # ------------------------------------------------------------ per request
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

    def on_queued(self, chunk: QueuedChunk) -> None:
        if self.writer is not None and not self.small_whole_pages(
            chunk.mapper, chunk_units(chunk)[0]
        ):
            self.writer.on_queued(chunk, self.fits)

    def on_requested(self, room: int, npages: int, writers: Sequence[str]) -> None:
        """Decode, under the room lock: offer each staging writer of the request ring space
        for its first chunk, where this rank's options say the writer would stage it (the
        same rules prefill applies: :meth:`chunk_pages`, :meth:`fits` without counting, and
        :meth:`small_whole_pages`); a writer whose options differ just asks."""
        if self.ring is None or not self.opts.offer_ahead:
            return
        self.ring.offer(room, npages, writers, self._first_units)

    def _first_units(self, mapper: IndexMapper, npages: int) -> int:
        """Decode: the units of a writer's chunk 0 of a request of ``npages`` destination
        pages (0: that chunk would not be staged). Prefill cuts a chunk longer than its buffer
        (:meth:`chunk_pages`); with equal page sizes its first chunk is then the buffer's
        worth of pages."""
        units = npages
        limit = chunk_limit(mapper, self.opts.buffer_bytes)
        if mapper.paging is None and limit is not None:
            units = min(npages, limit)
        n = block_bytes(mapper, units)
        staged = n <= self.opts.buffer_bytes and not self.small_whole_pages(mapper, units)
        return units if staged else 0

    def chunk_pages(self, mapper: IndexMapper) -> int | None:
        """Prefill, engine thread, per chunk of a staged link: a chunk longer than one staging
        buffer holds is cut into chunks of that many pages
        (:func:`~kvwire.staging.bulk_ring.chunk_limit`), each staged on its own, instead of
        moving per descriptor."""
        if self.writer is None or slice_of(mapper) is None:
            return None
        return chunk_limit(mapper, self.opts.buffer_bytes)

    def small_whole_pages(self, mapper: IndexMapper, npages: int) -> bool:
        """Prefill, engine thread: a whole-row chunk of ``npages`` units (of a link that
        stages: equal TP, MLA, page-size conversion) too small to
        gain from staging under ``equal_tp="auto"`` (below ``equal_tp_min_chunk_bytes``);
        it moves per page (no ask is sent, so the worker's plan is the mapper's rows)."""
        sl = slice_of(mapper)
        return (
            sl is not None
            and sl.whole_rows
            and self.opts.equal_tp == "auto"
            and block_bytes(mapper, npages) < self.opts.equal_tp_min_chunk_bytes
        )

    def on_message(self, peer_endpoint: str, msg: StagingMessage) -> None:
        side = self.ring or self.writer
        if side is not None:
            side.on_message(peer_endpoint, msg)

    def plan(self, req: PlanRequest) -> ChunkPlan | None:
        if self.writer is None:
            return ChunkPlan.direct(req.mapper, req.src_pages, req.dst_pages)
        return self.writer.plan(
            req.room, req.chunk_id, req.mapper, req.src_pages, req.dst_pages, req.dest, req.worker
        )

    stages_layers = True

    def plan_layers(self, req: PlanRequest) -> LayerPlan | None:
        if self.writer is None:
            raise ConfigError("plan_layers is called on the sending side only")
        return self.writer.plan_layers(
            req.room,
            req.chunk_id,
            req.mapper,
            req.src_pages,
            req.dst_pages,
            req.edges,
            req.dest,
            req.worker,
        )

    def on_sent(self, room: int, plan: ChunkPlan, ok: bool) -> None:
        if self.writer is not None:
            self.writer.on_sent(plan)

    def on_abandoned(
        self, room: int, dest: str, endpoint: str, sender_id: int, session: str
    ) -> None:
        if self.writer is not None:
            self.writer.abandon(room, dest, endpoint, sender_id, session)

    def on_arrival(self, chunk: ArrivedChunk) -> None:
        if chunk.what != "staged":
            return
        if self.ring is None:
            super().on_arrival(chunk)  # refuses it, naming the strategy
            return
        self.ring.on_arrival(chunk)

    def writes_ended(self, room: int, session: str) -> None:
        if self.ring is not None:
            self.ring.writes_ended(room, session)

    def release(self, room: int) -> None:
        side = self.ring or self.writer
        if side is not None:
            side.release(room)

    def tick(self, now: float) -> None:
        if self.ring is not None:
            self.ring.tick(now)
        elif self.writer is not None:
            self.writer.tick(now)

    def peer_lost(self, session: str) -> None:
        side = self.ring or self.writer
        if side is not None:
            side.peer_lost(session)

    def memory(self) -> str | None:
        side = self.ring or self.writer
        if side is None:
            return None
        r = side.region
        what = "decode's staging ring" if self.ring is not None else "prefill's staging buffers"
        where = f"cuda:{r.device_id}" if r.kind == MemKind.VRAM else "host memory"
        size = "ring_bytes" if self.ring is not None else "buffer_bytes x buffers_per_worker"
        return f"{what}: {r.length >> 20} MiB in {where} ({size})"

    def room_tables(self) -> dict[str, int]:
        side = self.ring or self.writer
        return side.room_tables() if side is not None else {}
