"""Prefill, engine thread: one chunk the engine sent, as the jobs of one destination.

:meth:`~kvwire.session.prefill.side.PrefillSide.send` hands a chunk of request pages to every
destination of the room; :func:`dest_jobs` maps it through the destination's link (its
mapper's :meth:`~kvwire.index.base.IndexMapper.chunk_slice`), numbers the chunks that carry
KV, tells a staging strategy of each staged chunk
(:meth:`~kvwire.staging.base.StagingStrategy.on_queued`: bulk staging asks for ring space
there) and returns the jobs for the destination's worker.

Where the link's staging strategy bounds a chunk
(:meth:`~kvwire.staging.base.StagingStrategy.chunk_pages`: bulk staging's buffer), a longer
chunk becomes several jobs of at most that many prefill pages, in page order, exactly as if the
engine had sent them one call each: the destination counts chunks, never engine calls, and only
the last job carries ``last``. Without the cut, a chunk larger than the staging buffer moved
per descriptor; with it, a large request is staged chunk by chunk, one chunk's gather
overlapping the transfer of the one before and the scatter on decode.

Called under the prefill side's room lock; touches the destination's chunk counter
(``Dest.next_chunk``), which only this engine-thread path advances.
"""

from __future__ import annotations

import time

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import KVWireError, TransferError
from kvwire.session.context import RankContext
from kvwire.session.layers import LayerGate
from kvwire.session.prefill.links import DecodeLink
from kvwire.session.prefill.rooms import Dest, Job, SendRoom
from kvwire.staging.base import QueuedChunk

__all__ = ["dest_jobs"]


def dest_jobs(
    ctx: RankContext,
    room: SendRoom,
    dest: Dest,
    link: DecodeLink,
    pages: NDArray[np.int64],
    start: int,
    last: bool,
    gate: LayerGate | None,
    sender_id: int,
) -> list[Job]:
    """Engine thread, under the room lock: the jobs of one destination for the request pages
    ``pages`` (positions ``[start, start + pages.size)`` of the request). Raises
    :class:`~kvwire.errors.TransferError` when the chunk cannot be mapped, or the
    :class:`~kvwire.errors.KVWireError` of a staging strategy that refuses it (the caller
    fails the request with it)."""
    assert room.num_pages is not None
    target = link.pools[dest.pool]
    cut = pages.size
    if target.staged and gate is None and not link.dummy:
        limit = target.strategy.chunk_pages(target.mapper)
        if limit is not None:
            cut = max(1, limit)
    bounds = list(range(0, pages.size, cut)) if pages.size else [0]
    jobs: list[Job] = []
    for i in bounds:
        j = min(i + cut, pages.size)
        try:
            src, lo, hi = target.mapper.chunk_slice(
                room.num_pages, dest.dst_pages, pages[i:j], start + i, start + j,
                dest.cached_tokens,
            )  # fmt: skip
        except KVWireError as exc:
            raise TransferError(str(exc), room=room.room) from exc
        chunk_id = None
        if src.size and not link.dummy:
            chunk_id = dest.next_chunk
            dest.next_chunk += 1
            if target.staged:
                target.strategy.on_queued(
                    QueuedChunk(
                        room.room,
                        chunk_id,
                        target.mapper,
                        int(src.size),
                        lo,
                        dest.session,
                        dest.endpoint,
                        sender_id,
                        ctx.session,
                        ctx.options.transfer_timeout_s,
                        src,
                    )
                )
        jobs.append(
            Job(
                room,
                dest,
                link,
                src,
                dest.dst_pages[lo:hi],
                chunk_id,
                last and j == pages.size,
                time.perf_counter(),
                pool=dest.pool,
                gate=gate,
                span=(start + i, start + j),
            )
        )
    return jobs
