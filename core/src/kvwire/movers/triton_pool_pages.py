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
(the tiling of :mod:`kvwire.movers.triton_heads`), again one program per (pair, page). The NumPy
reference is :func:`kvwire.movers.pool_pages.copy_pool_pages_reference`. Imported only where
it runs (a CUDA device, or Triton's interpreter on the CPU with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import triton
import triton.language as tl
from numpy.typing import NDArray

from kvwire.integrity_kernels import sum_program
from kvwire.integrity_orders import FusedSums
from kvwire.movers.triton_copy import _ELEM, _ELEM_BYTES
from kvwire.movers.triton_heads import tile_shape
from kvwire.movers.triton_pages import PageCopier, kernel_key, page_width
from kvwire.page_form import PageChunk

__all__ = ["PoolPageCopier"]

#: The kernel's compile-time shapes of a call (see ``_copy_pool_pages``); HEADS: the tiled
#: kernel of pieces per token and head (``_copy_pool_heads``).
PIECES, WHOLE, ONE_BLOCK, HEADS = 0, 1, 2, 3


@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=[
        "table_addr",
        "npages",
        "nbuf",
        "src_slot",
        "dst_slot",
        "src_row",
        "dst_row",
        "n_vecs",
        "tokens",
    ]
)
def _copy_pool_pages(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    table_addr,
    npages,
    nbuf,
    src_slot,
    dst_slot,
    src_row,
    dst_row,
    n_vecs,
    tokens,
    block: tl.constexpr,
    elem: tl.constexpr,
    align: tl.constexpr,
    vec: tl.constexpr,
    shape: tl.constexpr,
    batch: tl.constexpr,
) -> None:
    # table: int64 [2 * npages + 2 * nbuf] = source pages, destination pages, each pair's
    # source address, each pair's destination address. Strides in elements, the piece's
    # length in vectors of vec elements. batch (PoolPageCopier.copy_batch: several chunks of
    # one shape): int64 [2 * npages] = each program's source address, then its destination
    # address, a page's offset included (npages: the programs; nbuf and the slots unused).
    _copy_program(
        table_addr.to(tl.pointer_type(tl.int64)),
        tl.program_id(0).to(tl.int64),
        npages,
        nbuf,
        src_slot,
        dst_slot,
        src_row,
        dst_row,
        n_vecs,
        tokens,
        block,
        elem,
        align,
        vec,
        shape,
        batch,
    )


@triton.jit  # type: ignore[untyped-decorator]
def _copy_program(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    table,
    pid,
    npages,
    nbuf,
    src_slot,
    dst_slot,
    src_row,
    dst_row,
    n_vecs,
    tokens,
    block: tl.constexpr,
    elem: tl.constexpr,
    align: tl.constexpr,
    vec: tl.constexpr,
    shape: tl.constexpr,
    batch: tl.constexpr,
):
    # Program pid of _copy_pool_pages (table as an int64 pointer), also run by
    # _copy_pool_pages_summed for its first nbuf * npages programs.
    if batch:
        src0 = tl.load(table + pid).to(tl.pointer_type(elem))
        dst0 = tl.load(table + npages + pid).to(tl.pointer_type(elem))
    else:
        b = pid // npages
        i = pid - b * npages
        sp = tl.load(table + i)
        dp = tl.load(table + npages + i)
        sa = tl.load(table + 2 * npages + b)
        da = tl.load(table + 2 * npages + nbuf + b)
        src0 = sa.to(tl.pointer_type(elem)) + sp * src_slot
        dst0 = da.to(tl.pointer_type(elem)) + dp * dst_slot
    # n counted in vectors: the compiler then knows n divides by vec, so a masked access
    # stays a vector (16 bytes); a hint on an argument would be dropped (scalar accesses)
    n = n_vecs * vec
    offs = tl.arange(0, block)
    # shape (compile-time): WHOLE (one piece per page) and ONE_BLOCK (every piece fits one
    # block) copy in one flat loop, which the compiler pipelines (several loads in flight
    # per program: what the peer's latency needs); PIECES nests the two loops.
    if shape == 1:  # WHOLE
        src = tl.multiple_of(src0, align)
        dst = tl.multiple_of(dst0, align)
        for start in range(0, n, block):
            o = start + offs
            mask = o < n
            tl.store(dst + o, tl.load(src + o, mask=mask), mask=mask)
    elif shape == 2:  # ONE_BLOCK
        mask = offs < n
        for t in range(0, tokens):
            src = tl.multiple_of(src0 + t * src_row, align)
            dst = tl.multiple_of(dst0 + t * dst_row, align)
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
    else:
        for t in range(0, tokens):
            src = tl.multiple_of(src0 + t * src_row, align)
            dst = tl.multiple_of(dst0 + t * dst_row, align)
            for start in range(0, n, block):
                o = start + offs
                mask = o < n
                tl.store(dst + o, tl.load(src + o, mask=mask), mask=mask)


