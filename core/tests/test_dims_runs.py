"""One description of a layout (issue 27 item 1): named dims per buffer
(:mod:`kvwire.index.dims`) and the byte runs between two of them
(:mod:`kvwire.index.dims_runs`).

The oracle is today's index mappers: for random layout pairs (token- or head-major pages; K
and V in separate buffers, side by side in rows, two pages per slot, or every layer of a block
in one cross-layer buffer; MLA; TP pairs with GQA replication; page sizes; pipeline stages;
random page slots), the bytes the runs move (a NumPy reference copier) must equal, element for
element over whole pools, the bytes the default mapper's descriptor rows move, and decode's
pages must hold the element encoding of :mod:`kvwire.testing.kvfill`. A cross-layer side,
which no mapper knows, is compared through the separate-buffer pool holding the same
elements.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from kvwire.errors import DescriptorError, LayoutError
from kvwire.index import EqualTPMapper, HeadSliceMapper, MLAMapper, default_mapper_name
from kvwire.index.base import IndexMapper
from kvwire.index.dims import LAYOUTS, BufferDims, LayoutDims, cross_layer_dims, dims_of
from kvwire.index.dims_runs import RunPlan, Runs, Selection, byte_runs, token_units, tp_heads
from kvwire.index.head_rows import HeadRowsMapper
from kvwire.index.ranks import HeadSlice, source_ranks
from kvwire.layout import ModelSpec, RankPosition
from kvwire.regions import MemoryRegion
from kvwire.testing.kvfill import count_mismatches, fill_pages, make_pool, move_chunk

MAPPERS: dict[str, type[IndexMapper]] = {
    "head_rows": HeadRowsMapper,
    "equal_tp": EqualTPMapper,
    "head_slice": HeadSliceMapper,
    "mla": MLAMapper,
}
#: how a side keeps K and V (``cross``: every layer's K and V of a block in one buffer)
KINDS: dict[str, dict[str, bool]] = {
    "sep": {},
    "rows": {"kv_fused": True},
    "slot": {"kv_in_slot": True},
    "cross": {},
}
SLOTS = 16
JUNK = -7  # what decode pools hold before a move: a write outside the selection shows


def _model(heads: int, page: int, layers: int = 2, mla: bool = False) -> ModelSpec:
    return ModelSpec(
        num_layers=layers,
        total_kv_heads=1 if mla else heads,
        head_dim=4,
        dtype="int32",
        page_size=page,
        is_mla=mla,
    )


# --------------------------------------------------------------------------------------------
# Pools: a rank's layout, its arrays, and (cross-layer) the one buffer the runs address
# --------------------------------------------------------------------------------------------


class Pool:
    """A rank's pool as the mapper sees it (``layout``, ``arrays``: the oracle) and as the
    runs see it (``dims``, ``buffers``; ``views``: its per-(layer, K/V) buffers in KVLayout
    order). They are one pool except for a cross-layer side, which keeps its elements in one
    block array ``[slots, layers, 2, page, heads, dim]`` (``views`` are strided views of it)
    beside the separate K/V pool the mapper moves."""

    def __init__(
        self, model: ModelSpec, rank: RankPosition, kind: str, head_major: bool, stage: range
    ) -> None:
        self.kind = kind
        self.layout, self.arrays = make_pool(
            model, rank, SLOTS, stage.start, stage.stop, head_major=head_major, **KINDS[kind]
        )
        if kind != "cross":
            self.dims = dims_of(self.layout)
            self.buffers = self.views = self.arrays
            return
        nl = len(stage)
        page = self.arrays[0].shape[1:]  # [page, heads, dim] or [heads, page, dim]
        self.block = np.zeros((SLOTS, nl, 2, *page), dtype=np.int32)
        self.dims = cross_layer_dims(
            model,
            MemoryRegion.from_tensor(self.block),
            rank,
            stage.start,
            stage.stop,
            head_major=head_major,
        )
        self.buffers = [self.block]
        self.views = [self.block[:, i % nl, i // nl] for i in range(2 * nl)]

    def fill(self, pages: NDArray[np.int64]) -> None:
        """The element encoding of request pages ``0..`` into slots ``pages``."""
        fill_pages(self.layout, self.arrays, pages, 0)
        if self.kind == "cross":
            for view, arr in zip(self.views, self.arrays, strict=True):
                view[...] = arr

    def fill_junk(self) -> None:
        for a in (*self.buffers, *self.arrays):
            a[...] = JUNK


def copy_runs(runs: Runs, src: list[NDArray[np.int32]], dst: list[NDArray[np.int32]]) -> None:
    """The reference copier: ``dst[b][d:d+n] = src[a][s:s+n]`` for every run, as bytes, in
    one vectorised gather/scatter; checks every run lies in its buffers and no destination
    byte is written twice."""
    s_bytes = [a.reshape(-1).view(np.uint8) for a in src]
    d_bytes = [a.reshape(-1).view(np.uint8) for a in dst]
    s_len = np.array([b.size for b in s_bytes], dtype=np.int64)
    d_len = np.array([b.size for b in d_bytes], dtype=np.int64)
    n = runs.nbytes
    assert (n > 0).all()
    assert (runs.src_off >= 0).all() and (runs.src_off + n <= s_len[runs.src_buf]).all()
    assert (runs.dst_off >= 0).all() and (runs.dst_off + n <= d_len[runs.dst_buf]).all()
    s_flat, d_flat = np.concatenate(s_bytes), np.concatenate(d_bytes)
    s_at = np.concatenate([[0], np.cumsum(s_len)[:-1]])[runs.src_buf] + runs.src_off
    d_at = np.concatenate([[0], np.cumsum(d_len)[:-1]])[runs.dst_buf] + runs.dst_off
    within = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    s_pos, d_pos = np.repeat(s_at, n) + within, np.repeat(d_at, n) + within
    assert np.unique(d_pos).size == d_pos.size, "destination runs overlap"
    d_flat[d_pos] = s_flat[s_pos]
    for b, lo in zip(d_bytes, np.concatenate([[0], np.cumsum(d_len)[:-1]]), strict=True):
        b[...] = d_flat[lo : lo + b.size]


def move_both(
    spool: Pool,
    dpool_map: Pool,
    dpool_run: Pool,
    sp: NDArray[np.int64],
    dp: NDArray[np.int64],
    cuts: tuple[int, ...] = (),
    cached: int = 0,
) -> str | None:
    """One source rank's request (pages ``sp``) into a decode rank's pages ``dp`` (after a
    cached prefix of ``cached`` tokens), in chunks of chunked prefill cut at request pages
    ``cuts``, by the default mapper (into ``dpool_map``) and by the runs (into
    ``dpool_run``). The runs' selection per chunk is the chunk's units as the session hands
    them to a mapper (``chunk_slice``: pages, or with different page sizes a granule stream,
    :mod:`kvwire.index.paging`), the head slice of the TP pair (``tp_heads``). Returns the
    mapper's name, or None when this source sends nothing (replicated heads, MLA's extra
    senders, no layer in common)."""
    npages = sp.size
    slay, dlay = spool.layout, dpool_map.layout
    name = default_mapper_name(slay, dlay)
    mapper = MAPPERS[name](slay, dlay)
    heads = tp_heads(slay.model.total_kv_heads, slay.model.is_mla, slay.rank, dlay.rank)
    granule = mapper.paging.granule if mapper.paging is not None else 0
    plan = RunPlan(spool.dims, dpool_run.dims, heads, granule=granule)
    assert plan.is_empty == mapper.is_dummy, (name, plan.is_empty, mapper.is_dummy)
    if mapper.is_dummy:
        return None
    edges = [0, *cuts, npages]
    for start, end in itertools.pairwise(edges):
        units, lo, hi = mapper.chunk_slice(npages, dp, sp[start:end], start, end, cached)
        if hi <= lo:
            continue
        move_chunk(mapper, spool.arrays, dpool_map.arrays, units, dp[lo:hi])
        if mapper.paging is None:
            su, du = np.asarray(units), dp[lo:hi]
        else:
            su, du = mapper.paging.stream_granules(units, dp[lo:hi], slay.num_slots, dlay.num_slots)
        copy_runs(plan.runs(su, du), spool.buffers, dpool_run.buffers)
    return name


STAGES = {3: [range(0, 3), range(0, 2), range(1, 3), range(2, 3)], 2: [range(0, 2)]}


@settings(max_examples=250, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (4, 1), (1, 4)]),
    kinds=st.tuples(st.sampled_from(sorted(KINDS)), st.sampled_from(sorted(KINDS))),
    orders=st.tuples(st.booleans(), st.booleans()),
    pages=st.sampled_from([(4, 4), (2, 2), (4, 2), (2, 4), (4, 1), (1, 2)]),
    layers=st.sampled_from([2, 3]),
    data=st.data(),
)
def test_runs_move_what_the_mappers_move(
    heads: int,
    tp: tuple[int, int],
    kinds: tuple[str, str],
    orders: tuple[bool, bool],
    pages: tuple[int, int],
    layers: int,
    data: st.DataObject,
) -> None:
    """Random layout pairs: after every source rank's move, each decode rank's whole pool
    is the same element for element whether the default mapper's rows or the runs moved it
    (nothing written outside the selection either: pools start as junk), and its pages hold
    the encoding of the elements they should (where its layers were all sent)."""
    tp_s, tp_d = tp
    (k_s, k_d), (hm_s, hm_d), (ps_s, ps_d) = kinds, orders, pages
    st_s = data.draw(st.sampled_from(STAGES[layers]), "prefill stage")
    st_d = data.draw(st.sampled_from(STAGES[layers]), "decode stage")
    npages = data.draw(st.integers(1, 4), "pages")
    tokens = npages * ps_s
    # a prefix decode keeps cached: whole pages of both sides; chunks cut at request pages
    span = math.lcm(ps_s, ps_d)
    cached = span * data.draw(st.integers(0, (tokens - 1) // span), "cached spans")
    cut_at = st.sets(st.integers(1, npages - 1)) if npages > 1 else st.just(set[int]())
    cuts = tuple(sorted(data.draw(cut_at, "chunk cuts")))
    dpages = -(-(tokens - cached) // ps_d)
    slots = st.lists(st.integers(0, SLOTS - 1), min_size=npages, max_size=npages, unique=True)
    sp = np.array(data.draw(slots, "prefill slots"), dtype=np.int64)
    dslots = st.lists(st.integers(0, SLOTS - 1), min_size=dpages, max_size=dpages, unique=True)
    dp = np.array(data.draw(dslots, "decode slots"), dtype=np.int64)
    for dr in range(tp_d):
        drank = RankPosition(tp_size=tp_d, tp_rank=dr)
        dmap = Pool(_model(heads, ps_d, layers), drank, k_d, hm_d, st_d)
        drun = Pool(_model(heads, ps_d, layers), drank, k_d, hm_d, st_d)
        dmap.fill_junk()
        drun.fill_junk()
        names = set()
        for sr in source_ranks(dr, tp_s, tp_d):
            srank = RankPosition(tp_size=tp_s, tp_rank=sr)
            spool = Pool(_model(heads, ps_s, layers), srank, k_s, hm_s, st_s)
            spool.fill(sp)
            names.add(move_both(spool, dmap, drun, sp, dp, cuts, cached))
        for i, (a, b) in enumerate(zip(dmap.arrays, drun.views, strict=True)):
            assert np.array_equal(a, b), (dr, names, i, int((a != b).sum()))
        full = (tokens - cached) // ps_d
        if st_s.start <= st_d.start and st_d.stop <= st_s.stop and full:
            mism = count_mismatches(drun.layout, drun.views, dp[:full], cached)
            assert mism == 0, (dr, names)


@settings(max_examples=40, deadline=None)
@given(
    tp=st.sampled_from([(1, 1), (2, 1), (1, 2), (4, 1), (1, 4), (2, 4)]),
    pages=st.sampled_from([(4, 4), (4, 2), (2, 4), (1, 4)]),
    data=st.data(),
)
def test_mla_runs_move_what_the_mla_mapper_moves(
    tp: tuple[int, int], pages: tuple[int, int], data: st.DataObject
) -> None:
    """MLA (one latent per token, dims ``(slot, page, latent)``): the same check with the
    ``mla`` mapper's replicated latent and its dummy senders."""
    tp_s, tp_d = tp
    npages = data.draw(st.integers(1, 3), "pages")
    dpages = -(-npages * pages[0] // pages[1])
    sp = np.array(data.draw(st.permutations(range(SLOTS)))[:npages], dtype=np.int64)
    dp = np.array(data.draw(st.permutations(range(SLOTS)))[:dpages], dtype=np.int64)
    for dr in range(tp_d):
        drank = RankPosition(tp_size=tp_d, tp_rank=dr)
        dmap = Pool(_model(1, pages[1], mla=True), drank, "sep", False, range(0, 2))
        drun = Pool(_model(1, pages[1], mla=True), drank, "sep", False, range(0, 2))
        assert drun.dims.buffers[0].names == LAYOUTS["mla"]
        dmap.fill_junk()
        drun.fill_junk()
        sent = 0
        for sr in source_ranks(dr, tp_s, tp_d):
            spool = Pool(
                _model(1, pages[0], mla=True),
                RankPosition(tp_size=tp_s, tp_rank=sr),
                "sep",
                False,
                range(0, 2),
            )
            spool.fill(sp)
            sent += move_both(spool, dmap, drun, sp, dp) == "mla"
        assert sent == 1
        for a, b in zip(dmap.arrays, drun.arrays, strict=True):
            assert np.array_equal(a, b)
        full = npages * pages[0] // pages[1]
        assert count_mismatches(drun.layout, drun.arrays, dp[:full], 0) == 0


# --------------------------------------------------------------------------------------------
# Coalescing: whole pages are as few runs as the memory allows
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sep", "rows", "slot"])
@pytest.mark.parametrize("head_major", [False, True])
def test_whole_consecutive_pages_are_one_run_per_buffer(kind: str, head_major: bool) -> None:
    """Equal layouts, equal TP: N consecutive pages into N consecutive pages are one run per
    buffer (a K|V buffer's slot holds both halves: one run); scattered pages one per page."""
    m = _model(4, 4)
    a = Pool(m, RankPosition(tp_size=2), kind, head_major, range(0, 2))
    b = Pool(m, RankPosition(tp_size=2), kind, head_major, range(0, 2))
    nbuf = len(a.layout.buffers)
    runs = byte_runs(a.dims, b.dims, Selection(np.arange(2, 7), np.arange(1, 6)))
    assert len(runs) == nbuf
    assert runs.nbytes.tolist() == [5 * a.layout.slot_bytes] * nbuf
    assert runs.src_off.tolist() == [2 * a.layout.slot_bytes] * nbuf
    scattered = byte_runs(a.dims, b.dims, Selection(np.array([0, 2, 4]), np.array([1, 2, 3])))
    assert len(scattered) == 3 * nbuf
    # the pages plus a gap on one side only: two runs per buffer
    gap = byte_runs(a.dims, b.dims, Selection(np.array([0, 1, 3]), np.array([4, 5, 6])))
    assert len(gap) == 2 * nbuf


def test_cross_layer_moves_one_run_per_block() -> None:
    """vLLM's cross-layer blocks on both sides: a request is one run per block (one run in
    all when the blocks are consecutive on both sides), every layer and K/V inside."""
    m = _model(4, 4, layers=3)
    a = Pool(m, RankPosition(), "cross", False, range(0, 3))
    b = Pool(m, RankPosition(), "cross", False, range(0, 3))
    assert a.dims.buffers[0].names == LAYOUTS["cross_layer"]
    block = a.block[0].nbytes
    runs = byte_runs(a.dims, b.dims, Selection(np.array([5, 1, 3, 6]), np.array([0, 2, 4, 6])))
    assert len(runs) == 4 and runs.nbytes.tolist() == [block] * 4
    assert (runs.src_off // block).tolist() == [5, 1, 3, 6]
    src_addr, dst_addr = runs.addresses(a.dims, b.dims)
    assert src_addr.tolist() == [a.block.ctypes.data + s * block for s in (5, 1, 3, 6)]
    assert dst_addr.tolist() == [b.block.ctypes.data + s * block for s in (0, 2, 4, 6)]
    assert len(byte_runs(a.dims, b.dims, Selection(np.arange(4), np.arange(3, 7)))) == 1
    # into per-layer buffers: one run per (layer, K/V, page): a layer's pages of
    # consecutive blocks are a block apart on the source
    c = Pool(m, RankPosition(), "sep", False, range(0, 3))
    into = byte_runs(a.dims, c.dims, Selection(np.arange(4), np.arange(3, 7)))
    assert len(into) == 6 * 4 and set(into.nbytes.tolist()) == {c.layout.slot_bytes}


def test_head_slices_are_one_run_per_token() -> None:
    """TP 1 -> 2 (token-major): each token's head slice is a run of its own on the source
    (other heads between), and nothing coalesces across tokens."""
    m = _model(4, 4)
    a = Pool(m, RankPosition(tp_size=1), "sep", False, range(0, 2))
    b = Pool(m, RankPosition(tp_size=2, tp_rank=1), "sep", False, range(0, 2))
    cut = tp_heads(4, False, a.layout.rank, b.layout.rank)
    runs = byte_runs(a.dims, b.dims, Selection(np.arange(3), np.arange(3), heads=cut))
    assert len(runs) == 4 * 3 * 4  # buffers x pages x tokens
    assert set(runs.nbytes.tolist()) == {2 * 16}
    assert (runs.src_off % (4 * 16) == 2 * 16).all()  # heads 2 and 3 of each token row


def test_layer_and_kv_selections_partition_the_move() -> None:
    """Selecting layers and K/V picks exactly those runs: the per-(layer, K/V) moves are
    disjoint and their union is the whole move (layer-wise streaming sends them apart)."""
    m = _model(2, 4, layers=3)
    a = Pool(m, RankPosition(), "rows", True, range(0, 3))
    b = Pool(m, RankPosition(), "cross", False, range(0, 3))
    whole = byte_runs(a.dims, b.dims, Selection(np.arange(2), np.array([4, 1])))
    parts = [
        byte_runs(
            a.dims, b.dims, Selection(np.arange(2), np.array([4, 1]), layers=(L, L + 1), kv=(k,))
        )
        for L in range(3)
        for k in (0, 1)
    ]

    def spans(r: Runs) -> set[tuple[int, int]]:
        out = set()
        for s, n in zip(r.dst_off.tolist(), r.nbytes.tolist(), strict=True):
            out |= {(s + i, 0) for i in range(0, n, 16)}
        return out

    union = set().union(*(spans(p) for p in parts))
    assert union == spans(whole)
    assert sum(p.total_bytes for p in parts) == whole.total_bytes
    assert (
        byte_runs(a.dims, b.dims, Selection(np.arange(2), np.arange(2), layers=(5, 6))).nbytes.size
        == 0
    )


@pytest.mark.parametrize(("kind", "head_major"), [("sep", False), ("rows", True), ("cross", False)])
def test_token_range(kind: str, head_major: bool) -> None:
    """Tokens [3, 10) of a request of 4-token pages into 2-token pages (token-granular
    units): exactly those tokens land, each where the whole move puts it; the rest of the
    decode pool stays untouched."""
    m4, m2 = _model(2, 4), _model(2, 2)
    src = Pool(m4, RankPosition(), kind, head_major, range(0, 2))
    sp = np.array([5, 0, 3])
    src.fill(sp)
    dp = np.array([7, 1, 2, 9, 4, 11])
    whole, part = (Pool(m2, RankPosition(), "sep", False, range(0, 2)) for _ in range(2))
    for pool in (whole, part):
        pool.fill_junk()
    copy_runs(
        byte_runs(
            src.dims,
            whole.dims,
            Selection(token_units(sp, 4, 0, 12), token_units(dp, 2, 0, 12), granule=1),
        ),
        src.buffers,
        whole.buffers,
    )
    assert count_mismatches(whole.layout, whole.arrays, dp, 0) == 0
    sel = Selection(token_units(sp, 4, 3, 10), token_units(dp, 2, 3, 10), granule=1)
    copy_runs(byte_runs(src.dims, part.dims, sel), src.buffers, part.buffers)
    for w, p in zip(whole.arrays, part.arrays, strict=True):  # [slots, page, heads, dim]
        tok = np.arange(12)
        slot, off = dp[tok // 2], tok % 2
        inside = (tok >= 3) & (tok < 10)
        assert (p[slot[inside], off[inside]] == w[slot[inside], off[inside]]).all()
        assert (p[slot[~inside], off[~inside]] == JUNK).all()
        others = np.setdiff1d(np.arange(SLOTS), dp)
        assert (p[others] == JUNK).all()
    assert token_units(np.array([2, 6]), 4, 2, 8, 2).tolist() == [2 * 2 + 1, 6 * 2, 6 * 2 + 1]
    with pytest.raises(LayoutError, match="granule"):
        token_units(sp, 4, 1, 4, 2)
    with pytest.raises(LayoutError, match="not inside"):
        token_units(sp, 4, 0, 13)


# --------------------------------------------------------------------------------------------
# Descriptions and the validation rule
# --------------------------------------------------------------------------------------------


def test_dims_of_every_layout_flag() -> None:
    m = _model(4, 4)
    r = RankPosition(tp_size=2)
    want = {
        ("sep", False): "nhd",
        ("sep", True): "hnd",
        ("rows", False): "nhd_fused",
        ("rows", True): "hnd_fused",
        ("slot", False): "nhd_in_slot",
        ("slot", True): "hnd_in_slot",
    }
    for (kind, hm), name in want.items():
        lay, arrays = make_pool(m, r, SLOTS, head_major=hm, **KINDS[kind])
        d = dims_of(lay)
        b = d.buffers[0]
        assert b.names == LAYOUTS[name]
        assert b.sizes == arrays[0].shape  # the pool's own shape, dim by dim
        assert b.strides == arrays[0].strides
        assert [x.addr for x in d.buffers] == [a.ctypes.data for a in arrays]
        assert (d.page_size, d.heads, d.head_bytes, d.num_slots) == (4, 2, 16, SLOTS)
        keys = {(layer, kv) for x in d.buffers for layer in x.layers for kv in x.kvs}
        assert keys == {(layer, kv) for layer in range(2) for kv in (0, 1)}
    lay, _ = make_pool(_model(1, 4, mla=True), r, SLOTS)
    assert dims_of(lay).is_latent and dims_of(lay).heads == 1


def _buf(
    names: tuple[str, ...], sizes: tuple[int, ...], strides: tuple[int, ...], **kw: int
) -> BufferDims:
    return BufferDims(
        names,
        sizes,
        strides,
        elem=kw.pop("elem", 2),
        addr=0,
        length=kw.pop("length", 1 << 20),
        **kw,
    )


@pytest.mark.parametrize(
    ("buf", "match"),
    [
        (_buf(("page", "head", "dim"), (4, 2, 8), (32, 16, 2)), "lack 'slot'"),
        (_buf(("slot", "head", "dim"), (4, 2, 8), (64, 16, 2)), "lack 'page'"),
        (_buf(("slot", "page", "dim", "head"), (4, 4, 8, 2), (128, 32, 4, 2)), "end in 'dim'"),
        (_buf(("slot", "page", "latent", "dim"), (4, 4, 8, 2), (128, 32, 4, 2)), "end in"),
        (_buf(("slot", "page", "head", "latent"), (4, 4, 2, 8), (256, 32, 16, 2)), "no 'head'"),
        (
            _buf(("slot", "page", "head", "kv", "dim"), (4, 4, 2, 3, 8), (768, 96, 48, 16, 2)),
            "size 2",
        ),
        (_buf(("slot", "page", "head", "dim"), (4, 4, 2, 8), (128, 32, 16, 4)), "contiguous"),
        (_buf(("slot", "page", "head", "dim"), (4, 4, 2, 8), (128, 16, 16, 2)), "overlap"),
        (_buf(("slot", "page", "head", "dim"), (4, 4, 0, 8), (128, 32, 16, 2)), "positive"),
        (
            _buf(("slot", "page", "head", "dim"), (64, 4, 2, 8), (128, 32, 16, 2), length=4096),
            "past",
        ),
        (
            _buf(("slot", "page", "head", "dim", "dim"), (4, 4, 2, 8, 1), (128, 32, 16, 2, 2)),
            "distinct",
        ),
        (_buf(("slot", "page", "head", "dims"), (4, 4, 2, 8), (128, 32, 16, 2)), "unknown"),
        (
            _buf(("slot", "page", "head", "dim"), (4, 4, 2, 8), (128, 32, 16, 2), kv=2),
            "K \\(0\\) or V",
        ),
    ],
)
def test_validation_rule(buf: BufferDims, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        buf.check()


def test_layout_checks_and_pair_refusals() -> None:
    ok = _buf(("slot", "page", "head", "dim"), (4, 4, 2, 8), (128, 32, 16, 2))
    LayoutDims((ok,))
    with pytest.raises(LayoutError, match="held by two buffers"):
        LayoutDims((ok, ok))
    other = _buf(("slot", "page", "head", "dim"), (4, 2, 2, 8), (64, 32, 16, 2), first_layer=1)
    with pytest.raises(LayoutError, match="size of 'page'"):
        LayoutDims((ok, other))
    a, b = LayoutDims((ok,)), LayoutDims((replace(other, first_layer=0),))
    with pytest.raises(LayoutError, match="granule"):
        RunPlan(a, b)
    RunPlan(a, b, granule=2)
    four = LayoutDims((_buf(("slot", "page", "head", "dim"), (4, 4, 4, 8), (256, 64, 16, 2)),))
    with pytest.raises(LayoutError, match="head slice"):
        RunPlan(a, four)
    with pytest.raises(LayoutError, match="does not fit"):
        RunPlan(four, a, heads=HeadSlice(4, 2, 2, 3, 0, True))
    mla = LayoutDims((_buf(("slot", "page", "latent"), (4, 4, 8), (64, 16, 2)),))
    with pytest.raises(LayoutError, match="heads differ"):
        RunPlan(a, mla)
    with pytest.raises(DescriptorError, match="units"):
        RunPlan(a, a).runs(np.array([4]), np.array([0]))
    with pytest.raises(DescriptorError, match="1 source units but 2"):
        RunPlan(a, a).runs(np.array([1]), np.array([0, 1]))
    m = _model(4, 4)
    with pytest.raises(LayoutError, match="cross-layer block"):
        cross_layer_dims(m, MemoryRegion.from_pointer(4096, 4096, 512))
    with pytest.raises(LayoutError, match="plane view"):
        from kvwire.index.planes import split_kv

        dims_of(split_kv(make_pool(m, RankPosition(), 4, kv_fused=True)[0]))
