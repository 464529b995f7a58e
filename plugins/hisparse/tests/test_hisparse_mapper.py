"""The host-pool mapper: tables inside the pools, every byte of a chunk where it belongs
(page size 1 and a divisor of prefill's), trimming, refusals."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from kvwire_hisparse.mapper import HostPoolMapper

from kvwire.descriptors import ADDR, LEN
from kvwire.errors import DescriptorError, LayoutError
from kvwire.layout import ModelSpec, RankPosition
from kvwire.selection import select_mapper
from kvwire.testing.kvfill import fill_pages, make_pool, page_values

MODEL = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype="int32", page_size=4)


def host_model(ps: int) -> ModelSpec:
    return MODEL.model_copy(update={"page_size": ps})


def copy_rows(tables: object, s_idx: np.ndarray, d_idx: np.ndarray) -> None:
    """What a backend does with the rows (a local memmove per row)."""
    src, dst = tables.src, tables.dst  # type: ignore[attr-defined]
    for s, d in zip(s_idx.tolist(), d_idx.tolist(), strict=True):
        assert src[s, LEN] == dst[d, LEN]
        ctypes.memmove(int(dst[d, ADDR]), int(src[s, ADDR]), int(src[s, LEN]))


@pytest.mark.parametrize("host_ps", [1, 2, 4])
def test_every_token_lands_in_its_host_page(host_ps: int) -> None:
    pl, parr = make_pool(MODEL, RankPosition(), 16)
    hl, harr = make_pool(host_model(host_ps), RankPosition(), 64)
    mapper = select_mapper("hisparse").cls(pl, hl)
    assert isinstance(mapper, HostPoolMapper) and mapper.units_per_page == 4 // host_ps
    tables = mapper.build_tables()
    src = np.array([7, 2, 11])
    fill_pages(pl, parr, src, 0)
    r = mapper.units_per_page
    m = 3 * r - (r - 1)  # the last prefill page trimmed to its first unit
    dst = np.random.default_rng(0).choice(64, m, replace=False)
    s_idx, d_idx = mapper.map_chunk(src, dst)
    copy_rows(tables, s_idx, d_idx)
    for b, arr in enumerate(harr):
        assert np.array_equal(arr[dst], page_values(hl, b, 0, m)), b


def test_refusals() -> None:
    pl, _ = make_pool(MODEL, RankPosition(), 8)
    with pytest.raises(LayoutError, match="must divide"):
        HostPoolMapper(pl, make_pool(host_model(3), RankPosition(), 8)[0])
    with pytest.raises(LayoutError, match="head_dim"):
        HostPoolMapper(
            pl, make_pool(host_model(1).model_copy(update={"head_dim": 4}), RankPosition(), 8)[0]
        )
    hl, _ = make_pool(host_model(1), RankPosition(), 32)
    mapper = HostPoolMapper(pl, hl)
    with pytest.raises(DescriptorError, match=r"fill 5\.\.8 host pages"):
        mapper.map_chunk([1, 2], [0, 1, 2])  # too few: would leave a page unfilled
    with pytest.raises(DescriptorError, match="host pool"):
        mapper.map_chunk([1], [0, 1, 2, 99])
    s, d = mapper.map_chunk([], [])
    assert s.size == d.size == 0
