"""The page form of a chunk (:mod:`kvwire.page_form`): for every layout pair a core mapper
serves, the page form (where the mapper gives one) stands for exactly the rows ``map_chunk``
returns, its byte geometry matches the tables' addresses, its checks refuse bad pages and
geometries, and the NumPy reference of the pool-to-pool page mover copies what the rows
copy. Pure NumPy; the whole file runs in about a second."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.descriptors import ADDR, LEN
from kvwire.errors import DescriptorError
from kvwire.index import EqualTPMapper, HeadSliceMapper, IndexMapper, MLAMapper, default_mapper_name
from kvwire.index.head_rows import HeadRowsMapper
from kvwire.index.ranks import source_ranks
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.movers.plan import copy_runs_reference
from kvwire.movers.pool_pages import copy_pool_pages_reference, pool_page_runs
from kvwire.page_form import PageChunk, check_geometry_addresses, check_page_chunk
from kvwire.testing.kvfill import make_pool

MAPPERS: dict[str, type[IndexMapper]] = {
    "equal_tp": EqualTPMapper,
    "mla": MLAMapper,
    "head_slice": HeadSliceMapper,
    "head_rows": HeadRowsMapper,
}
SLOTS = 6


def link(
    heads: int,
    tp: tuple[int, int],
    ranks: tuple[int, int],
    mla: bool = False,
    pages: tuple[int, int] = (4, 4),
    head_major: tuple[bool, bool] = (False, False),
    kv_fused: tuple[bool, bool] = (False, False),
    keep: list[object] | None = None,
) -> tuple[IndexMapper, KVLayout, KVLayout]:
    """A link's mapper and layouts; the pools' memory is freed unless ``keep`` (a list the
    caller holds) takes it."""

    def side(i: int) -> KVLayout:
        model = ModelSpec(
            num_layers=3, total_kv_heads=heads, head_dim=4, dtype="int32",
            page_size=pages[i], is_mla=mla,
        )  # fmt: skip
        pos = RankPosition(tp_size=tp[i], tp_rank=ranks[i])
        layout, arrays = make_pool(
            model, pos, SLOTS, head_major=head_major[i], kv_fused=kv_fused[i]
        )
        if keep is not None:
            keep.append(arrays)
        return layout

    src, dst = side(0), side(1)
    return MAPPERS[default_mapper_name(src, dst)](src, dst), src, dst


@st.composite
def links(draw: st.DrawFn) -> tuple[IndexMapper, KVLayout, KVLayout]:
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    tp = (draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4])))
    d = draw(st.integers(0, tp[1] - 1))
    s = draw(st.sampled_from(list(source_ranks(d, tp[0], tp[1])))) if not mla else 0
    s = draw(st.integers(0, tp[0] - 1)) if mla else s
    pages = draw(st.sampled_from([(4, 4), (4, 4), (4, 8), (8, 4)]))
    hm = (draw(st.booleans()), draw(st.booleans())) if draw(st.booleans()) else (False, False)
    fused = (draw(st.booleans()), False) if not mla and draw(st.booleans()) else (False, False)
    try:
        return link(heads, tp, (s, d), mla, pages, hm, fused)
    except Exception as exc:  # a pair no core mapper serves (e.g. MLA head-major)
        from hypothesis import reject

        assert "LayoutError" in type(exc).__name__ or "Validation" in type(exc).__name__, exc
        reject()


@settings(max_examples=80, deadline=None)
@given(lk=links(), data=st.data())
def test_page_form_stands_for_the_rows(
    lk: tuple[IndexMapper, KVLayout, KVLayout], data: st.DataObject
) -> None:
    mapper = lk[0]
    p = mapper.paging
    most = SLOTS if p is None else max(1, min(SLOTS, SLOTS * p.src_granules // p.dst_granules))
    n = data.draw(st.integers(1, most))
    dp = np.array(data.draw(st.permutations(range(SLOTS)))[:n], dtype=np.int64)
    if p is None:
        sp = np.array(data.draw(st.permutations(range(SLOTS)))[:n], dtype=np.int64)
    else:  # a granule stream filling the n decode pages (its head maybe written before: -1)
        r = p.dst_granules
        size = data.draw(st.integers((n - 1) * r + 1, n * r))
        skip = data.draw(st.integers(0, min(r - 1, size - 1)))
        ids = data.draw(st.permutations(range(SLOTS * p.src_granules)))[: size - skip]
        sp = np.array([-1] * skip + list(ids), dtype=np.int64)
    chunk = mapper.page_chunk(sp, dp)
    regular = not (mapper.is_dummy or mapper.splits_kv or (p and mapper.name == "head_rows"))
    assert (chunk is not None) == regular, (mapper.name, mapper.paging, mapper.is_dummy)
    if chunk is None:
        return
    rows = mapper.map_chunk(sp, dp)
    got = chunk.rows()
    assert np.array_equal(got[0], rows[0]) and np.array_equal(got[1], rows[1])
    # the byte geometry is the tables' own: each row's address and length
    tables = mapper.build_tables()
    g = chunk.geometry
    s_addr = tables.src[g.src_rows, ADDR].astype(np.int64)
    d_addr = tables.dst[g.dst_rows, ADDR].astype(np.int64)
    s_runs, d_runs, lens = pool_page_runs(chunk, s_addr, d_addr)
    assert np.array_equal(s_runs, tables.src[rows[0], ADDR].astype(np.int64))
    assert np.array_equal(d_runs, tables.dst[rows[1], ADDR].astype(np.int64))
    assert np.array_equal(lens, tables.src[rows[0], LEN].astype(np.int64))
    assert np.array_equal(lens, tables.dst[rows[1], LEN].astype(np.int64))
    assert chunk.nbytes == int(tables.src[rows[0], LEN].sum())
    assert check_page_chunk(chunk, tables.src[:, LEN], tables.dst[:, LEN]) == chunk.nbytes
    check_geometry_addresses(
        g, tables.src[:, ADDR].astype(np.int64), tables.dst[:, ADDR].astype(np.int64)
    )


def test_reference_mover_copies_what_the_rows_copy() -> None:
    """The pool-page reference against a row-by-row copy through the tables, in one arena
    (source pool and destination pool of a TP 2 -> 1 head slice and of equal TP)."""
    rng = np.random.default_rng(7)
    for tp, ranks in (((2, 1), (1, 0)), ((1, 1), (0, 0)), ((1, 2), (0, 1))):
        pools: list[object] = []  # both pools stay allocated: their ranges never overlap
        mapper, src, dst = link(4, tp, ranks, keep=pools)
        tables = mapper.build_tables()
        # a private arena holding every buffer of both pools one after the other (the
        # buffers themselves may lie terabytes apart), filled at random
        regions = [*src.buffers, *dst.buffers]
        starts = np.array([r.addr for r in regions], dtype=np.int64)
        order = np.argsort(starts)
        bases = np.cumsum([0] + [r.length for r in regions])[:-1]

        def at(addr: np.ndarray, starts: np.ndarray = starts, order: np.ndarray = order,
               bases: np.ndarray = bases) -> np.ndarray:  # fmt: skip
            i = order[np.searchsorted(starts[order], addr, side="right") - 1]
            return np.asarray(addr - starts[i] + bases[i], dtype=np.int64)

        arena = rng.integers(0, 256, sum(r.length for r in regions), dtype=np.uint8)
        sp, dp = np.array([4, 0, 2]), np.array([1, 5, 3])
        chunk = mapper.page_chunk(sp, dp)
        assert chunk is not None
        g = chunk.geometry
        s_addr = at(tables.src[g.src_rows, ADDR].astype(np.int64))
        d_addr = at(tables.dst[g.dst_rows, ADDR].astype(np.int64))
        want = arena.copy()
        si, di = mapper.map_chunk(sp, dp)
        copy_runs_reference(
            want,
            at(tables.src[si, ADDR].astype(np.int64)),
            at(tables.dst[di, ADDR].astype(np.int64)),
            tables.src[si, LEN].astype(np.int64),
        )
        got = arena.copy()
        assert copy_pool_pages_reference(got, chunk, s_addr, d_addr) == chunk.nbytes
        assert np.array_equal(got, want) and not np.array_equal(got, arena), tp


def test_bad_pages_and_geometries_are_refused() -> None:
    mapper, _, _ = link(4, (2, 1), (0, 0))
    tables = mapper.build_tables()
    sl, dl = tables.src[:, LEN], tables.dst[:, LEN]
    with pytest.raises(DescriptorError, match="source page indices out of range"):
        mapper.page_chunk([0, SLOTS], [1, 2])
    with pytest.raises(DescriptorError, match="2 source pages but 1 destination"):
        mapper.page_chunk([0, 1], [1])
    assert mapper.page_chunk([], []) is None
    chunk = mapper.page_chunk([0, 1], [2, 3])
    assert chunk is not None
    assert chunk.checked  # the mapper checked its pages: a submit checks only the geometry
    g = chunk.geometry
    bad = PageChunk(g, np.array([0, 1]), np.array([2, SLOTS + 3]))
    assert not bad.checked  # built by hand: its pages are checked at submit
    with pytest.raises(DescriptorError, match="destination page indices out of range"):
        check_page_chunk(bad, sl, dl)
    with pytest.raises(DescriptorError, match="no page"):
        check_page_chunk(PageChunk(g, np.array([], np.int64), np.array([], np.int64)), sl, dl)
    with pytest.raises(DescriptorError, match="reaches remote table rows"):
        check_page_chunk(chunk, sl, dl[:-1])  # a smaller table than the geometry's
    with pytest.raises(DescriptorError, match=r"has \d+ bytes"):
        check_page_chunk(chunk, sl, dl * np.uint64(2))
    # a geometry that passed against one pair's tables is checked again against others
    # (only a chunk's page indices are checked anew against the tables it passed with)
    assert check_page_chunk(chunk, sl, dl) == chunk.nbytes
    with pytest.raises(DescriptorError, match="reaches remote table rows"):
        check_page_chunk(chunk, sl, dl[:-1].copy())
    with pytest.raises(DescriptorError, match="destination page indices out of range"):
        check_page_chunk(bad, sl, dl)
    # strides that are not the tables' (a geometry of another link) are refused
    sa, da = tables.src[:, ADDR].astype(np.int64), tables.dst[:, ADDR].astype(np.int64)
    check_geometry_addresses(g, sa, da)
    for field, delta in (("src_slot", 16), ("dst_row", 4), ("src_row", -8)):
        wrong = dataclasses.replace(g, **{field: getattr(g, field) + delta})
        with pytest.raises(DescriptorError, match="not this pair's tables"):
            check_geometry_addresses(wrong, sa, da)


def test_which_links_have_a_page_form() -> None:
    """Whole pages, head slices, head-major pages (one piece per token and head) and
    different page sizes on token-major pages (granules as the pages) do; dummies, K and V
    as planes and a head-major side with another page size keep rows."""
    have = {
        "equal TP": link(4, (2, 2), (1, 1)),
        "TP 2 -> 1": link(4, (2, 1), (1, 0)),
        "TP 1 -> 2": link(4, (1, 2), (0, 1)),
        "GQA replication": link(2, (1, 4), (0, 3)),
        "MLA sender": link(1, (2, 1), (0, 0), mla=True),
        "head-major TP 2 -> 1": link(4, (2, 1), (0, 0), head_major=(True, False)),
        "head-major decode": link(4, (2, 2), (1, 1), head_major=(False, True)),
        "head-major TP 1 -> 2": link(4, (1, 2), (0, 1), head_major=(True, True)),
        "page sizes 4 -> 8": link(4, (1, 1), (0, 0), pages=(4, 8)),
        "page sizes 8 -> 4, TP 2 -> 1": link(4, (2, 1), (1, 0), pages=(8, 4)),
    }
    rows = {
        "MLA dummy": link(1, (2, 1), (1, 0), mla=True),
        "head-major page sizes": link(4, (1, 1), (0, 0), pages=(4, 8), head_major=(True, False)),
        "kv_fused": link(4, (1, 1), (0, 0), kv_fused=(True, False)),
    }
    for name, (mapper, _, _) in have.items():
        p = mapper.paging
        # two decode pages: their granule stream, else two source pages
        sp = [0, 1] if p is None else list(range(2 * p.dst_granules))
        chunk = mapper.page_chunk(sp, [2, 3])
        assert chunk is not None and chunk.num_rows == mapper.map_chunk(sp, [2, 3])[0].size
        assert (chunk.geometry.heads > 1) == name.startswith("head-major"), name
    for name, (mapper, _, _) in rows.items():
        p = mapper.paging
        sp = [0, 1] if p is None else list(range(2 * p.dst_granules))
        assert mapper.page_chunk(sp, [2, 3]) is None, name


def test_head_major_geometry_checks() -> None:
    """A head-major link's geometry (pieces per token and head): its head strides are the
    tables' own, a wrong one is refused, and its extent is checked against the tables."""
    mapper, _, _ = link(4, (2, 2), (1, 1), head_major=(False, True))
    chunk = mapper.page_chunk([0, SLOTS - 1], [SLOTS - 1, 2])
    assert chunk is not None
    g = chunk.geometry
    assert g.heads == 2 and g.src_head != g.dst_head  # token-major source, head-major dest
    tables = mapper.build_tables()
    sa, da = tables.src[:, ADDR].astype(np.int64), tables.dst[:, ADDR].astype(np.int64)
    sl, dl = tables.src[:, LEN], tables.dst[:, LEN]
    check_geometry_addresses(g, sa, da)
    assert check_page_chunk(chunk, sl, dl) == chunk.nbytes
    for field, delta in (("src_head", 4), ("dst_head", -4), ("dst_head_rows", 1)):
        wrong = dataclasses.replace(g, **{field: getattr(g, field) + delta})
        with pytest.raises(DescriptorError, match=r"not this pair's tables|reaches past"):
            check_geometry_addresses(wrong, sa, da)
    too_many = dataclasses.replace(g, heads=g.heads + 1)
    with pytest.raises(DescriptorError, match=r"reaches (local|remote) table rows"):
        check_page_chunk(chunk.__class__(too_many, chunk.src_pages, chunk.dst_pages), sl, dl)
    with pytest.raises(DescriptorError, match="negative"):
        bad = dataclasses.replace(g, src_head_rows=-1)
        check_page_chunk(chunk.__class__(bad, chunk.src_pages, chunk.dst_pages), sl, dl)
