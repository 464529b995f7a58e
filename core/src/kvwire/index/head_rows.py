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

With equal page sizes a chunk also has a page form (:mod:`kvwire.page_form`) of
``page_size x heads`` pieces per page: a page writer (``cudaipc``) moves it with one launch.
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
        """Equal page sizes (the base checks that): ``page_size x num_heads`` pieces of one
        head per page and buffer pair, each side's bytes affine in token and head
        (:meth:`KVLayout.byte_offsets <kvwire.layout.KVLayout.byte_offsets>`), so a page
        writer moves a chunk with one launch instead of a row per (token, head). None when
        a side's offsets are not affine (no layout here has such offsets)."""
        src, dst = self.src, self.dst
        ps, nh = src.model.page_size, self.num_heads
        strides = []
        for lay, start in ((src, self.src_start), (dst, self.dst_start)):
            offs = lay.byte_offsets(np.arange(ps), start + np.arange(nh)).astype(np.int64)
            tok = int(offs[1, 0] - offs[0, 0]) if ps > 1 else 0
            head = int(offs[0, 1] - offs[0, 0]) if nh > 1 else 0
            t, h = np.arange(ps)[:, None], np.arange(nh)[None, :]
            if not np.array_equal(offs, offs[0, 0] + t * tok + h * head):
                return None
            strides.append((tok, head))
        (s_tok, s_head), (d_tok, d_head) = strides
        hs, hd = src.local_kv_heads, dst.local_kv_heads
        pairs = np.arange(self.num_pairs, dtype=np.int64)
        return PageGeometry(
            src_rows=pairs * (src.num_slots * ps * hs) + self.src_start,
            dst_rows=pairs * (dst.num_slots * ps * hd) + self.dst_start,
            src_page_rows=ps * hs,
            dst_page_rows=ps * hd,
            src_token_rows=hs,
            dst_token_rows=hd,
            src_slot=src.slot_bytes,
            dst_slot=dst.slot_bytes,
            src_row=s_tok,
            dst_row=d_tok,
            n=src.head_bytes,
            tokens=ps,
            src_slots=src.num_slots,
            dst_slots=dst.num_slots,
            heads=nh,
            src_head_rows=1,
            dst_head_rows=1,
            src_head=s_head,
            dst_head=d_head,
        )

    def _granule_geometry(self) -> PageGeometry | None:
        """None: with different page sizes a head-major side's tokens are not at one stride
        (its rows stay per (token, head))."""
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
