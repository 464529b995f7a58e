"""The CPU reference of the pool-to-pool page mover (:mod:`kvwire.movers.triton_pool_pages`):
the byte runs a chunk in page form (:class:`kvwire.page_form.PageChunk`) copies, given the
addresses of each buffer pair's piece 0 of slot 0 on both sides, and the copy itself.
NumPy only (vectorised); the oracle of the kernel's CPU tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.movers.plan import copy_runs_reference
from kvwire.page_form import PageChunk

I64 = NDArray[np.int64]


def pool_page_runs(chunk: PageChunk, src_addrs: I64, dst_addrs: I64) -> tuple[I64, I64, I64]:
    """``(src, dst, nbytes)`` of every piece the chunk moves, in its rows' order (pair,
    page, piece): piece ``t`` of page ``i`` of pair ``b`` is ``n`` bytes from
    ``src_addrs[b] + src_pages[i] * src_slot + t * src_row`` to
    ``dst_addrs[b] + dst_pages[i] * dst_slot + t * dst_row``."""
    g = chunk.geometry
    t = np.arange(g.tokens, dtype=np.int64)[None, None, :]
    src = (
        np.asarray(src_addrs, dtype=np.int64)[:, None, None]
        + chunk.src_pages[None, :, None] * g.src_slot
        + t * g.src_row
    ).ravel()
    dst = (
        np.asarray(dst_addrs, dtype=np.int64)[:, None, None]
        + chunk.dst_pages[None, :, None] * g.dst_slot
        + t * g.dst_row
    ).ravel()
    return src, dst, np.full(src.size, g.n, dtype=np.int64)


def copy_pool_pages_reference(memory: Any, chunk: PageChunk, src_addrs: I64, dst_addrs: I64) -> int:
    """Copy a chunk in page form inside ``memory`` (a 1-D ``uint8`` array; addresses are
    byte offsets into it), vectorised; returns the bytes copied."""
    return copy_runs_reference(memory, *pool_page_runs(chunk, src_addrs, dst_addrs))
