"""The Triton kernels of :mod:`kvwire.integrity_device`: one program per row sums the row's
checksum term (:mod:`kvwire.integrity`'s definition) and adds it into its layer's sum.

:func:`hash_rows` takes rows listed in a table (or sent per call); :func:`hash_pages` takes
a chunk in page form (:mod:`kvwire.page_form`) and finds each row from the page lists and
the sides' per-pair base addresses and strides. Both share :func:`_term`, so their terms are
the same bit for bit. Launched only by :class:`~kvwire.integrity_device.DeviceRowHasher`,
under its lock; imported only where they run (a CUDA device, or Triton's interpreter with
``TRITON_INTERPRET=1`` set before import).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["hash_pages", "hash_rows", "sum_program"]

#: Sums and counts the last program of a page launch moves into the result per step.
SETTLE: tl.constexpr = tl.constexpr(128)


@triton.jit  # type: ignore[untyped-decorator]
def _term(  # type: ignore[no-untyped-def]  # Triton rejects non-Triton annotations
    addr,
    k,
    mode,
    key,
    consts,
    block: tl.constexpr,
    inline_weights: tl.constexpr,
):
    # One row's checksum term (int64 bits): its k cells at addr, read as mode says (aligned
    # words, unaligned words, bytes), weighted, summed, mixed with its destination key.
    mix1 = tl.load(consts).to(tl.uint64, bitcast=True)
    mix2 = tl.load(consts + 1).to(tl.uint64, bitcast=True)
    odd = tl.load(consts + 2).to(tl.uint64, bitcast=True)
    golden = tl.load(consts + 3).to(tl.uint64, bitcast=True)
    words = addr.to(tl.pointer_type(tl.uint64))
    raw = addr.to(tl.pointer_type(tl.uint8))
    offs = tl.arange(0, block)
    acc = tl.zeros([block], dtype=tl.uint64)
    for start in range(0, k, block):
        o = start + offs
        m = o < k
        if inline_weights:  # weights(k)[j] = mix((j + 1) * GOLDEN) | 1, computed here
            w = (o + 1).to(tl.uint64) * golden
            w = (w ^ (w >> 30)) * mix1
            w = (w ^ (w >> 27)) * mix2
            w = (w ^ (w >> 31)) | 1
        else:
            w = tl.load(consts + 4 + o, mask=m, other=0).to(tl.uint64, bitcast=True)
        if mode == 0:
            cell = tl.load(words + o, mask=m, other=0)
        elif mode == 1:
            cell = tl.zeros([block], dtype=tl.uint64)
            for i in tl.static_range(8):
                byte = tl.load(raw + o * 8 + i, mask=m, other=0).to(tl.uint64)
                cell = cell | (byte << (8 * i))
        else:
            cell = tl.load(raw + o, mask=m, other=0).to(tl.uint64)
        acc += cell * w
    body = tl.sum(acc, axis=0)
    x = key
    x = (x ^ (x >> 30)) * mix1
    x = (x ^ (x >> 27)) * mix2
    x = x ^ (x >> 31)
    return ((body ^ x) * odd).to(tl.int64, bitcast=True)


@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=[
        "info_addr",
        "num_info",
        "call_addr",
        "consts_addr",
        "out_addr",
        "num_rows",
        "num_layers",
        "lo",
        "hi",
    ]
)
def hash_rows(  # type: ignore[no-untyped-def]  # Triton rejects non-Triton annotations
    info_addr,
    num_info,
    call_addr,
    consts_addr,
    out_addr,
    num_rows,
    num_layers,
    lo,
    hi,
    block: tl.constexpr,
    inline_weights: tl.constexpr,
    per_layer: tl.constexpr,
    indexed: tl.constexpr,
) -> None:
    # indexed: info = int64 [4, num_info] (address, cells, read mode, layer or -1) of a
    # descriptor table; call = int64 [2, rows] (row index into info, destination key).
    # Else call = int64 [5, rows] (address, key, cells, read mode, layer). consts: int64 bits
    # of MIX1, MIX2, ODD, GOLDEN, then the position weights (unless computed inline). out:
    # per_layer: int64 [2 * num_layers + 1] = sums, rows counted per layer (rows of layers
    # [lo, hi) only), rows outside the buffers; else int64 [rows], each row's term.
    call = call_addr.to(tl.pointer_type(tl.int64))
    consts = consts_addr.to(tl.pointer_type(tl.int64))
    out = out_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    key = tl.load(call + num_rows + pid).to(tl.uint64, bitcast=True)
    if indexed:
        info = info_addr.to(tl.pointer_type(tl.int64))
        r = tl.load(call + pid)
        addr = tl.load(info + r)
        k = tl.load(info + num_info + r)
        mode = tl.load(info + 2 * num_info + r)
        layer = tl.load(info + 3 * num_info + r)
    else:
        addr = tl.load(call + pid)
        k = tl.load(call + 2 * num_rows + pid)
        mode = tl.load(call + 3 * num_rows + pid)
        layer = tl.load(call + 4 * num_rows + pid)
    inside = (layer >= lo) & (layer < hi)
    k = tl.where(inside, k, 0)  # a row of another layer (or outside) reads nothing
    term = _term(addr, k, mode, key, consts, block, inline_weights)
    if per_layer:
        slot = tl.where(inside, layer, 0)
        tl.atomic_add(out + slot, term, mask=inside)
        tl.atomic_add(out + num_layers + slot, 1, mask=inside)
        tl.atomic_add(out + 2 * num_layers, 1, mask=layer < 0)
    else:
        tl.store(out + pid, term)


@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=[
        "pairs_addr",
        "num_pairs",
        "call_addr",
        "consts_addr",
        "out_addr",
        "result_addr",
        "num_pages",
        "tokens",
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
def hash_pages(  # type: ignore[no-untyped-def]  # Triton rejects non-Triton annotations
    pairs_addr,
    num_pairs,
    call_addr,
    consts_addr,
    out_addr,
    result_addr,
    num_pages,
    tokens,
    cells,
    read_slot,
    read_row,
    key_slot,
    key_row,
    num_layers,
    lo,
    hi,
    block: tl.constexpr,
    inline_weights: tl.constexpr,
    mode: tl.constexpr,
) -> None:
    # A chunk in page form, one program per (buffer pair, page) walking the page's pieces,
    # rows implicit (pair-major, then page, then piece, as PageChunk.rows): pairs = int64
    # [3, num_pairs] (read base address, key base address, layer); call = int64
    # [2, num_pages] (read pages, key pages). Piece t of page p of pair b is read at
    # read_base[b] + read_pages[p] * read_slot + t * read_row and keyed by key_base[b] +
    # key_pages[p] * key_slot + t * key_row; every piece has `cells` cells read as `mode`
    # says. The program adds its pieces' terms, then one atomic add per page into its layer's
    # sum (a head slice's 16 pieces a page cost one atomic, not 16). out: int64
    # [2 * num_layers + 2], as hash_rows' per_layer plus a count of programs done, all zero
    # when a launch starts: the last program to finish moves the sums and counts into
    # result (int64 [2 * num_layers + 1], pinned host memory on a GPU) and zeroes out again,
    # so a call needs no upload, zeroing or download of its own (each a GIL release on the
    # host), only its launch and a wait. call may be pinned host memory too.
    sum_program(
        pairs_addr.to(tl.pointer_type(tl.int64)),
        num_pairs,
        call_addr.to(tl.pointer_type(tl.int64)),
        consts_addr,
        out_addr,
        result_addr,
        tl.program_id(0).to(tl.int64),
        num_pages,
        tokens,
        cells,
        read_slot,
        read_row,
        key_slot,
        key_row,
        num_layers,
        lo,
        hi,
        block,
        inline_weights,
        mode,
    )


@triton.jit  # type: ignore[untyped-decorator]
def sum_program(  # type: ignore[no-untyped-def]  # Triton rejects non-Triton annotations
    pairs,
    num_pairs,
    call,
    consts_addr,
    out_addr,
    result_addr,
    pid,
    num_pages,
    tokens,
    cells,
    read_slot,
    read_row,
    key_slot,
    key_row,
    num_layers,
    lo,
    hi,
    block: tl.constexpr,
    inline_weights: tl.constexpr,
    mode: tl.constexpr,
):
    # Program pid of hash_pages (pairs and call as int64 pointers), also run by the page
    # mover's summed kernel (kvwire.movers.triton_pool_pages) after its copy programs.
    consts = consts_addr.to(tl.pointer_type(tl.int64))
    out = out_addr.to(tl.pointer_type(tl.int64))
    result = result_addr.to(tl.pointer_type(tl.int64))
    p = pid % num_pages
    b = pid // num_pages
    layer = tl.load(pairs + 2 * num_pairs + b)
    inside = (layer >= lo) & (layer < hi)
    addr = tl.load(pairs + b) + tl.load(call + p) * read_slot
    key = tl.load(pairs + num_pairs + b) + tl.load(call + num_pages + p) * key_slot
    pieces = tl.where(inside, tokens, 0)  # a pair of another layer reads nothing
    total = pid * 0
    for t in range(0, pieces):
        row_key = (key + t * key_row).to(tl.uint64, bitcast=True)
        total += _term(addr + t * read_row, cells, mode, row_key, consts, block, inline_weights)
    slot = tl.where(inside, layer, 0)
    tl.atomic_add(out + slot, total, mask=inside)
    tl.atomic_add(out + num_layers + slot, pid * 0 + tokens, mask=inside)
    # acq_rel: this program's adds are seen by the one that counts last, which sees them all
    done = tl.atomic_add(out + 2 * num_layers + 1, 1, sem="acq_rel")
    if done == num_pairs * num_pages - 1:
        # the sums and counts taken (and zeroed) SETTLE at a time, one vector store each into
        # result: one by one, 65 fenced exchanges and stores to host memory for 32 layers
        # took ~0.15 ms on an H200, more than the sums of a 128 MiB chunk
        count = 2 * num_layers + 1
        for i0 in range(0, count, SETTLE):
            o = i0 + tl.arange(0, SETTLE)
            m = o < count
            got = tl.atomic_xchg(out + o, tl.zeros([SETTLE], dtype=tl.int64), mask=m, sem="acq_rel")
            tl.store(result + o, got, mask=m)
        tl.atomic_xchg(out + 2 * num_layers + 1, 0, sem="acq_rel")
