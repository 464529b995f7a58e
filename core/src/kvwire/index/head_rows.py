"""Head-major pages on either side: one descriptor row per (token, head).

A head-major pool keeps a page as ``[heads, page_size, head_dim]`` (a head's tokens
contiguous); a token-major one as ``[page_size, heads, head_dim]``. When the two sides store
pages differently, or a head-major side has another TP size than its peer, no run longer than
one head of one token is contiguous on both sides, so every (buffer pair, token, head) moves as
its own row of ``head_dim x dtype`` bytes. Which heads move (TP gather or scatter, GQA
replication) is :class:`~kvwire.index.head_slice.HeadSliceMapper`'s rule; only the rows differ.

Rows are per (buffer pair, slot, token, local head), each side with its own page order
(:meth:`KVLayout.byte_offsets <kvwire.layout.KVLayout.byte_offsets>`); index
``pair*(S*ps*H) + (slot*ps + t)*H + h``. Different page sizes: tokens move one by one
(:mod:`kvwire.index.paging`, granule 1) with the same formula (``slot*ps + t`` is the token's
unit). Identical head-major layouts with equal TP move whole pages (``equal_tp``).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvwire.descriptors import IndexArray, make_table
from kvwire.index.base import TablePair
from kvwire.index.head_slice import HeadSliceMapper
from kvwire.layout import KVLayout
from kvwire.page_form import PageGeometry


def head_row_table(layout: KVLayout, bufs: NDArray[np.int64]) -> tuple[NDArray[np.uint64], ...]:
    """(addr, len, dev) with one row per (buffer in ``bufs``, slot, token, local head)."""
    m = layout.model
    heads = layout.local_kv_heads
    hb = layout.head_bytes
    item = np.uint64(layout.slot_bytes)
    slots = np.arange(layout.num_slots, dtype=np.uint64) * item
    offs = layout.byte_offsets(np.arange(m.page_size), np.arange(heads))  # [ps, heads]
    addr = (
        layout.bases[bufs][:, None, None, None]
        + slots[None, :, None, None]
        + offs[None, None, :, :]
    ).ravel()
    per_buf = layout.num_slots * m.page_size * heads
    lens = np.full(addr.shape, hb, dtype=np.uint64)
    return addr, lens, np.repeat(layout.devices[bufs], per_buf)


class HeadRowsMapper(HeadSliceMapper):
    """Moves each (token, head) on its own when either side's pages are head-major."""

    name = "head_rows"
    pair_major_rows = True
    requires_token_major = False

    def _page_geometry(self) -> PageGeometry | None:
        """None: a head's rows are not one slice of each token row on both sides."""
        return None

    def build_tables(self) -> TablePair:
        return TablePair(
            src=make_table(*head_row_table(self.src, self.src_buf)),
            dst=make_table(*head_row_table(self.dst, self.dst_buf)),
        )

    def _rows(
        self, src_tokens: NDArray[np.int64], dst_tokens: NDArray[np.int64]
    ) -> tuple[IndexArray, IndexArray]:
        """Rows moving source token unit ``src_tokens[i]`` (``slot*ps + t``) into destination
        unit ``dst_tokens[i]``, for every buffer pair and every head this pair moves."""
        hs, hd = self.src.local_kv_heads, self.dst.local_kv_heads
        s_rows = self.src.num_slots * self.src.model.page_size * hs
        d_rows = self.dst.num_slots * self.dst.model.page_size * hd
        pairs = np.arange(self.num_pairs, dtype=np.int64)[:, None, None]
        j = np.arange(self.num_heads, dtype=np.int64)[None, None, :]
        s_idx = (pairs * s_rows + src_tokens[None, :, None] * hs + self.src_start + j).ravel()
        d_idx = (pairs * d_rows + dst_tokens[None, :, None] * hd + self.dst_start + j).ravel()
        return s_idx, d_idx

    def _map(
        self, src_pages: NDArray[np.int64], dst_pages: NDArray[np.int64]
    ) -> tuple[IndexArray, IndexArray]:
        ps = self.src.model.page_size
        t = np.arange(ps, dtype=np.int64)[None, :]
        return self._rows(
            (src_pages[:, None] * ps + t).ravel(), (dst_pages[:, None] * ps + t).ravel()
        )

    def _map_granules(
        self, src_granules: NDArray[np.int64], dst_granules: NDArray[np.int64]
    ) -> tuple[IndexArray, IndexArray]:
        return self._rows(src_granules, dst_granules)
