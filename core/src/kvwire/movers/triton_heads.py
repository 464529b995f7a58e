"""The head-major mover of bulk staging: one Triton launch gathers (or scatters) a head range
of every token of pages, or of units of pages, whose slots are head-major (``[heads, page,
head bytes]``: :attr:`kvwire.layout.KVLayout.head_major`), between every buffer of a call and
a contiguous block in token order ``[buffer, unit, token, head, head bytes]`` -- the wire
format of a staged chunk, the same block the token-major page and unit movers
(:mod:`kvwire.movers.triton_pages`, :mod:`kvwire.movers.triton_units`) give.

One program per (buffer, unit); a unit is a whole page (``per_page = 1``) or a run of
``tokens`` tokens of it (page-size conversion). Its ``heads * tokens`` pieces of ``n`` bytes
(one head of one token) sit at ``buffer + page * slot + k * unit_bytes + lo + h *
head_stride + t * token_stride`` in the pool and back to back in the block, piece ``t *
heads + h`` of the program's ``[token, head]`` span. The program copies them as 2-D tiles
``[rows, cols]`` of elements (``rows * cols`` = :data:`~kvwire.movers.plan.BLOCK_BYTES`):
a tile's row is (part of) one piece, contiguous on both sides, so loads and stores stay
vectors of the widest element dividing every address, stride and length (16 bytes for the
engines' head sizes), while only a row's piece index is divided into token and head. The
NumPy reference is :func:`kvwire.movers.plan.head_runs`. Imported only where it runs (a CUDA
device, or Triton's interpreter on the CPU with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton
import triton.language as tl
from numpy.typing import NDArray

from kvwire.movers.plan import BLOCK_BYTES
from kvwire.movers.triton_copy import _ELEM, _ELEM_BYTES
from kvwire.movers.triton_pages import PageCopier, page_width

__all__ = ["HeadCopier", "tile_shape"]


@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=[
        "table_addr",
        "nunits",
        "block_addr",
        "slot_elems",
        "per_page",
        "unit_elems",
        "lo_elems",
        "head_vecs",
        "token_vecs",
        "n_vecs",
        "heads",
        "tokens",
    ]
)
def _copy_heads(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    table_addr,
    nunits,
    block_addr,
    slot_elems,
    per_page,
    unit_elems,
    lo_elems,
    head_vecs,
    token_vecs,
    n_vecs,
    heads,
    tokens,
    rows: tl.constexpr,
    cols: tl.constexpr,
    elem: tl.constexpr,
    align: tl.constexpr,
    vec: tl.constexpr,
    to_pool: tl.constexpr,
) -> None:
    # table: int64 [nunits + buffers] = the unit ids, then each buffer's address. Offsets in
    # elements of `elem`; strides and the piece's length in vectors of `vec` elements, so the
    # compiler knows every row of a tile starts on a vector and keeps accesses 16 bytes wide
    # (a multiple_of hint on an argument is dropped).
    table = table_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    b = pid // nunits
    i = pid - b * nunits
    unit = tl.load(table + i)
    buf = tl.load(table + nunits + b)
    page = unit // per_page
    k = unit - page * per_page
    pool0 = tl.multiple_of(
        buf.to(tl.pointer_type(elem)) + page * slot_elems + k * unit_elems + lo_elems, align
    )
    n = n_vecs * vec
    head_stride = head_vecs * vec
    token_stride = token_vecs * vec
    count = heads * tokens  # pieces of this program, in block order [token, head]
    blk0 = tl.multiple_of(block_addr.to(tl.pointer_type(elem)) + pid * count * n, align)
    r = tl.arange(0, rows)
    c = tl.arange(0, cols)
    for r0 in range(0, count, rows):
        q = r0 + r  # piece index
        t = q // heads
        h = q - t * heads
        pool_row = h.to(tl.int64) * head_stride + t.to(tl.int64) * token_stride
        blk_row = q.to(tl.int64) * n
        row_ok = q < count
        for c0 in range(0, n, cols):
            o = c0 + c
            mask = row_ok[:, None] & (o < n)[None, :]
            pool = pool0 + pool_row[:, None] + o[None, :]
            blk = blk0 + blk_row[:, None] + o[None, :]
            if to_pool:
                tl.store(pool, tl.load(blk, mask=mask), mask=mask)
            else:
                tl.store(blk, tl.load(pool, mask=mask), mask=mask)


def tile_shape(
    n_elems: int, count: int, elem_bytes: int, vec: int, threads: int
) -> tuple[int, int]:
    """A program's tile ``(rows, cols)`` in elements for pieces of ``n_elems`` elements,
    ``count`` pieces per program, ``threads`` threads per program: ``cols`` the piece rounded
    up to a power of two (at least a vector, at most a block), ``rows`` filling
    :data:`~kvwire.movers.plan.BLOCK_BYTES` but no more rows than the program has pieces --
    yet at least a vector per thread: Triton gives a thread no more elements than the tile
    has per thread, and a tile under a vector per thread compiles to scalar accesses (rows
    past the pieces are masked off). Powers of two, as ``tl.arange`` needs."""
    block = BLOCK_BYTES // elem_bytes
    cols = min(max(1 << max(n_elems - 1, 0).bit_length(), vec), block)
    rows = min(block // cols, 1 << max(count - 1, 0).bit_length())
    rows = max(rows, threads * vec // cols, 1)
    return rows, cols


class HeadCopier(PageCopier):
    """Gathers and scatters head ranges of one device's head-major pool with one launch per
    call. Built for a GPU pool with head-major pages (:mod:`kvwire.movers.staged_moves`);
    same threading and table slots as :class:`~kvwire.movers.triton_pages.PageCopier` (its
    lock is held for the table write and the launch only, never while the GPU works)."""

    def copy_heads(
        self,
        addrs: NDArray[np.int64],
        units: NDArray[np.int64],
        block: int,
        *,
        slot_bytes: int,
        per_page: int,
        unit_bytes: int,
        lo: int,
        head_stride: int,
        token_stride: int,
        n: int,
        heads: int,
        tokens: int,
        to_pool: bool,
        stream: Any = None,
    ) -> None:
        """Enqueue the copy between the block at ``block`` (``[buffer, unit, token, head,
        n]``) and, for every buffer at ``addrs[b]`` and unit ``units[i]`` (``per_page`` units
        of ``unit_bytes`` per head run, slots ``slot_bytes`` apart), the ``n`` bytes of head
        ``h < heads`` of token ``t < tokens`` at ``lo + h * head_stride + t * token_stride``
        past the unit (:func:`kvwire.movers.plan.head_runs`): into the block, or into the
        pool when ``to_pool``. Never waits for the GPU unless every table slot is in flight;
        the caller synchronises ``stream``."""
        nunits, nbuf = int(units.size), int(addrs.size)
        if not nunits or not nbuf or not n or not heads or not tokens:
            return
        width = page_width(addrs, block, slot_bytes, unit_bytes, lo, head_stride, token_stride, n)
        eb = _ELEM_BYTES[width]
        vec = width // eb
        rows, cols = tile_shape(n // eb, heads * tokens, eb, vec, 32 * self.num_warps)
        key = (rows, cols, _ELEM[width], width, vec, to_pool)
        scalars = (
            nunits,
            block,
            slot_bytes // eb,
            per_page,
            unit_bytes // eb,
            lo // eb,
            head_stride // width,
            token_stride // width,
            n // width,
            heads,
            tokens,
        )
        self._launch(_copy_heads, "heads", key, units, addrs, scalars, stream)