@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=[
        "table_addr",
        "npages",
        "nbuf",
        "src_slot",
        "dst_slot",
        "src_row",
        "dst_row",
        "n_vecs",
        "tokens",
        "pairs_addr",
        "consts_addr",
        "out_addr",
        "result_addr",
        "sum_pairs",
        "sum_tokens",
        "cells",
        "read_slot",
        "read_row",
        "key_slot",
        "key_row",
        "num_layers",
        "lo",
        "hi",
    ]
)
def _copy_pool_pages_summed(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    table_addr,
    npages,
    nbuf,
    src_slot,
    dst_slot,
    src_row,
    dst_row,
    n_vecs,
    tokens,
    pairs_addr,
    consts_addr,
    out_addr,
    result_addr,
    sum_pairs,
    sum_tokens,
    cells,
    read_slot,
    read_row,
    key_slot,
    key_row,
    num_layers,
    lo,
    hi,
    block: tl.constexpr,
    elem: tl.constexpr,
    align: tl.constexpr,
    vec: tl.constexpr,
    shape: tl.constexpr,
    sum_block: tl.constexpr,
    inline_weights: tl.constexpr,
    mode: tl.constexpr,
    order: tl.constexpr,
) -> None:
    # _copy_pool_pages (not batched) and, in the same launch, the checksums of what it
    # sends: nbuf * npages copy programs as _copy_pool_pages' and sum_pairs * npages
    # programs of hash_pages (kvwire.integrity_kernels), whose page lists follow the copy's
    # table (read pages, then key pages) and whose other arguments are hash_pages' (pairs:
    # int64 [3, sum_pairs] on the device; the sums land in result once every summing program
    # ended). order (PoolPageCopier.SUM_ORDERS): the two kinds alternate in program order
    # (copy, sum, copy, ...; the larger kind's rest at the end), or every copy first, or
    # every sum first (the GPU starts programs roughly in order).
    table = table_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    copies = nbuf * npages
    sums = sum_pairs * npages
    if order == 1:  # alternate
        both = tl.minimum(copies, sums)
        if pid < 2 * both:
            idx = pid // 2
            is_copy = pid % 2 == 0
        else:
            idx = pid - both
            is_copy = copies > sums
    elif order == 2:  # sums first
        is_copy = pid >= sums
        idx = tl.where(is_copy, pid - sums, pid)
    else:  # copies first
        is_copy = pid < copies
        idx = tl.where(is_copy, pid, pid - copies)
    if is_copy:
        _copy_program(
            table, idx, npages, nbuf, src_slot, dst_slot, src_row, dst_row, n_vecs, tokens,
            block, elem, align, vec, shape, False,
        )  # fmt: skip
    else:
        sum_program(
            pairs_addr.to(tl.pointer_type(tl.int64)),
            sum_pairs,
            table + 2 * npages + 2 * nbuf,
            consts_addr,
            out_addr,
            result_addr,
            idx,
            npages,
            sum_tokens,
            cells,
            read_slot,
            read_row,
            key_slot,
            key_row,
            num_layers,
            lo,
            hi,
            sum_block,
            inline_weights,
            mode,
        )


