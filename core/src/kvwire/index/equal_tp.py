"""Whole-row mappers: equal TP (MHA/GQA) and MLA (replicated latent, dummy senders).

Equal page sizes: one table row per (buffer pair, page slot); a chunk's index arrays are
``pair * num_slots + page``, layer-major. Different page sizes (prefill ``pp``, decode ``pd``):
one row per (buffer pair, slot, granule) of ``g = gcd(pp, pd)`` tokens on each side, and a
chunk's token range moves granule by granule (:mod:`kvwire.index.paging`):
``pair * (num_slots * page_size / g) + granule``.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel

from kvwire.descriptors import IndexArray, make_table
from kvwire.errors import LayoutError
from kvwire.index.base import IndexMapper, StagedSlice, TablePair, granule_stride
from kvwire.index.paging import PageConversion
from kvwire.layout import KVLayout
from kvwire.page_form import PageGeometry


def page_table(
    layout: KVLayout, bufs: NDArray[np.int64], granule: int = 0
) -> tuple[NDArray[np.uint64], ...]:
    """(addr, len, dev) columns with one row per (buffer in ``bufs``, slot, granule of
    ``granule`` tokens; 0: the whole page), buffer-major."""
    ps = layout.model.page_size
    g = granule or ps
    per = ps // g
    rows = layout.num_slots * per
    item = np.array([layout.buffers[b].item_len for b in bufs], dtype=np.uint64)
    slots = np.arange(layout.num_slots, dtype=np.uint64)
    unit = np.uint64(g * layout.token_row_bytes)
    units = np.arange(per, dtype=np.uint64) * unit
    addr = (
        layout.bases[bufs][:, None, None]
        + slots[None, :, None] * item[:, None, None]
        + units[None, None, :]
    ).ravel()
    whole = np.uint64(layout.page_bytes)  # a slot may hold two pages (K's, V's): one moves
    lens = np.full(addr.shape, whole if per == 1 else unit, dtype=np.uint64)
    return addr, lens, np.repeat(layout.devices[bufs], rows)


class EqualTPMapper(IndexMapper):
    """Same TP on both sides (MHA/GQA): every page slot moves whole."""

    name = "equal_tp"
    pair_major_rows = True
    relaxed_fields = ("page_size",)

    def __init__(self, src: KVLayout, dst: KVLayout, options: BaseModel | None = None) -> None:
        super().__init__(src, dst, options)
        self._check_shapes()
        pp, pd = src.model.page_size, dst.model.page_size
        if pp != pd:
            if src.head_major or dst.head_major:
                raise LayoutError(
                    f"page sizes differ ({pp} -> {pd}) and pages are head-major: token runs "
                    "are not contiguous; use the head_rows mapper (the default picks it)"
                )
            self.paging = PageConversion(pp, pd, math.gcd(pp, pd))

    def _check_shapes(self) -> None:
        if not self.src.model.is_mla and self.src.rank.tp_size != self.dst.rank.tp_size:
            raise LayoutError(
                f"equal_tp needs equal TP sizes (source {self.src.rank.tp_size}, destination "
                f"{self.dst.rank.tp_size}); use the head_slice mapper"
            )
        if self.interleaved:
            raise LayoutError(
                "K and V are side by side in each row on one side only (kv_fused): whole pages "
                "cannot move; use the head_rows mapper (the default picks it)"
            )
        if self.src.head_major != self.dst.head_major:
            raise LayoutError(
                "pages are head-major on one side and token-major on the other; whole pages "
                "cannot move: use the head_rows mapper (the default picks it)"
            )
        if self.src.token_row_bytes != self.dst.token_row_bytes:
            raise LayoutError(
                f"token rows differ: source {self.src.token_row_bytes} B, destination "
                f"{self.dst.token_row_bytes} B"
            )

    def staged_slice(self) -> StagedSlice | None:
        """Whole token rows on both sides (see :meth:`IndexMapper.staged_slice`)."""
        if not self._stageable():
            return None
        return StagedSlice(0, 0, self.src.token_row_bytes, whole_rows=True)

    def build_tables(self) -> TablePair:
        g = self.paging.granule if self.paging is not None else 0
        return TablePair(
            src=make_table(*page_table(self.src, self.src_buf, g)),
            dst=make_table(*page_table(self.dst, self.dst_buf, g)),
        )

    def _page_geometry(self) -> PageGeometry | None:
        """Whole pages: row ``pair * slots + page``, one piece of a page's bytes."""
        src, dst = self.src, self.dst
        if src.page_bytes != dst.page_bytes:
            return None
        pairs = np.arange(self.num_pairs, dtype=np.int64)
        n = src.page_bytes
        return PageGeometry(
            src_rows=pairs * src.num_slots,
            dst_rows=pairs * dst.num_slots,
            src_page_rows=1,
            dst_page_rows=1,
            src_token_rows=0,
            dst_token_rows=0,
            src_slot=src.slot_bytes,
            dst_slot=dst.slot_bytes,
            src_row=n,
            dst_row=n,
            n=n,
            tokens=1,
            src_slots=src.num_slots,
            dst_slots=dst.num_slots,
        )

    def _granule_geometry(self) -> PageGeometry | None:
        """Different page sizes: row ``pair * granules + granule``, one piece of a granule's
        token rows, granules at one stride on each side (else None: rows)."""
        assert self.paging is not None
        src, dst, g = self.src, self.dst, self.paging.granule
        s_step, d_step = granule_stride(src, g), granule_stride(dst, g)
        if s_step is None or d_step is None:
            return None
        pairs = np.arange(self.num_pairs, dtype=np.int64)
        s_units = src.num_slots * self.paging.src_granules
        d_units = dst.num_slots * self.paging.dst_granules
        n = g * src.token_row_bytes
        return PageGeometry(
            src_rows=pairs * s_units,
            dst_rows=pairs * d_units,
            src_page_rows=1,
            dst_page_rows=1,
            src_token_rows=0,
            dst_token_rows=0,
            src_slot=s_step,
            dst_slot=d_step,
            src_row=n,
            dst_row=n,
            n=n,
            tokens=1,
            src_slots=s_units,
            dst_slots=d_units,
        )

    def _map_granules(
        self, src_granules: NDArray[np.int64], dst_granules: NDArray[np.int64]
    ) -> tuple[IndexArray, IndexArray]:
        assert self.paging is not None
        pairs = np.arange(self.num_pairs, dtype=np.int64)[:, None]
        s_rows = self.src.num_slots * self.paging.src_granules
        d_rows = self.dst.num_slots * self.paging.dst_granules
        s_idx = (pairs * s_rows + src_granules[None, :]).ravel()
        d_idx = (pairs * d_rows + dst_granules[None, :]).ravel()
        return s_idx, d_idx

    def _map(
        self, src_pages: NDArray[np.int64], dst_pages: NDArray[np.int64]
    ) -> tuple[IndexArray, IndexArray]:
        pairs = np.arange(self.num_pairs, dtype=np.int64)[:, None]
        s_idx = (pairs * self.src.num_slots + src_pages[None, :]).ravel()
        d_idx = (pairs * self.dst.num_slots + dst_pages[None, :]).ravel()
        return s_idx, d_idx


class MLAMapper(EqualTPMapper):
    """MLA: the latent is replicated on every TP rank, so pages move whole for any TP pair.

    With more prefill than decode ranks, only the first of the ``Tp/Td`` prefill ranks feeding
    a decode rank sends; the others are dummies that report completion without data. Staged
    like equal TP (whole latent rows, :meth:`EqualTPMapper.staged_slice`); a dummy never is.
    """

    name = "mla"

    def _check_shapes(self) -> None:
        if not (self.src.model.is_mla and self.dst.model.is_mla):
            raise LayoutError("the mla mapper needs MLA layouts on both sides")
        super()._check_shapes()

    @property
    def is_dummy(self) -> bool:
        tp_s, tp_d = self.src.rank.tp_size, self.dst.rank.tp_size
        return super().is_dummy or (tp_s > tp_d and self.src.rank.tp_rank % (tp_s // tp_d) != 0)
