"""``direct``: no staging; a chunk moves straight between KV pools via the mapper's tables."""

from __future__ import annotations

from typing import Any

from kvwire.index.base import IndexMapper
from kvwire.staging.base import ChunkPlan, StagingStrategy


class DirectStaging(StagingStrategy):
    """Moves KV rows in place; nothing to gather, scatter or free."""

    name = "direct"

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
    ) -> ChunkPlan:
        return ChunkPlan.direct(mapper, src_pages, dst_pages)
