"""The layer-wise half of a prefill worker's :class:`~kvwire.session.pipeline.Pipeline`:
posting a layer-wise chunk (:mod:`kvwire.session.layers`) group by group as the engine marks
its layers computed, and the completion record of a chunk plan (:class:`PlanRef`) that both
halves share. Runs on the worker thread that owns the pipeline; no lock of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from kvwire.session.layers import LayeredChunk
from kvwire.staging.base import ChunkPlan, Segment, StagingStrategy

if TYPE_CHECKING:
    from kvwire.session.context import RankContext
    from kvwire.session.pipeline import _Tail
    from kvwire.session.prefill_rooms import Job


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


class LayerwisePosting(ABC):
    """Layer-wise posting for :class:`~kvwire.session.pipeline.Pipeline` (a mixin: the
    pipeline provides the whole-chunk primitives below)."""

    index: int
    ctx: RankContext

    @abstractmethod
    def _plan(self, job: Job) -> ChunkPlan | None:
        """The strategy's plan for a job's whole chunk (None: wait)."""

    @abstractmethod
    def _segments(self, job: Job, plan: ChunkPlan) -> list[Segment]:
        """A plan's rows as segments (split by memory kind)."""

    @abstractmethod
    def _post_plan(
        self,
        tail: _Tail,
        key: tuple[int, str],
        job: Job,
        strategy: StagingStrategy,
        plan: ChunkPlan,
        t_start: float,
    ) -> None:
        """Post a whole chunk's plan."""

    @abstractmethod
    def _post_segments(
        self,
        tail: _Tail,
        key: tuple[int, str],
        job: Job,
        ref: PlanRef,
        what: str,
        segs: list[Segment],
        parts: int,
        first_part: int,
        t_start: float,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Post some segments of a chunk of ``parts`` (those of layers ``[a, b)`` when
        ``layers`` is given: one layer-wise group)."""

    def _post_layers(self, tail: _Tail, key: tuple[int, str], job: Job, t_start: float) -> bool:
        """A layer-wise chunk: post each layer group whose layers are computed (and whose
        events completed); True once the whole chunk is posted. A strategy that stages, or a
        plan that cannot be cut by layer, moves the chunk whole once every layer is ready."""
        gate = job.gate
        assert gate is not None
        ready = self._gate_ready(job)
        lay = tail.layered
        if lay is None:
            strategy = job.target.strategy
            if job.target.staged and strategy.stages_layers:
                lay = self._staged_layers(job, gate.edges)
                if lay is None:
                    return False  # waiting for staging space
                tail.layered = lay
            else:
                if job.target.staged and ready < gate.end:
                    return False  # space is granted in write order: take it once computed
                plan = self._plan(job)
                if plan is None:
                    return False
                if plan.empty:
                    return True
                lay = tail.layered = self._layered(job, plan, gate.edges)
        if lay.groups is None:
            if ready < gate.end:
                return False
            tail.layered = None
            self._post_plan(tail, key, job, lay.ref.strategy, lay.plan, t_start)
            return True
        for segs, first, layers in lay.due(ready):
            self._post_segments(
                tail, key, job, lay.ref, lay.plan.what, segs, lay.parts, first, t_start, layers
            )
        if not lay.posted:
            return False
        tail.layered = None
        lay.ref.seal()
        return True

    def _staged_layers(self, job: Job, edges: NDArray[np.int64]) -> LayeredChunk[PlanRef] | None:
        """A staging strategy's layer-wise plan (its space taken now, each group staged when
        computed), or None while it waits for space."""
        assert job.chunk_id is not None
        strategy = job.target.strategy
        lp = strategy.plan_layers(
            job.room.room, job.chunk_id, job.target.mapper, job.src, job.dst, edges,
            dest=job.dest.session, worker=self.index,
        )  # fmt: skip
        if lp is None:
            return None
        ref = PlanRef(strategy, lp.plan, job.room.room, open=True)
        groups = [
            self._segments(job, ChunkPlan(lp.plan.table, s, d, what=lp.plan.what)) if s.size else []
            for s, d in lp.rows
        ]
        return LayeredChunk(lp.plan, ref, edges, groups, fill=lp.fill)

    def _gate_ready(self, job: Job) -> int:
        """The first layer of a layer-wise job not computed yet (raises past the deadline)."""
        assert job.gate is not None
        return job.gate.ready_by(self.ctx.options.transfer_timeout_s, job.room.room)

    def _layered(
        self, job: Job, plan: ChunkPlan, edges: NDArray[np.int64]
    ) -> LayeredChunk[PlanRef]:
        """Cut a chunk's plan into layer groups of segments (each group split by memory kind
        like a whole chunk), or keep it whole when the rows are not the mapper's own."""
        ref = PlanRef(job.target.strategy, plan, job.room.room, open=True)
        cut = None
        if plan.segments is None and plan.table == "kv":
            cut = job.target.mapper.split_layers(plan.src_idx, plan.dst_idx, edges)
        if cut is None:
            return LayeredChunk(plan, ref, edges, None)
        groups = [
            self._segments(job, ChunkPlan(plan.table, s, d, what=plan.what)) if s.size else []
            for s, d in cut
        ]
        return LayeredChunk(plan, ref, edges, groups)
