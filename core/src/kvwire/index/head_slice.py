"""Heterogeneous-TP head slicing for MHA/GQA, with GQA replication in both directions.

With ``H`` total KV heads, ``Tp`` prefill ranks and ``Td`` decode ranks:

* ``src_heads = max(1, H // Tp)``, ``dst_heads = max(1, H // Td)``;
* prefill larger (gather): prefill rank r holds unique head group ``r // max(1, Tp // H)`` and
  sends all its ``src_heads`` heads into destination head offset
  ``(unique * src_heads) % dst_heads``;
* decode larger (scatter): decode rank r needs unique group ``r // max(1, Td // H)`` (integer
  division) and receives ``dst_heads`` heads starting at source head
  ``(unique * dst_heads) % src_heads`` into offset 0.

Rows are per (buffer pair, slot, token[, head group]): the source table holds all ``G``
head groups of width ``n`` heads so one table serves every destination of a source rank; index
``pair*(S*ps*G) + page*(ps*G) + t*G + g``. The destination table has one row per
(pair, slot, token).

Different page sizes on the two sides (prefill ``pp``, decode ``pd``): the tables are unchanged
(each side's rows use its own page size) and token ranges move token by token
(:mod:`kvwire.index.paging`, granule 1): source token ``u = page*pp + t`` is row
``pair*(S*pp*G) + u*G + g``, destination token ``v = page*pd + t`` row ``pair*(S*pd) + v``.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel

from kvwire.descriptors import IndexArray, make_table
from kvwire.errors import LayoutError
from kvwire.index.base import IndexMapper, StagedSlice, TablePair, granule_stride
from kvwire.index.paging import PageConversion
from kvwire.index.ranks import head_slice, source_ranks
from kvwire.layout import KVLayout
from kvwire.page_form import PageGeometry


def token_table(
    layout: KVLayout, bufs: NDArray[np.int64], offsets: NDArray[np.uint64], length: int
) -> tuple[NDArray[np.uint64], ...]:
    """Rows per (buffer, slot, token, offset): ``base + slot*item + t*row + offset``."""
    ps = layout.model.page_size
    row = np.uint64(layout.token_row_bytes)
    item = np.uint64(layout.slot_bytes)
    slots = np.arange(layout.num_slots, dtype=np.uint64) * item
    toks = np.arange(ps, dtype=np.uint64) * row
    addr = (
        layout.bases[bufs][:, None, None, None]
        + slots[None, :, None, None]
        + toks[None, None, :, None]
        + offsets[None, None, None, :]
    ).ravel()
    per_buf = layout.num_slots * ps * offsets.size
    lens = np.full(addr.shape, length, dtype=np.uint64)
    return addr, lens, np.repeat(layout.devices[bufs], per_buf)


class HeadSliceMapper(IndexMapper):
    """Moves each token's head slice when prefill and decode TP differ (MHA/GQA)."""

    name = "head_slice"
    pair_major_rows = True
    relaxed_fields = ("page_size",)
    #: Rows are head runs of token rows: both sides' pages must be token-major.
    requires_token_major = True

    def __init__(self, src: KVLayout, dst: KVLayout, options: BaseModel | None = None) -> None:
        super().__init__(src, dst, options)
        if src.model.is_mla:
            raise LayoutError("MLA layouts move whole pages; use the mla mapper")
        if self.requires_token_major and (src.head_major or dst.head_major):
            raise LayoutError(
                "head_slice moves runs of token rows; a head-major side needs the head_rows "
                "mapper (the default picks it)"
            )
        if self.requires_token_major and self.interleaved:
            raise LayoutError(
                "K and V are side by side in each row on one side only (kv_fused): head runs "
                "are not contiguous on both; use the head_rows mapper (the default picks it)"
            )
        tp_s, tp_d = src.rank.tp_size, dst.rank.tp_size
        if src.rank.tp_rank not in source_ranks(dst.rank.tp_rank, tp_s, tp_d):
            raise LayoutError(
                f"prefill TP rank {src.rank.tp_rank} does not feed decode TP rank "
                f"{dst.rank.tp_rank} (TP {tp_s} -> {tp_d})"
            )
        cut = head_slice(src.model.total_kv_heads, tp_s, tp_d, src.rank.tp_rank, dst.rank.tp_rank)
        self.src_heads, self.dst_heads = cut.src_heads, cut.dst_heads
        self.num_heads, self.src_start, self.dst_start = cut.count, cut.src_start, cut.dst_start
        self._dummy = not cut.sends
        self.bytes_per_head = self.src.head_bytes
        self.groups = self.src_heads // self.num_heads
        self.group = self.src_start // self.num_heads
        self.slice_bytes = self.num_heads * self.bytes_per_head
        pp, pd = src.model.page_size, dst.model.page_size
        if pp != pd:
            self.paging = PageConversion(pp, pd, 1)

    @property
    def is_dummy(self) -> bool:
        return super().is_dummy or self._dummy

    def staged_slice(self) -> StagedSlice | None:
        """This rank's head slice of each row (see :meth:`IndexMapper.staged_slice`)."""
        if not self._stageable():
            return None
        lo = self.dst_start * self.bytes_per_head
        return StagedSlice(
            self.src_start * self.bytes_per_head, lo, self.slice_bytes, whole_rows=False
        )

    def build_tables(self) -> TablePair:
        src_offsets = np.arange(self.groups, dtype=np.uint64) * np.uint64(self.slice_bytes)
        dst_offsets = np.array([self.dst_start * self.bytes_per_head], dtype=np.uint64)
        return TablePair(
            src=make_table(*token_table(self.src, self.src_buf, src_offsets, self.slice_bytes)),
            dst=make_table(*token_table(self.dst, self.dst_buf, dst_offsets, self.slice_bytes)),
        )

    def _map(
        self, src_pages: NDArray[np.int64], dst_pages: NDArray[np.int64]
    ) -> tuple[IndexArray, IndexArray]:
        ps, g_count = self.src.model.page_size, self.groups
        pairs = np.arange(self.num_pairs, dtype=np.int64)[:, None, None]
        toks = np.arange(ps, dtype=np.int64)[None, None, :]
        s_idx = (
            pairs * (self.src.num_slots * ps * g_count)
            + src_pages[None, :, None] * (ps * g_count)
            + toks * g_count
            + self.group
        ).ravel()
        d_idx = (pairs * (self.dst.num_slots * ps) + dst_pages[None, :, None] * ps + toks).ravel()
        return s_idx, d_idx

    def _page_geometry(self) -> PageGeometry | None:
        """This rank's head slice of each token row: ``page_size`` pieces per page."""
        src, dst = self.src, self.dst
        ps, g_count = src.model.page_size, self.groups
        pairs = np.arange(self.num_pairs, dtype=np.int64)
        return PageGeometry(
            src_rows=pairs * (src.num_slots * ps * g_count) + self.group,
            dst_rows=pairs * (dst.num_slots * ps),
            src_page_rows=ps * g_count,
            dst_page_rows=ps,
            src_token_rows=g_count,
            dst_token_rows=1,
            src_slot=src.slot_bytes,
            dst_slot=dst.slot_bytes,
            src_row=src.token_row_bytes,
            dst_row=dst.token_row_bytes,
            n=self.slice_bytes,
            tokens=ps,
            src_slots=src.num_slots,
            dst_slots=dst.num_slots,
        )

    def _granule_geometry(self) -> PageGeometry | None:
        """Different page sizes (granules of one token): this rank's head slice of each
        token row, tokens at one stride on each side (else None: rows)."""
        src, dst, g_count = self.src, self.dst, self.groups
        if self.paging is None or self.paging.granule != 1:
            return None
        s_step, d_step = granule_stride(src, 1), granule_stride(dst, 1)
        if s_step is None or d_step is None:
            return None
        pairs = np.arange(self.num_pairs, dtype=np.int64)
        s_units = src.num_slots * src.model.page_size
        d_units = dst.num_slots * dst.model.page_size
        return PageGeometry(
            src_rows=pairs * (s_units * g_count) + self.group,
            dst_rows=pairs * d_units,
            src_page_rows=g_count,
            dst_page_rows=1,
            src_token_rows=0,
            dst_token_rows=0,
            src_slot=s_step,
            dst_slot=d_step,
            src_row=self.slice_bytes,
            dst_row=self.slice_bytes,
            n=self.slice_bytes,
            tokens=1,
            src_slots=s_units,
            dst_slots=d_units,
        )

    def _map_granules(
        self, src_granules: NDArray[np.int64], dst_granules: NDArray[np.int64]
    ) -> tuple[IndexArray, IndexArray]:
        pairs = np.arange(self.num_pairs, dtype=np.int64)[:, None]
        s_rows = self.src.num_slots * self.src.model.page_size * self.groups
        d_rows = self.dst.num_slots * self.dst.model.page_size
        s_idx = (pairs * s_rows + src_granules[None, :] * self.groups + self.group).ravel()
        d_idx = (pairs * d_rows + dst_granules[None, :]).ravel()
        return s_idx, d_idx
