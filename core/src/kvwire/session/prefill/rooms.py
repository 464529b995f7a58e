"""Prefill's per-request records: a room (:class:`SendRoom`), its destinations
(:class:`Dest`, one per decode rank fed) and the chunk jobs queued for the transfer workers
(:class:`Job`). Plain data: :class:`~kvwire.session.prefill.side.PrefillSide` guards rooms and
destinations with the room lock; a job belongs to the one worker that took it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.session.layers import LayerGate
from kvwire.session.metrics import RequestMetrics
from kvwire.session.prefill.links import DecodeLink, PoolLink
from kvwire.staging.base import ChunkPlan, PlanRequest


@dataclass
class Dest:
    """One decode rank's part of a room."""

    session: str
    endpoint: str
    dst_pages: NDArray[np.int64]
    aux_index: int
    #: Decode ranks this prefill rank feeds for the request (it waits for all of them).
    fan_out: int
    next_chunk: int = 0
    done: bool = False
    #: The decode pool the request goes to (a key of ``DecodeLink.pools``).
    pool: str = "kv"
    #: The request's buffer-group slots on that decode rank (see :mod:`kvwire.session.groups`).
    group_dst: dict[str, NDArray[np.int64]] = field(default_factory=dict)
    #: Prompt tokens decode keeps cached, when it said (``TransferRequest.cached_tokens``).
    cached_tokens: int | None = None
    #: The worker queue key of the request's chunks to this rank, fixed at its first chunk
    #: (a destination's chunks must stay on one worker, in order).
    shard: str | None = None


@dataclass
class SendRoom:
    """State of one request on this prefill rank; removed on clear()."""

    room: int
    t0: float = field(default_factory=time.perf_counter)
    created: float = field(default_factory=time.monotonic)
    num_pages: int | None = None
    aux_index: int | None = None
    dests: dict[str, Dest] = field(default_factory=dict)
    expected: int | None = None
    #: Chunks the engine sent before every destination asked, as (pages, their first request
    #: page, last, layer gate): each destination that asks later gets them all, in order.
    held: list[tuple[NDArray[np.int64], int, bool, LayerGate | None]] = field(default_factory=list)
    #: The open layer-wise chunk (``send(..., layerwise=True)``) until every layer is marked.
    gate: LayerGate | None = None
    #: Synchronous mode: a layer-wise chunk waits here until every layer is marked.
    deferred: tuple[NDArray[np.int64], bool] | None = None
    #: Pages accepted from send() so far, and pages handed to workers so far.
    pages_queued: int = 0
    pages_dispatched: int = 0
    last_queued: bool = False
    #: Buffer groups: this rank's slots (given with the last chunk) and the pages sent so far.
    group_src: dict[str, NDArray[np.int64]] = field(default_factory=dict)
    sent_pages: list[NDArray[np.int64]] = field(default_factory=list)
    ready: bool = False
    error: BaseException | None = None
    failed_at: float = 0.0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    def send_problem(self, size: int, last: bool) -> str | None:
        """Engine thread, under the room lock (``send()``): why a chunk of ``size`` pages
        (the last one when ``last``) cannot be sent now, or None."""
        if self.num_pages is None or self.aux_index is None:
            return "send() before init(num_pages, aux_index)"
        if self.gate is not None:
            return (
                f"send() while the previous layer-wise chunk still misses "
                f"{self.gate.missing()} (mark them with layer_ready first)"
            )
        if self.last_queued:
            return "send() after the last chunk was sent"
        if self.pages_queued + size > self.num_pages:
            return (
                f"chunks add up to {self.pages_queued + size} pages but init() "
                f"declared {self.num_pages}"
            )
        if last and self.pages_queued + size != self.num_pages:
            return (
                f"last chunk ends at page {self.pages_queued + size} of the "
                f"{self.num_pages} declared by init(); KV would be missing on decode"
            )
        return None

    def pages_in(self, pool: str) -> None:
        """A prefill room holds no destination pages of this rank (see ``RoomState``)."""
        return None


@dataclass
class Job:
    """One chunk of one request for one destination, queued for that destination's worker."""

    room: SendRoom
    dest: Dest
    link: DecodeLink
    src: NDArray[np.int64]
    dst: NDArray[np.int64]
    chunk_id: int | None
    last: bool
    t_enqueued: float
    #: Decode pool the chunk goes to (a key of ``DecodeLink.pools``).
    pool: str = "kv"
    #: A layer-wise chunk's computed layers (None: every layer is computed).
    gate: LayerGate | None = None
    #: The chunk's request pages ``[start, end)`` (for decode to find its rows when it
    #: checks a checksum).
    span: tuple[int, int] = (0, 0)
    #: Checksums of layers posted with no row of their own yet (see
    #: ``Pipeline.post_segments``): carried by the chunk's next note.
    unsent_sums: dict[int, int] = field(default_factory=dict)
    #: The chunk's plan, made already by the worker's lean lane, which left the job to the
    #: general path (:mod:`kvwire.session.prefill.lane`); taken by the next ``plan``.
    planned: ChunkPlan | None = None

    @property
    def target(self) -> PoolLink:
        """The link's pool this job writes into (its mapper, table and strategy)."""
        return self.link.pools[self.pool]

    def plan_request(self, worker: int, edges: Any = None) -> PlanRequest:
        """Transfer worker ``worker``: what its pool's strategy is asked to plan for this
        job's chunk (``edges``: a layer-wise chunk's layer groups)."""
        assert self.chunk_id is not None
        target = self.target
        return PlanRequest(
            self.room.room,
            self.chunk_id,
            target.mapper,
            self.src,
            self.dst,
            dest=self.dest.session,
            worker=worker,
            edges=edges,
        )
