"""The token-run mover of bulk staging: one Triton launch gathers (or scatters) runs of
``tokens`` token rows (whole rows, or a byte slice of each) between a pool's pages and a
contiguous block, where a run is a *unit* of a page, not the whole page.

Used where prefill and decode pages differ in size (page-size conversion): a staged chunk is
cut into units of ``g = gcd(prefill page, decode page)`` tokens (or single tokens for head
slices), so a block gathered from prefill's pages in token order scatters into decode's
pages of another size. The page mover (:class:`kvwire.movers.triton_pages.PageCopier`) copies
whole pages; this one computes each unit's page and offset on the device from the unit id:
unit ``u`` of a pool with ``units_per_page`` units per page is page ``u // units_per_page``,
at ``(u % units_per_page) * unit_bytes`` into its slot.

One program per (buffer, unit): it copies ``tokens`` pieces of ``n`` bytes, piece ``t`` at
``buffer + page * slot_bytes + k * unit_bytes + lo + t * row`` in the pool and at
``block + ((b * units + i) * tokens + t) * n`` in the block (``[buffer, unit, token, n]``,
as :func:`kvwire.movers.plan.unit_runs` describes: the NumPy reference the tests compare it
with). Imported only where it runs (a CUDA device, or Triton's interpreter on the CPU).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton
import triton.language as tl
from numpy.typing import NDArray

from kvwire.movers.triton_pages import PageCopier, kernel_key, page_width

__all__ = ["UnitCopier"]


@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=[
        "table_addr",
        "nunits",
        "block_addr",
        "slot_elems",
        "per_page",
        "unit_elems",
        "lo_elems",
        "row_elems",
        "n_vecs",
        "tokens",
    ]
)
def _copy_units(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    table_addr,
    nunits,
    block_addr,
    slot_elems,
    per_page,
    unit_elems,
    lo_elems,
    row_elems,
    n_vecs,
    tokens,
    block: tl.constexpr,
    elem: tl.constexpr,
    align: tl.constexpr,
    vec: tl.constexpr,
    to_pool: tl.constexpr,
) -> None:
    # table: int64 [nunits + buffers] = the unit ids, then each buffer's address. Offsets are in
    # elements of `elem`, the piece's length in vectors of `vec` elements.
    table = table_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    b = pid // nunits
    i = pid - b * nunits
    unit = tl.load(table + i)
    buf = tl.load(table + nunits + b)
    page = unit // per_page
    k = unit - page * per_page
    pool0 = buf.to(tl.pointer_type(elem)) + page * slot_elems + k * unit_elems + lo_elems
    # the length in vectors: the compiler then knows it divides by vec and keeps masked
    # accesses 16 bytes wide (a multiple_of hint on an argument is dropped)
    n_elems = n_vecs * vec
    blk0 = block_addr.to(tl.pointer_type(elem)) + pid * tokens * n_elems
    n = n_elems
    offs = tl.arange(0, block)
    for t in range(0, tokens):
        pool = tl.multiple_of(pool0 + t * row_elems, align)
        blk = tl.multiple_of(blk0 + t * n_elems, align)
        for start in range(0, n, block):
            o = start + offs
            mask = o < n
            if to_pool:
                tl.store(pool + o, tl.load(blk + o, mask=mask), mask=mask)
            else:
                tl.store(blk + o, tl.load(pool + o, mask=mask), mask=mask)


class UnitCopier(PageCopier):
    """Gathers and scatters token units of one device's pool with one launch per call.

    Built by :class:`kvwire.staging.kernels.KVTensors` for a GPU pool with token-major pages,
    used for staged chunks of links that convert page sizes. Same threading and table slots
    as :class:`~kvwire.movers.triton_pages.PageCopier` (its lock is held for the table write
    and the launch only)."""

    def copy_units(
        self,
        addrs: NDArray[np.int64],
        units: NDArray[np.int64],
        block: int,
        *,
        slot_bytes: int,
        per_page: int,
        unit_bytes: int,
        lo: int,
        row: int,
        n: int,
        tokens: int,
        to_pool: bool,
        stream: Any = None,
    ) -> None:
        """Enqueue the copy between bytes ``[lo, lo + n)`` of ``tokens`` rows (``row`` bytes
        apart) of every unit ``units[i]`` (``per_page`` units of ``unit_bytes`` per slot,
        slots ``slot_bytes`` apart) of every buffer at ``addrs[b]`` and the block at
        ``block`` (``[buffer, unit, token, n]``): into the block, or into the pool when
        ``to_pool``. Never waits for the GPU unless every table slot is in flight; the
        caller synchronises ``stream``."""
        nunits, nbuf = int(units.size), int(addrs.size)
        if not nunits or not nbuf or not n or not tokens:
            return
        width = page_width(addrs, block, slot_bytes, unit_bytes, lo, row, n)
        key, eb = kernel_key(width, n, to_pool)
        scalars = (
            nunits,
            block,
            slot_bytes // eb,
            per_page,
            unit_bytes // eb,
            lo // eb,
            row // eb,
            n // width,
            tokens,
        )
        self._launch(_copy_units, "unit", key, units, addrs, scalars, stream)
