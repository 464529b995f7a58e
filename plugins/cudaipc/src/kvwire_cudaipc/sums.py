"""The checksums of a ``cudaipc`` page write, summed in the write's own launch.

Prefill's first note of a checksummed chunk waits for the chunk's sums
(:attr:`kvwire.transfers.LaterNote.sums`, a :class:`kvwire.integrity_orders.SumsOrder`).
``cudaipc`` declares ``summed_writes``: a page write on a pair that is VRAM in every row takes
the order into the page mover's launch (:meth:`PoolPageCopier.copy_pages
<kvwire.movers.triton_pool_pages.PoolPageCopier.copy_pages>` with ``sums``: copy and sum
programs alternating in one launch, one event), so the worker pays one launch per chunk
instead of two. Sums on another GPU, a chunk the summed kernel does not take, or a write
of rows start the sums as a launch of their own beside the write, as a backend without
``summed_writes`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.movers.triton_pool_pages import PoolPageCopier
from kvwire.page_form import PageChunk
from kvwire.transfers import WriteSums

__all__ = ["page_enqueue"]


def page_enqueue(
    pages: PoolPageCopier,
    chunk: PageChunk,
    src: NDArray[np.int64],
    dst: NDArray[np.int64],
    stream: Any,
    sums: WriteSums | None,
) -> Callable[[], None]:
    """Prefill's transfer worker, submitting a page write: the enqueue of its copy (to run
    under the peer's lock) with the chunk's ``sums`` taken into the launch where they fit,
    else started now on their own. If the launch never happens the caller abandons ``sums``
    (:meth:`WriteSums.abandon`; a no-op once launched)."""
    fused = sums.take() if sums is not None and sums.device == pages.device else None
    if fused is not None and not pages.sums_fit(chunk, fused):
        assert sums is not None
        sums.abandon()
        fused = None
    if fused is None:
        if sums is not None:
            sums.start()
        return lambda: pages.copy_pages(chunk, src, dst, stream=stream)

    def enqueue() -> None:
        assert sums is not None
        pages.copy_pages(chunk, src, dst, stream=stream, sums=fused)
        sums.launched(stream)

    return enqueue
