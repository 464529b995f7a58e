"""The pool-to-pool page mover: one Triton launch copies a chunk in page form
(:class:`kvwire.page_form.PageChunk`) from one pool's pages straight into another's -- the
``cudaipc`` backend's write into decode's pages mapped through CUDA IPC -- with every address
computed on the device from the two page lists and each buffer pair's two addresses.

The run mover (:class:`kvwire.movers.triton_copy.RunCopier`) takes one ``(src, dst, bytes)``
per run, planned by the host from rows (4,098 per 128 MiB chunk of whole pages, 131k for
head slices); this one takes ``2 * pages + 2 * pairs`` numbers, written into a pinned slot
the kernel reads (:meth:`kvwire.movers.triton_pages.PageCopier._launch`), so a call's host
work does not grow with the chunk.

One program per (buffer pair, page): it copies ``tokens`` pieces of ``n`` bytes, piece ``t``
from ``src[b] + src_page[i] * src_slot + t * src_row`` to
``dst[b] + dst_page[i] * dst_slot + t * dst_row`` (whole pages: one piece of a page's bytes,
compiled as one flat loop; head slices: a slice of every token row, possibly at another
offset and row pitch on the other side), in steps of :data:`~kvwire.movers.plan.BLOCK_BYTES`
with the widest element that divides every address, stride and length (16 bytes: vector
loads and stores). A geometry of one piece per token and head (head-major pages on a side:
:attr:`PageGeometry.heads <kvwire.page_form.PageGeometry.heads>` > 1) launches a second
kernel, ``_copy_pool_heads``, which copies a page's ``tokens x heads`` pieces as 2-D tiles
(the tiling of :mod:`kvwire.movers.triton_heads`), again one program per (pair, page). The
kernels are in :mod:`kvwire.movers.triton_pool_kernels`. The NumPy reference is
:func:`kvwire.movers.pool_pages.copy_pool_pages_reference`. Imported only where it runs (a
CUDA device, or Triton's interpreter on the CPU with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.integrity_orders import FusedSums
from kvwire.movers.triton_copy import _ELEM, _ELEM_BYTES
from kvwire.movers.triton_heads import tile_shape
from kvwire.movers.triton_pages import PageCopier, kernel_key, page_width
from kvwire.movers.triton_pool_kernels import (
    HEADS,
    ONE_BLOCK,
    PIECES,
    WHOLE,
    _copy_pool_batch,
    _copy_pool_heads,
    _copy_pool_pages,
    _copy_pool_pages_summed,
)
from kvwire.page_form import PageChunk, PageGeometry

__all__ = ["HEADS", "ONE_BLOCK", "PIECES", "WHOLE", "PoolPageCopier"]


class PoolPageCopier(PageCopier):
    """Copies chunks in page form between two pools with one launch per call (the
    launching device must be able to store to the destination: its own memory, or a peer
    GPU's opened through CUDA IPC with peer access enabled). Thread contract: as
    :class:`~kvwire.movers.triton_pages.PageCopier` (launches serialised by its lock)."""

    #: The compile-time shape of the last call (tests, diagnostics).
    last_shape: int = -1

    def __init__(self, device: Any, num_warps: int = 4, *, slots: int = 16) -> None:
        super().__init__(device, num_warps, slots=slots)
        #: Each geometry's batch group key and element size, with the pair addresses they
        #: were made for (:meth:`copy_batch`: a link's chunks come with the same arrays).
        self._groups: weakref.WeakKeyDictionary[PageGeometry, tuple[Any, ...]] = (
            weakref.WeakKeyDictionary()
        )

    #: Piece order of the head kernel: "auto" (consecutive pieces nearest on the destination),
    #: "t" (tokens of a head) or "h" (heads of a token); benchmarks set it to compare.
    heads_order: str = "auto"
    #: The summed kernel's tile of checksum cells (at most the sums' own) and where its sum
    #: programs go among the copy's (a key of SUM_ORDERS); benchmarks set them.
    sum_block: int = 1024
    sum_order: str = "alternate"
    SUM_ORDERS = {"after": 0, "alternate": 1, "before": 2}

    def copy_pages(
        self,
        chunk: PageChunk,
        src_addrs: NDArray[np.int64],
        dst_addrs: NDArray[np.int64],
        *,
        stream: Any = None,
        sums: FusedSums | None = None,
    ) -> None:
        """Enqueue the copy of ``chunk`` (pages checked by the caller) where pair ``b``'s
        piece 0 of slot 0 is at ``src_addrs[b]`` and ``dst_addrs[b]``; with ``sums`` (as
        many pages, :meth:`sums_fit`), the checksums of what it copies in the same launch
        (``_copy_pool_pages_summed``). Never waits for the GPU unless every table slot is
        still in flight; the caller synchronises ``stream``."""
        g = chunk.geometry
        npages, nbuf = int(chunk.src_pages.size), int(src_addrs.size)
        if not npages or not nbuf:
            return
        addrs = np.concatenate([src_addrs, dst_addrs]).astype(np.int64)
        if sums is not None and not self.sums_fit(chunk, sums):
            raise ValueError("these sums cannot be launched with this chunk's copy")
        if g.heads > 1:
            self._copy_heads(chunk, addrs, npages, nbuf, stream)
            return
        width = page_width(addrs, 0, g.src_slot, g.dst_slot, g.src_row, g.dst_row, g.n)
        key, eb = kernel_key(width, g.n, False)
        scalars: tuple[int, ...] = (
            npages,
            nbuf,
            g.src_slot // eb,
            g.dst_slot // eb,
            g.src_row // eb,
            g.dst_row // eb,
            g.n // width,
            g.tokens,
        )
        index = np.concatenate([chunk.src_pages, chunk.dst_pages])
        shape = self.last_shape = _shape(g, key, eb)
        if sums is not None:  # the sums' page lists follow the copy's table
            addrs = np.concatenate([addrs, sums.read_pages, sums.key_pages])
            tile = min(sums.block, self.sum_block)
            mix = self.SUM_ORDERS[self.sum_order]
            skey = (*key[:4], shape, tile, sums.inline_weights, sums.mode, mix)
            grid = (nbuf + sums.num_pairs) * npages
            scalars = (*scalars, *sums.scalars())
            self._launch(
                _copy_pool_pages_summed, "pool_summed", skey, index, addrs, scalars, stream, grid
            )
            return
        ckey = (*key[:4], shape)
        self._launch(
            _copy_pool_pages, "pool", ckey, index, addrs, scalars, stream, grid=nbuf * npages
        )

    @staticmethod
    def sums_fit(chunk: PageChunk, sums: FusedSums) -> bool:
        """Whether :meth:`copy_pages` can sum ``sums`` in ``chunk``'s launch: pages of one
        piece per token (not head-major) and as many pages on both. A writer's submitting
        thread (``cudaipc``), after taking the sums and before it launches."""
        return chunk.geometry.heads == 1 and sums.pages == int(chunk.src_pages.size)

    def copy_batch(
        self,
        items: Sequence[tuple[PageChunk, NDArray[np.int64], NDArray[np.int64]]],
        *,
        stream: Any = None,
    ) -> int:
        """Enqueue several chunks (each as :meth:`copy_pages` takes it) with as few launches
        as their shapes allow: chunks that share the compile-time shape, the row strides,
        the piece's length and the pieces per page go in one launch of the batch kernel
        (``_copy_pool_batch``), whose table holds each chunk's page lists and pair addresses
        as :meth:`copy_pages`' does; a head-major chunk, or a lone chunk of its shape,
        launches as :meth:`copy_pages` does. Returns the launches. Same thread contract as
        :meth:`copy_pages`.

        The host's work per chunk is a lookup of its geometry's group key (made once per
        geometry and pair addresses: their alignment, the kernel's compile-time key), never
        an array of every (pair, page): NumPy lets go of the GIL for
        arrays of 500 elements or more, and a worker that lets go of it waits, on a busy
        engine process, for the engine's thread to hand it back (docs/benchmarks.md,
        "Session 26")."""
        groups: dict[tuple[int, ...], list[tuple[Any, ...]]] = {}
        launches = 0
        for chunk, sa, da in items:
            g = chunk.geometry
            if not chunk.src_pages.size or not sa.size:
                continue
            if g.heads > 1:
                self.copy_pages(chunk, sa, da, stream=stream)
                launches += 1
                continue
            seen = self._groups.get(g)
            if seen is None or seen[0] is not sa or seen[1] is not da:
                sa64, da64 = np.asarray(sa, np.int64), np.asarray(da, np.int64)
                seen = self._groups[g] = (sa, da, sa64, da64, *_group_key(g, sa64, da64))
            _, _, sa64, da64, gk, eb = seen
            groups.setdefault(gk, []).append((chunk, sa64, da64, eb))
        for gk, parts in groups.items():
            for batch in _batches(parts):
                if len(batch) == 1:
                    chunk, sa, da, _ = batch[0]
                    self.copy_pages(chunk, sa, da, stream=stream)
                else:
                    self.last_shape = gk[4]
                    self._launch_batch(gk, batch, stream)
                launches += 1
        return launches

    def _launch_batch(self, gk: tuple[int, ...], parts: list[tuple[Any, ...]], stream: Any) -> None:
        """One launch of ``_copy_pool_batch`` over chunks of one group key (``parts``: each
        chunk, its pair addresses and element size). Under :meth:`copy_batch`."""
        k = len(parts)
        pmax = max(int(p[0].src_pages.size) for p in parts)
        bmax = max(int(p[1].size) for p in parts)
        sec = 2 * pmax + 2 * bmax
        head: list[int] = []
        pieces: list[tuple[int, NDArray[np.int64]]] = []
        for j, (chunk, sa, da, eb) in enumerate(parts):
            g = chunk.geometry
            head += [int(chunk.src_pages.size), int(sa.size), g.src_slot // eb, g.dst_slot // eb]
            o = 4 * k + j * sec
            pieces += [(o, chunk.src_pages), (o + pmax, chunk.dst_pages)]
            pieces += [(o + 2 * pmax, sa), (o + 2 * pmax + bmax, da)]
        pieces.insert(0, (0, np.array(head, np.int64)))
        src_row, dst_row, n_vecs, tokens = gk[5:]
        scalars = (k, pmax, bmax, src_row, dst_row, n_vecs, tokens)
        self._launch_table(
            _copy_pool_batch, "pool_batch", gk[:5], 4 * k + k * sec, pieces, scalars, stream,
            (bmax * pmax, k),
        )  # fmt: skip

    def warm(
        self, g: PageGeometry, src_addrs: NDArray[np.int64], dst_addrs: NDArray[np.int64]
    ) -> int:
        """Compile, without launching anything, the kernel variants that chunks of geometry
        ``g`` between pair addresses ``src_addrs`` and ``dst_addrs`` launch: a batch of
        chunks (:meth:`copy_batch`) and a chunk alone (:meth:`copy_pages`; not the summed
        variant, which depends on the sums), so no write waits for a compile. Returns how
        many it compiled (0: every one was already, or no GPU). A link's warm-up thread,
        once its geometry is known (``cudaipc``'s lane); see :meth:`compiling`."""
        one = np.zeros(1, np.int64)
        chunk = PageChunk(g, one, one, checked=True)
        with self.compiling() as done:
            self.copy_batch([(chunk, src_addrs, dst_addrs), (chunk, src_addrs, dst_addrs)])
            self.copy_pages(chunk, src_addrs, dst_addrs)
        return len(done)

    def _copy_heads(
        self, chunk: PageChunk, addrs: NDArray[np.int64], npages: int, nbuf: int, stream: Any
    ) -> None:
        """:meth:`copy_pages` of a geometry of several pieces per token (head-major pages on
        a side): one launch of the tiled kernel."""
        g = chunk.geometry
        width = page_width(
            addrs, 0, g.src_slot, g.dst_slot, g.src_row, g.dst_row, g.src_head, g.dst_head, g.n
        )
        eb = _ELEM_BYTES[width]
        vec = width // eb
        rows, cols = tile_shape(g.n // eb, g.pieces, eb, vec, 32 * self.num_warps)
        scalars = (
            npages,
            nbuf,
            g.src_slot // eb,
            g.dst_slot // eb,
            g.src_row // width,
            g.dst_row // width,
            g.src_head // width,
            g.dst_head // width,
            g.n // width,
            g.tokens,
            g.heads,
        )
        self.last_shape = HEADS
        index = np.concatenate([chunk.src_pages, chunk.dst_pages])
        order = self.heads_order
        t_inner = abs(g.dst_row) <= abs(g.dst_head) if order == "auto" else order == "t"
        key = (rows, cols, _ELEM[width], width, vec, t_inner)
        self._launch(
            _copy_pool_heads, "pool_heads", key, index, addrs, scalars, stream, grid=nbuf * npages
        )


def _group_key(
    g: PageGeometry, sa: NDArray[np.int64], da: NDArray[np.int64]
) -> tuple[tuple[int, ...], int]:
    """The batch group key of chunks of geometry ``g`` between pair addresses ``sa`` and
    ``da`` (the compile-time key, shape and strides: chunks that share it go in one launch)
    and the element size its lengths are counted in."""
    width = min(
        page_width(sa, 0, g.src_slot, g.src_row, g.n),
        page_width(da, 0, g.dst_slot, g.dst_row, g.n),
    )
    key, eb = kernel_key(width, g.n, False)
    strides = (g.src_row // eb, g.dst_row // eb, g.n // width, g.tokens)
    return (*key[:4], _shape(g, key, eb), *strides), eb


def _shape(g: PageGeometry, key: tuple[Any, ...], eb: int) -> int:
    """The compile-time shape of a copy of ``g``'s pieces (one piece per token) with the
    block of ``key`` (:func:`~kvwire.movers.triton_pages.kernel_key`) in ``eb``-byte
    elements: whole pages, pieces each within one block, or pieces over several."""
    if g.tokens == 1:
        return WHOLE
    return ONE_BLOCK if g.n // eb <= key[0] else PIECES


#: Most chunks in one batch launch (the launch grid's second dimension is at most 65,535).
MAX_BATCH_CHUNKS = 4096


def _batches(parts: list[tuple[Any, ...]]) -> list[list[tuple[Any, ...]]]:
    """Chunks of one group key cut into launches of :func:`_copy_pool_batch`'s grid: by
    page count, a chunk joins the launch before it while the grid's programs (chunks x the
    most pages x the most pairs) stay within twice the programs the chunks need, so a launch
    of one large and many small chunks does not start mostly idle programs; at most
    :data:`MAX_BATCH_CHUNKS` chunks a launch."""
    out: list[list[tuple[Any, ...]]] = []
    cur: list[tuple[Any, ...]] = []
    need = pmax = bmax = 0
    for part in sorted(parts, key=lambda p: int(p[0].src_pages.size)):
        pages, pairs = int(part[0].src_pages.size), int(part[1].size)
        grid = (len(cur) + 1) * max(pmax, pages) * max(bmax, pairs)
        if cur and (grid > 2 * (need + pages * pairs) or len(cur) >= MAX_BATCH_CHUNKS):
            out.append(cur)
            cur, need, pmax, bmax = [], 0, 0, 0
        cur.append(part)
        need += pages * pairs
        pmax, bmax = max(pmax, pages), max(bmax, pairs)
    if cur:
        out.append(cur)
    return out
