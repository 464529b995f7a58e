"""The Triton kernels of the pool-to-pool page mover
(:class:`kvwire.movers.triton_pool_pages.PoolPageCopier`, whose module says what they copy):
one chunk's copy (``_copy_pool_pages``), several chunks of one shape in one launch
(``_copy_pool_batch``), a copy with the checksums of what it sends (``_copy_pool_pages_summed``)
and pieces per token and head (``_copy_pool_heads``). Imported only where they run (a CUDA
device, or Triton's interpreter on the CPU with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvwire.integrity_kernels import sum_program

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
) -> None:
    # table: int64 [2 * npages + 2 * nbuf] = source pages, destination pages, each pair's
    # source address, each pair's destination address. Strides in elements, the piece's
    # length in vectors of vec elements.
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
    )


@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=[
        "table_addr",
        "nchunks",
        "max_pages",
        "max_bufs",
        "src_row",
        "dst_row",
        "n_vecs",
        "tokens",
    ]
)
def _copy_pool_batch(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    table_addr,
    nchunks,
    max_pages,
    max_bufs,
    src_row,
    dst_row,
    n_vecs,
    tokens,
    block: tl.constexpr,
    elem: tl.constexpr,
    align: tl.constexpr,
    vec: tl.constexpr,
    shape: tl.constexpr,
) -> None:
    # Several chunks of one shape (PoolPageCopier.copy_batch), program (local, k) of a grid
    # (max_bufs * max_pages, nchunks): chunk k's (pair, page) local, if it has them. table:
    # int64, a header of 4 per chunk (pages, pairs, source slot, destination slot, slots in
    # elements), then a section of 2 * max_pages + 2 * max_bufs per chunk laid out as
    # _copy_pool_pages' table (entries past the chunk's own counts are unused). Every load
    # of a program is independent of the others (one round trip to the pinned table).
    table = table_addr.to(tl.pointer_type(tl.int64))
    k = tl.program_id(1).to(tl.int64)
    local = tl.program_id(0).to(tl.int64)
    b = local // max_pages
    i = local - b * max_pages
    head = table + 4 * k
    sec = table + 4 * nchunks + k * (2 * max_pages + 2 * max_bufs)
    npages = tl.load(head)
    nbuf = tl.load(head + 1)
    src_slot = tl.load(head + 2)
    dst_slot = tl.load(head + 3)
    sp = tl.load(sec + i)
    dp = tl.load(sec + max_pages + i)
    sa = tl.load(sec + 2 * max_pages + b)
    da = tl.load(sec + 2 * max_pages + max_bufs + b)
    if (i < npages) & (b < nbuf):
        _copy_pieces(
            sa, sp, src_slot, da, dp, dst_slot, src_row, dst_row, n_vecs, tokens, block, elem,
            align, vec, shape,
        )  # fmt: skip


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
):
    # Program pid of _copy_pool_pages (table as an int64 pointer), also run by
    # _copy_pool_pages_summed for its first nbuf * npages programs.
    b = pid // npages
    i = pid - b * npages
    sp = tl.load(table + i)
    dp = tl.load(table + npages + i)
    sa = tl.load(table + 2 * npages + b)
    da = tl.load(table + 2 * npages + nbuf + b)
    _copy_pieces(
        sa, sp, src_slot, da, dp, dst_slot, src_row, dst_row, n_vecs, tokens, block, elem,
        align, vec, shape,
    )  # fmt: skip


@triton.jit  # type: ignore[untyped-decorator]
def _copy_pieces(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    sa,
    sp,
    src_slot,
    da,
    dp,
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
):
    # One (pair, page): tokens pieces from page sp of the pair's source address sa (slots
    # src_slot elements apart; piece t at t * src_row) to page dp at da. The page's pointers
    # are made here: an alignment hint on a function's argument would be dropped.
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
            block, elem, align, vec, shape,
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
