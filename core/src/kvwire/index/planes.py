"""Plane views: a pool holding K and V in one buffer per layer seen as separate K and V
buffers, for a mapper.

A pool with :attr:`KVLayout.kv_fused <kvwire.layout.KVLayout.kv_fused>` keeps K and V of a
head side by side in each row (``[..., heads, 2, head_dim]``; vLLM's cache). Two fused sides
pair buffer with buffer: a head of ``2 x head_dim`` elements moves as one unit, so every core
mapper works on them unchanged (equal TP whole pages, TP head slices, head-major rows, page-size
conversion). A fused side paired with a side that keeps K and V in their own buffers cannot
move whole heads: the mapper then sees the fused side through :func:`split_kv`, one K plane and
one V plane per layer, each head ``head_dim`` elements long and ``2 x head_dim`` apart
(:attr:`KVLayout.elem_pitch <kvwire.layout.KVLayout.elem_pitch>`), and moves one row per
(plane, token, head) (the ``head_rows`` mapper, which the default picks for such a pair).

A pool with :attr:`KVLayout.kv_in_slot <kvwire.layout.KVLayout.kv_in_slot>` keeps K's page
then V's page in each slot (``[slots, 2, page, heads, dim]``): its planes are ordinary pages
one page apart, a slot stride of two pages, so every core mapper moves them as it moves
separate K and V buffers (whole pages, head slices, head rows); such a pool is always seen
through its planes.

A view is addressing only: it is never registered with a backend nor sent to a peer (its
plane "regions" overlap by construction); the rank's real layout is.
"""

from __future__ import annotations

from kvwire.layout import KVLayout
from kvwire.regions import MemoryRegion


def split_kv(layout: KVLayout) -> KVLayout:
    """The layout itself, or, for a pool holding K and V in one buffer per layer (fused rows
    or K's and V's page in one slot), a view with a K plane per layer followed by a V plane
    per layer (the order of a pool with separate K and V buffers). Built by a mapper at
    construction (prefill's handshake thread, or decode's for its staging ring)."""
    if not (layout.kv_fused or layout.kv_in_slot):
        return layout
    m = layout.model
    hb = m.head_dim * m.dtype_size
    # where V starts: one head into each row (fused rows), or one page into each slot
    v_at = hb if layout.kv_fused else layout.page_bytes
    planes = tuple(
        MemoryRegion.model_construct(
            addr=b.addr + kv * v_at,
            length=b.length,
            item_len=b.item_len,
            kind=b.kind,
            device_id=b.device_id,
        )
        for kv in (0, 1)
        for b in layout.buffers
    )
    view = KVLayout.model_construct(
        model=m,
        rank=layout.rank,
        start_layer=layout.start_layer,
        end_layer=layout.end_layer,
        buffers=planes,
        groups=layout.groups,
        head_major=layout.head_major,
        kv_fused=False,
        kv_in_slot=False,
    )
    if layout.kv_fused:
        view._pitch = 2 * hb
        view._plane = hb
    else:
        view._page = layout.page_bytes
    return view