@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=[
        "table_addr",
        "npages",
        "nbuf",
        "src_slot",
        "dst_slot",
        "src_tok",
        "dst_tok",
        "src_head",
        "dst_head",
        "n_vecs",
        "tokens",
        "heads",
    ]
)
def _copy_pool_heads(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    table_addr,
    npages,
    nbuf,
    src_slot,
    dst_slot,
    src_tok,
    dst_tok,
    src_head,
    dst_head,
    n_vecs,
    tokens,
    heads,
    rows: tl.constexpr,
    cols: tl.constexpr,
    elem: tl.constexpr,
    align: tl.constexpr,
    vec: tl.constexpr,
    t_inner: tl.constexpr,
) -> None:
    # Pieces of one head of one token (head-major pages on a side): the table as above; the
    # slots in elements, the token and head strides and the piece's length in vectors (so
    # every row of a tile starts on a vector: accesses stay 16 bytes wide). A program copies
    # its page's tokens x heads pieces as 2-D tiles [rows, cols]; a tile row is (part of)
    # one piece, contiguous on both sides. Consecutive tile rows are consecutive tokens of a
    # head (t_inner) or consecutive heads of a token: the caller picks the order whose
    # destination rows are closer (the stores go over the link).
    table = table_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    b = pid // npages
    i = pid - b * npages
    sp = tl.load(table + i)
    dp = tl.load(table + npages + i)
    sa = tl.load(table + 2 * npages + b)
    da = tl.load(table + 2 * npages + nbuf + b)
    src0 = tl.multiple_of(sa.to(tl.pointer_type(elem)) + sp * src_slot, align)
    dst0 = tl.multiple_of(da.to(tl.pointer_type(elem)) + dp * dst_slot, align)
    n = n_vecs * vec
    count = tokens * heads
    r = tl.arange(0, rows)
    c = tl.arange(0, cols)
    for r0 in range(0, count, rows):
        q = r0 + r
        if t_inner:
            h = (q // tokens).to(tl.int64)
            t = q.to(tl.int64) - h * tokens
        else:
            t = (q // heads).to(tl.int64)
            h = q.to(tl.int64) - t * heads
        s_row = t * (src_tok * vec) + h * (src_head * vec)
        d_row = t * (dst_tok * vec) + h * (dst_head * vec)
        ok = q < count
        for c0 in range(0, n, cols):
            o = c0 + c
            mask = ok[:, None] & (o < n)[None, :]
            val = tl.load(src0 + s_row[:, None] + o[None, :], mask=mask)
            tl.store(dst0 + d_row[:, None] + o[None, :], val, mask=mask)


class PoolPageCopier(PageCopier):
    """Copies chunks in page form between two pools with one launch per call (the
    launching device must be able to store to the destination: its own memory, or a peer
    GPU's opened through CUDA IPC with peer access enabled). Thread contract: as
    :class:`~kvwire.movers.triton_pages.PageCopier` (launches serialised by its lock)."""

    #: The compile-time shape of the last call (tests, diagnostics).
    last_shape: int = -1
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
        fits = g.n // eb <= key[0]  # every piece within one block of elements
        shape = WHOLE if g.tokens == 1 else (ONE_BLOCK if fits else PIECES)
        self.last_shape = shape
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
        ckey = (*key[:4], shape, False)
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
        the piece's length and the pieces per page go in one launch of the batch kernel,
        whose table holds each program's two addresses (a (pair, page) of some chunk);
        a head-major chunk, or a lone chunk of its shape, launches as :meth:`copy_pages` does.
        Returns the launches. Same thread contract as :meth:`copy_pages`."""
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
            s = (np.asarray(sa, np.int64)[:, None] + chunk.src_pages[None, :] * g.src_slot).ravel()
            d = (np.asarray(da, np.int64)[:, None] + chunk.dst_pages[None, :] * g.dst_slot).ravel()
            width = page_width(np.concatenate([s, d]), 0, g.src_row, g.dst_row, g.n)
            key, eb = kernel_key(width, g.n, False)
            fits = g.n // eb <= key[0]
            shape = WHOLE if g.tokens == 1 else (ONE_BLOCK if fits else PIECES)
            strides = (g.src_row // eb, g.dst_row // eb, g.n // width, g.tokens)
            groups.setdefault((*key[:4], shape, *strides), []).append((chunk, sa, da, s, d))
        for gk, parts in groups.items():
            if len(parts) == 1:
                chunk, sa, da, _, _ = parts[0]
                self.copy_pages(chunk, sa, da, stream=stream)
            else:
                s = np.concatenate([p[3] for p in parts])
                d = np.concatenate([p[4] for p in parts])
                self.last_shape = gk[4]
                src_row, dst_row, n_vecs, tokens = gk[5:]
                scalars = (s.size, 0, 0, 0, src_row, dst_row, n_vecs, tokens)
                self._launch(
                    _copy_pool_pages, "pool", (*gk[:5], True), s, d, scalars, stream,
                    grid=s.size,
                )  # fmt: skip
            launches += 1
        return launches

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
