"""The CPU reference of the pool-to-pool page mover (:mod:`kvwire.movers.triton_pool_pages`):
the byte runs a chunk in page form (:class:`kvwire.page_form.PageChunk`) copies, given the
addresses of each buffer pair's piece 0 of slot 0 on both sides, and the copy itself.
NumPy only (vectorised); the oracle of the kernel's CPU tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.movers.plan import copy_runs_reference
from kvwire.page_form import PageChunk, affine_pieces

I64 = NDArray[np.int64]


def pool_page_runs(chunk: PageChunk, src_addrs: I64, dst_addrs: I64) -> tuple[I64, I64, I64]:
    """``(src, dst, nbytes)`` of every piece the chunk moves, in its rows' order (pair,
    page, piece): piece ``(t, h)`` of page ``i`` of pair ``b`` is ``n`` bytes from
    ``src_addrs[b] + src_pages[i] * src_slot + t * src_row + h * src_head`` to
    ``dst_addrs[b] + dst_pages[i] * dst_slot + t * dst_row + h * dst_head`` (``h`` below
    the geometry's ``heads``, 0 alone for one piece per token)."""
    g = chunk.geometry
    src = affine_pieces(
        src_addrs, chunk.src_pages, g.src_slot, g.tokens, g.src_row, g.heads, g.src_head
    )
    dst = affine_pieces(
        dst_addrs, chunk.dst_pages, g.dst_slot, g.tokens, g.dst_row, g.heads, g.dst_head
    )
    return src, dst, np.full(src.size, g.n, dtype=np.int64)


def copy_pool_pages_reference(memory: Any, chunk: PageChunk, src_addrs: I64, dst_addrs: I64) -> int:
    """Copy a chunk in page form inside ``memory`` (a 1-D ``uint8`` array; addresses are
    byte offsets into it), vectorised; returns the bytes copied."""
    return copy_runs_reference(memory, *pool_page_runs(chunk, src_addrs, dst_addrs))
