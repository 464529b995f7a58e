"""Whole-page mappers: equal TP (MHA/GQA) and MLA (replicated latent, dummy senders).

One table row per (buffer pair, page slot). A chunk's index arrays are
``pair * num_slots + page``, layer-major.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel

from kvwire.descriptors import IndexArray, make_table
from kvwire.errors import LayoutError
from kvwire.index.base import IndexMapper, TablePair
from kvwire.layout import KVLayout


def page_table(layout: KVLayout, bufs: NDArray[np.int64]) -> tuple[NDArray[np.uint64], ...]:
    """(addr, len, dev) columns with one row per (buffer in ``bufs``, slot), buffer-major."""
    s = layout.num_slots
    item = np.array([layout.buffers[b].item_len for b in bufs], dtype=np.uint64)
    slots = np.arange(s, dtype=np.uint64)
    addr = (layout.bases[bufs][:, None] + slots[None, :] * item[:, None]).ravel()
    return addr, np.repeat(item, s), np.repeat(layout.devices[bufs], s)


class EqualTPMapper(IndexMapper):
    """Same TP on both sides (MHA/GQA): every page slot moves whole."""

    name = "equal_tp"

    def __init__(self, src: KVLayout, dst: KVLayout, options: BaseModel | None = None) -> None:
        super().__init__(src, dst, options)
        self._check_shapes()

    def _check_shapes(self) -> None:
        if not self.src.model.is_mla and self.src.rank.tp_size != self.dst.rank.tp_size:
            raise LayoutError(
                f"equal_tp needs equal TP sizes (source {self.src.rank.tp_size}, destination "
                f"{self.dst.rank.tp_size}); use the head_slice mapper"
            )
        if self.src.token_row_bytes != self.dst.token_row_bytes:
            raise LayoutError(
                f"token rows differ: source {self.src.token_row_bytes} B, destination "
                f"{self.dst.token_row_bytes} B"
            )

    def build_tables(self) -> TablePair:
        return TablePair(
            src=make_table(*page_table(self.src, self.src_buf)),
            dst=make_table(*page_table(self.dst, self.dst_buf)),
        )

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
    a decode rank sends; the others are dummies that report completion without data.
    """

    name = "mla"

    def _check_shapes(self) -> None:
        if not (self.src.model.is_mla and self.dst.model.is_mla):
            raise LayoutError("the mla mapper needs MLA layouts on both sides")
        super()._check_shapes()

    @property
    def is_dummy(self) -> bool:
        tp_s, tp_d = self.src.rank.tp_size, self.dst.rank.tp_size
        return tp_s > tp_d and self.src.rank.tp_rank % (tp_s // tp_d) != 0
