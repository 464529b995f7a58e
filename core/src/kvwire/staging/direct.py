"""``direct``: no staging; a chunk moves straight between KV pools via the mapper's tables."""

from __future__ import annotations

from kvwire.staging.base import ChunkPlan, PlanRequest, StagingStrategy


class DirectStaging(StagingStrategy):
    """Moves KV rows in place; nothing to gather, scatter or free."""

    name = "direct"

    def plan(self, req: PlanRequest) -> ChunkPlan:
        return ChunkPlan.direct(req.mapper, req.src_pages, req.dst_pages)
