"""Layer-wise posting, an object each prefill worker's
:class:`~kvwire.session.prefill.pipeline.Pipeline` composes: a layer-wise chunk
(:mod:`kvwire.session.layers`) is posted group by group as the engine marks its layers
computed. Runs on the worker thread that owns the pipeline; no lock of its own.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvwire.session.layers import LayeredChunk
from kvwire.session.prefill.posting import ChunkPoster, PlanRef, SegmentPost, Tail
from kvwire.session.prefill.rooms import Job
from kvwire.staging.base import ChunkPlan


class LayerPosting:
    """Posts layer-wise chunks group by group for the pipeline that composes it (one per
    :class:`~kvwire.session.prefill.pipeline.Pipeline`, on its worker thread; no lock).

    ``poster`` is that pipeline (its whole-chunk primitives, :class:`ChunkPoster`);
    ``worker`` its index (strategies keep staging space per worker); ``timeout_s`` how long a
    layer may stay uncomputed before the request fails."""

    def __init__(self, poster: ChunkPoster, worker: int, timeout_s: float) -> None:
        self.poster = poster
        self.worker = worker
        self.timeout_s = timeout_s

    def post(self, tail: Tail, job: Job, t_start: float) -> bool:
        """A layer-wise chunk: post each layer group whose layers are computed (and whose
        events completed); True once the whole chunk is posted. A strategy that stages, or a
        plan that cannot be cut by layer, moves the chunk whole once every layer is ready."""
        gate = job.gate
        assert gate is not None
        ready = self.gate_ready(job)
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
                plan = self.poster.plan(job)
                if plan is None:
                    return False
                if plan.empty:
                    return True
                lay = tail.layered = self._layered(job, plan, gate.edges)
        if lay.groups is None:
            if ready < gate.end:
                return False
            tail.layered = None
            self.poster.post_plan(tail, job, lay.plan, t_start)
            return True
        for segs, first, layers in lay.due(ready):
            self.poster.post_segments(
                SegmentPost(
                    tail, job, lay.ref, lay.plan.what, segs, lay.parts, first, t_start, layers
                )
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
        lp = strategy.plan_layers(job.plan_request(self.worker, edges))
        if lp is None:
            return None
        ref = PlanRef(strategy, lp.plan, job.room.room, open=True)
        groups = [
            self.poster.segments(job, ChunkPlan(lp.plan.table, s, d, what=lp.plan.what))
            if s.size
            else []
            for s, d in lp.rows
        ]
        return LayeredChunk(lp.plan, ref, edges, groups, fill=lp.fill)

    def gate_ready(self, job: Job) -> int:
        """The first layer of a layer-wise job not computed yet (raises past the deadline)."""
        assert job.gate is not None
        return job.gate.ready_by(self.timeout_s, job.room.room)

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
            self.poster.segments(job, ChunkPlan(plan.table, s, d, what=plan.what)) if s.size else []
            for s, d in cut
        ]
        return LayeredChunk(plan, ref, edges, groups)
