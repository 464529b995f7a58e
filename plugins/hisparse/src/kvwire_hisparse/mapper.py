"""``hisparse``: prefill KV pages into a decode host pool with a finer page size.

The decode host pool holds the same model with its own page size ``ph`` that divides prefill's
``pp`` (``ph = 1``: token granularity). Each prefill page fills ``r = pp / ph`` host pages, so
the source table has one row per (buffer pair, prefill slot, unit j < r) of ``ph`` token rows
and the destination table one row per (buffer pair, host slot). A chunk's ``n`` prefill pages go
to ``m`` host pages with ``(n - 1) * r < m <= n * r``: the last prefill page may be trimmed to
the tokens that exist. Equal TP (or MLA) on both sides; rows move whole.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel

from kvwire.descriptors import IndexArray, check_indices, make_table
from kvwire.errors import DescriptorError, LayoutError
from kvwire.index.base import IndexMapper, TablePair, check_pages
from kvwire.layout import KVLayout


class HostPoolMapper(IndexMapper):
    """Prefill pages -> decode host-pool pages of a page size dividing prefill's."""

    name = "hisparse"
    pair_major_rows = True  # _map: pair-major rows (layer-wise chunks are cut by layer)
    relaxed_fields = ("page_size",)

    def __init__(self, src: KVLayout, dst: KVLayout, options: BaseModel | None = None) -> None:
        super().__init__(src, dst, options)
        pp, ph = src.model.page_size, dst.model.page_size
        if src.head_major or dst.head_major:
            raise LayoutError(
                "the hisparse path moves token rows: both pools must be token-major "
                "([slots, page, heads, dim]), not head_major"
            )
        if pp % ph:
            raise LayoutError(
                f"host pool page size {ph} must divide prefill's page size {pp} "
                "(1 gives token granularity)"
            )
        if not src.model.is_mla and src.rank.tp_size != dst.rank.tp_size:
            raise LayoutError(
                f"the hisparse path needs equal TP (prefill {src.rank.tp_size}, decode "
                f"{dst.rank.tp_size})"
            )
        if src.token_row_bytes != dst.token_row_bytes:
            raise LayoutError(
                f"token rows differ: prefill {src.token_row_bytes} B, host pool "
                f"{dst.token_row_bytes} B"
            )
        self.units_per_page = pp // ph
        self.unit_bytes = ph * src.token_row_bytes

    def build_tables(self) -> TablePair:
        r, ub = self.units_per_page, np.uint64(self.unit_bytes)
        s = self.src
        item = np.array([s.buffers[b].item_len for b in self.src_buf], dtype=np.uint64)
        slots = np.arange(s.num_slots, dtype=np.uint64)
        units = np.arange(r, dtype=np.uint64) * ub
        addr = (
            s.bases[self.src_buf][:, None, None]
            + slots[None, :, None] * item[:, None, None]
            + units[None, None, :]
        ).ravel()
        devs = np.repeat(s.devices[self.src_buf], s.num_slots * r)
        d = self.dst
        d_item = np.array([d.buffers[b].item_len for b in self.dst_buf], dtype=np.uint64)
        d_slots = np.arange(d.num_slots, dtype=np.uint64)
        d_addr = (d.bases[self.dst_buf][:, None] + d_slots[None, :] * d_item[:, None]).ravel()
        return TablePair(
            src=make_table(addr, ub, devs),
            dst=make_table(
                d_addr,
                np.repeat(d_item, d.num_slots),
                np.repeat(d.devices[self.dst_buf], d.num_slots),
            ),
        )

    def chunk_slice(
        self,
        num_pages: int,
        dst_units: NDArray[np.int64],
        pages: NDArray[np.int64],
        start: int,
        end: int,
        cached_tokens: int | None = None,
    ) -> tuple[NDArray[np.int64], int, int]:
        """Decode sends the host units of the request's tokens from the first, trimmed within
        the last page; each source page covers ``units_per_page`` of them (nothing is cached
        in a host pool: ``cached_tokens`` is not used)."""
        r, m = self.units_per_page, dst_units.size
        if m and not (num_pages - 1) * r < m <= num_pages * r:
            raise DescriptorError(
                f"decode asked for {m} host units but {num_pages} pages hold {num_pages * r} "
                "(only the last page may be trimmed)"
            )
        lo, hi = start * r, min(end * r, m)
        if hi <= lo:
            return pages[:0], 0, 0
        return pages[: -(-(hi - lo) // r)], lo, hi

    def map_chunk(self, src_pages: Any, dst_pages: Any) -> tuple[IndexArray, IndexArray]:
        """``n`` prefill pages -> ``m`` host pages, ``(n - 1) * r < m <= n * r``."""
        sp = check_pages(src_pages, self.src.num_slots, "source page indices")
        dp = check_indices(
            dst_pages, self.dst.num_slots, "host pool page indices", unit="host pool slots"
        )
        r, n, m = self.units_per_page, sp.size, dp.size
        if m == 0 and n == 0:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        if not (n - 1) * r < m <= n * r:
            raise DescriptorError(
                f"{n} prefill pages fill {(n - 1) * r + 1}..{n * r} host pages of this pool, "
                f"got {m}"
            )
        return self._map(sp, dp)

    def _map(
        self, src_pages: NDArray[np.int64], dst_pages: NDArray[np.int64]
    ) -> tuple[IndexArray, IndexArray]:
        r, m = self.units_per_page, dst_pages.size
        pairs = np.arange(self.num_pairs, dtype=np.int64)[:, None]
        units = (src_pages[:, None] * r + np.arange(r, dtype=np.int64)[None, :]).ravel()[:m]
        s_idx = (pairs * (self.src.num_slots * r) + units[None, :]).ravel()
        d_idx = (pairs * self.dst.num_slots + dst_pages[None, :]).ravel()
        return s_idx, d_idx
