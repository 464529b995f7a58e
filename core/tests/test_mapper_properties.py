"""Property-based tests of the index mappers: simulated prefill -> decode KV moves.

Every prefill byte encodes (layer, K/V, global head, token position, byte index). The tests move
a request's pages from simulated prefill ranks to simulated decode ranks through each mapper's
descriptor tables and index arrays, then check that every decode rank holds exactly the shard it
should, byte for byte, and that nothing else in decode memory changed.

No network and no backend: a "transfer" is row ``si[k]`` of the source table copied to row
``di[k]`` of the destination table, with addresses resolved into NumPy arenas.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from kvwire.errors import DescriptorError, LayoutError
from kvwire.index import (
    EqualTPMapper,
    HeadSliceMapper,
    IndexMapper,
    MLAMapper,
    TablePair,
    default_mapper_name,
    source_ranks,
    target_ranks,
)
from kvwire.layout import DTYPE_SIZES, KVLayout, ModelSpec, RankPosition

MAPPERS: dict[str, type[IndexMapper]] = {
    "equal_tp": EqualTPMapper,
    "mla": MLAMapper,
    "head_slice": HeadSliceMapper,
}
TP_SIZES = (1, 2, 4, 8)
DTYPES = ("uint8", "float16", "bfloat16", "float32")
GAP = 8  # bytes of sentinel between two buffers of an arena
JUNK = 1 << 20  # "position" of token rows that belong to no request token

PROPERTY_SETTINGS = settings(max_examples=60, deadline=None)

U64 = np.uint64


# --------------------------------------------------------------------------------------------
# Byte encoding
# --------------------------------------------------------------------------------------------


def encode(
    layer: int, kv: int, heads: NDArray[np.int64], positions: NDArray[np.int64], nbytes: int
) -> NDArray[np.uint8]:
    """Bytes of token rows: shape ``positions.shape + (len(heads), nbytes)``.

    A mixed hash of (layer, kv, global head, token position, byte index), so a byte taken from
    the wrong layer, K/V, head, token, page or offset almost surely differs.
    """
    pos = np.asarray(positions, dtype=U64)[..., None, None]
    hd = np.asarray(heads, dtype=U64)[:, None]
    by = np.arange(nbytes, dtype=U64)
    salt = U64(1 + layer * 0x3C6EF372 + kv * 0x7F4A7C15)
    x = pos * U64(0x9E3779B97F4A7C15) + hd * U64(0xC2B2AE3D27D4EB4F) + by * U64(0x165667B1)
    x = x + salt
    x ^= x >> U64(33)
    x *= U64(0xFF51AFD7ED558CCD)
    x ^= x >> U64(33)
    x *= U64(0xC4CEB9FE1A85EC53)
    x ^= x >> U64(33)
    return (x & U64(0xFF)).astype(np.uint8)


# --------------------------------------------------------------------------------------------
# Simulated instances
# --------------------------------------------------------------------------------------------


@dataclass
class Rank:
    """One simulated rank: its layout, its buffers and the global heads it holds."""

    layout: KVLayout
    arrays: list[NDArray[np.uint8]]
    keys: list[tuple[int, int]]  # (layer, kv) of each buffer, in layout order
    heads: NDArray[np.int64]

    def bounds(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        starts = np.array(sorted(a.ctypes.data for a in self.arrays), dtype=U64)
        return starts, starts + U64(self.arrays[0].nbytes)


@dataclass
class Side:
    """One simulated instance: every buffer of every rank is a view into one arena."""

    arena: NDArray[np.uint8]
    ranks: dict[tuple[int, int], Rank]  # (pp_rank, tp_rank) -> rank

    def offset(self, arr: NDArray[np.uint8]) -> int:
        return int(arr.ctypes.data - self.arena.ctypes.data)

    def view(self, other: NDArray[np.uint8], like: NDArray[np.uint8]) -> NDArray[np.uint8]:
        """The view of ``other`` (an arena-sized copy) that ``like`` occupies in the arena."""
        off = self.offset(like)
        return other[off : off + like.nbytes].reshape(like.shape)


def global_heads(model: ModelSpec, tp: int, tp_rank: int) -> NDArray[np.int64]:
    """Global KV heads held by ``tp_rank`` (replicated ranks hold the same heads)."""
    h = model.total_kv_heads
    local = 1 if model.is_mla else max(1, h // tp)
    return (tp_rank // max(1, tp // h)) * local + np.arange(local, dtype=np.int64)


def build_side(model: ModelSpec, tp: int, num_slots: int, stages: list[tuple[int, int]]) -> Side:
    """All ranks of an instance with ``tp`` TP ranks and PP stages holding ``stages`` layers."""
    local = 1 if model.is_mla else max(1, model.total_kv_heads // tp)
    bph = model.head_dim * model.dtype_size
    buf_bytes = num_slots * model.page_size * local * bph
    kinds = (0,) if model.is_mla else (0, 1)
    n_bufs = tp * sum((end - start) * len(kinds) for start, end in stages)
    arena = np.zeros(GAP + n_bufs * (buf_bytes + GAP), dtype=np.uint8)
    ranks: dict[tuple[int, int], Rank] = {}
    off = GAP
    for p, (start, end) in enumerate(stages):
        for r in range(tp):
            keys = [(layer, kv) for kv in kinds for layer in range(start, end)]
            arrays = []
            for _ in keys:
                view = arena[off : off + buf_bytes].reshape(num_slots, model.page_size, local, bph)
                arrays.append(view)
                off += buf_bytes + GAP
            pos = RankPosition(tp_size=tp, tp_rank=r, pp_size=len(stages), pp_rank=p)
            layout = KVLayout.from_tensors(
                model, arrays, rank=pos, start_layer=start, end_layer=end
            )
            assert layout.local_kv_heads == local
            assert layout.num_slots == num_slots
            ranks[(p, r)] = Rank(layout, arrays, keys, global_heads(model, tp, r))
    return Side(arena, ranks)


# --------------------------------------------------------------------------------------------
# Table checks and the simulated copy
# --------------------------------------------------------------------------------------------


def assert_table(table: NDArray[np.uint64], rank: Rank, what: str) -> None:
    """An (N, 3) uint64 table whose every row lies inside one buffer of ``rank``."""
    assert isinstance(table, np.ndarray), what
    assert table.ndim == 2 and table.shape[1] == 3, f"{what}: shape {table.shape}"
    assert table.dtype == np.uint64, f"{what}: dtype {table.dtype}"
    assert table.shape[0] > 0, f"{what}: empty"
    addr, length = table[:, 0], table[:, 1]
    assert (length > 0).all(), f"{what}: zero-length rows"
    assert (table[:, 2] == 0).all(), f"{what}: NumPy buffers live on device 0"
    starts, ends = rank.bounds()
    pos = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
    inside = (pos >= 0) & (addr + length <= ends[np.clip(pos, 0, None)])
    bad = np.flatnonzero(~inside)
    assert bad.size == 0, f"{what}: {bad.size} rows outside the rank's buffers, e.g. row {bad[:3]}"


def assert_disjoint(rows: NDArray[np.uint64], what: str) -> None:
    """No two rows share a byte."""
    if rows.shape[0] < 2:
        return
    order = np.argsort(rows[:, 0], kind="stable")
    start = rows[order, 0]
    end = start + rows[order, 1]
    assert (end[:-1] <= start[1:]).all(), f"{what}: destination rows overlap"


def copy_rows(
    src_rows: NDArray[np.uint64],
    dst_rows: NDArray[np.uint64],
    src: Side,
    dst: Side,
    writes: NDArray[np.int32],
) -> None:
    """Perform the copies row by row (vectorised per row length) and count written bytes."""
    s_base, d_base = U64(src.arena.ctypes.data), U64(dst.arena.ctypes.data)
    lengths = src_rows[:, 1]
    for length in np.unique(lengths):
        m = lengths == length
        span = np.arange(int(length), dtype=np.int64)
        so = (src_rows[m, 0] - s_base).astype(np.int64)[:, None] + span
        do = (dst_rows[m, 0] - d_base).astype(np.int64)[:, None] + span
        dst.arena[do] = src.arena[so]
        np.add.at(writes, do.ravel(), 1)


# --------------------------------------------------------------------------------------------
# The simulation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    heads: int
    tp_src: int
    tp_dst: int
    layers: int = 2
    page_size: int = 2
    head_dim: int = 2
    dtype: str = "float16"
    is_mla: bool = False
    src_slots: int = 6
    dst_slots: int = 5
    src_pages: tuple[int, ...] = (4, 1, 3)
    dst_pages: tuple[int, ...] = (0, 3, 2)
    pp_split: int | None = None  # prefill PP=2 with layers [0, split) and [split, layers)
    force_head_slice: bool = False  # use HeadSliceMapper even for equal TP (MHA only)

    def model(self) -> ModelSpec:
        return ModelSpec(
            num_layers=self.layers,
            total_kv_heads=self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_size=self.page_size,
            is_mla=self.is_mla,
        )


@dataclass
class Link:
    """One (prefill stage, prefill rank, decode rank) pair of the simulation."""

    mapper: IndexMapper
    tables: TablePair
    si: NDArray[np.int64]
    di: NDArray[np.int64]
    src: Rank
    dst: Rank


@dataclass
class Outcome:
    src: Side
    dst: Side
    links: dict[tuple[int, int, int], Link] = field(default_factory=dict)  # (pp, src, dst)


def simulate(sc: Scenario) -> Outcome:
    """Move the request's pages from every prefill rank to every decode rank and check it all."""
    model = sc.model()
    ps, bph = model.page_size, model.head_dim * model.dtype_size
    stages = (
        [(0, sc.layers)] if sc.pp_split is None else [(0, sc.pp_split), (sc.pp_split, sc.layers)]
    )
    src = build_side(model, sc.tp_src, sc.src_slots, stages)
    dst = build_side(model, sc.tp_dst, sc.dst_slots, [(0, sc.layers)])
    src_pages = np.array(sc.src_pages, dtype=np.int64)
    dst_pages = np.array(sc.dst_pages, dtype=np.int64)
    n = src_pages.size
    assert dst_pages.size == n
    logical = np.arange(n, dtype=np.int64)[:, None] * ps + np.arange(ps, dtype=np.int64)

    # Prefill: slot src_pages[i] holds logical page i; every other slot holds junk positions.
    slot_pos = JUNK + np.arange(sc.src_slots * ps, dtype=np.int64).reshape(sc.src_slots, ps)
    slot_pos[src_pages] = logical
    for rank in src.ranks.values():
        for arr, (layer, kv) in zip(rank.arrays, rank.keys, strict=True):
            arr[...] = encode(layer, kv, rank.heads, slot_pos, bph)
    src_before = src.arena.copy()

    # Decode: random sentinel, made to differ from the expected byte everywhere a byte is due.
    rng = np.random.default_rng(sc.src_slots * 1000 + sc.dst_slots * 10 + n)
    dst.arena[:] = rng.integers(0, 256, size=dst.arena.size, dtype=np.uint8)
    wants = []
    for rank in dst.ranks.values():
        for arr, (layer, kv) in zip(rank.arrays, rank.keys, strict=True):
            want = encode(layer, kv, rank.heads, logical, bph)
            cur = arr[dst_pages]
            arr[dst_pages] = np.where(cur == want, ~cur, cur)
            wants.append((arr, want))
    before = dst.arena.copy()
    expected = dst.arena.copy()
    for arr, want in wants:
        dst.view(expected, arr)[dst_pages] = want
    due = expected != before  # every byte of every destination page, nothing else

    writes = np.zeros(dst.arena.size, dtype=np.int32)
    out = Outcome(src=src, dst=dst)
    chunk_src = np.asarray(sc.src_pages, dtype=np.int32)  # page indices travel as int32
    chunk_dst = np.asarray(sc.dst_pages, dtype=np.int32)
    for d in range(sc.tp_dst):
        drank = dst.ranks[(0, d)]
        for p in range(len(stages)):
            senders = []
            for s in source_ranks(d, sc.tp_src, sc.tp_dst):
                srank = src.ranks[(p, s)]
                name = default_mapper_name(srank.layout, drank.layout)
                if sc.force_head_slice:
                    name = "head_slice"
                mapper = MAPPERS[name](srank.layout, drank.layout)
                assert mapper.name == name
                tables = mapper.build_tables()
                what = f"{name} prefill (pp {p}, tp {s}) -> decode {d}"
                assert_table(tables.src, srank, f"{what}: src table")
                assert_table(tables.dst, drank, f"{what}: dst table")
                si, di = mapper.map_chunk(chunk_src, chunk_dst)
                assert len(si) == len(di), what
                assert np.issubdtype(si.dtype, np.integer) and np.issubdtype(di.dtype, np.integer)
                out.links[(p, s, d)] = Link(mapper, tables, si, di, srank, drank)
                if mapper.is_dummy:
                    assert si.size == 0, f"{what}: a dummy sender sends data"
                    continue
                senders.append(s)
                if n:
                    assert si.size > 0, f"{what}: no rows for {n} pages"
                    assert si.min() >= 0 and si.max() < tables.src.shape[0], what
                    assert di.min() >= 0 and di.max() < tables.dst.shape[0], what
                s_rows, d_rows = tables.src[si], tables.dst[di]
                assert (s_rows[:, 1] == d_rows[:, 1]).all(), f"{what}: row lengths differ"
                assert_disjoint(d_rows, what)
                copy_rows(s_rows, d_rows, src, dst, writes)
            assert senders, f"decode rank {d} has no non-dummy sender in prefill stage {p}"

    np.testing.assert_array_equal(src.arena, src_before, err_msg="prefill memory changed")
    for (_, d), rank in dst.ranks.items():
        for arr, (layer, kv) in zip(rank.arrays, rank.keys, strict=True):
            np.testing.assert_array_equal(
                arr,
                dst.view(expected, arr),
                err_msg=f"decode rank {d} layer {layer} {'KV'[kv]}: wrong bytes",
            )
    np.testing.assert_array_equal(dst.arena, expected, err_msg="decode memory outside pages")
    # Each due byte is written by exactly one sender; nothing else is written.
    np.testing.assert_array_equal(writes, due.astype(np.int32), err_msg="write counts")
    return out


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------


def tp_pairs(heads: int, is_mla: bool, way: str) -> list[tuple[int, int]]:
    """(Tp, Td) pairs valid for ``heads`` in one direction: ``equal``, ``gather``, ``scatter``."""

    def fits(tp: int) -> bool:
        return is_mla or heads % tp == 0 or tp % heads == 0

    def goes(a: int, b: int) -> bool:
        return {"equal": a == b, "gather": a > b, "scatter": a < b}[way]

    return [
        (a, b)
        for a in TP_SIZES
        for b in TP_SIZES
        if (a % b == 0 or b % a == 0) and fits(a) and fits(b) and goes(a, b)
    ]


WAYS = ("equal", "gather", "scatter")


@st.composite
def scenarios(
    draw: st.DrawFn, *, way: str | None = None, pp: bool = False, is_mla: bool | None = None
) -> Scenario:
    """Random model, TP pair (in direction ``way`` if given) and chunk of >= 1 page."""
    mla = draw(st.booleans()) if is_mla is None else is_mla
    way = way or draw(st.sampled_from(WAYS))
    if mla:
        heads = 1
    else:
        fitting = [h for h in range(1, 17) if tp_pairs(h, False, way)]
        powers = [h for h in fitting if h & (h - 1) == 0]
        heads = draw(st.one_of(st.sampled_from(powers), st.sampled_from(fitting)))
    tp_src, tp_dst = draw(st.sampled_from(tp_pairs(heads, mla, way)))
    layers = draw(st.integers(2 if pp else 1, 4))
    src_slots = draw(st.integers(1, 8))
    dst_slots = draw(st.integers(1, 8))
    n = draw(st.integers(1, min(src_slots, dst_slots)))
    src_pages = tuple(draw(st.permutations(range(src_slots)))[:n])
    dst_pages = tuple(draw(st.permutations(range(dst_slots)))[:n])
    return Scenario(
        heads=heads,
        tp_src=tp_src,
        tp_dst=tp_dst,
        layers=layers,
        page_size=draw(st.integers(1, 4)),
        head_dim=draw(st.integers(1, 8)),
        dtype=draw(st.sampled_from(DTYPES)),
        is_mla=mla,
        src_slots=src_slots,
        dst_slots=dst_slots,
        src_pages=src_pages,
        dst_pages=dst_pages,
        pp_split=draw(st.integers(1, layers - 1)) if pp else None,
    )


def test_dtypes_are_known() -> None:
    assert all(d in DTYPE_SIZES for d in DTYPES)
    assert {DTYPE_SIZES[d] for d in DTYPES} == {1, 2, 4}


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("way", WAYS)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_transfer_reconstructs_decode_shards(way: str, data: st.DataObject) -> None:
    sc = data.draw(scenarios(way=way), label="scenario")
    out = simulate(sc)
    expected_links = sc.tp_dst * max(1, sc.tp_src // sc.tp_dst)
    assert len(out.links) == expected_links


@PROPERTY_SETTINGS
@given(scenarios(pp=True))
def test_pipeline_stages_together_reconstruct_decode(sc: Scenario) -> None:
    out = simulate(sc)
    # Each stage only sends its own layers: the union covers all of them exactly once
    # (simulate checks exactly-once writes); here check each stage's pairs are its layers.
    for (p, _, _), link in out.links.items():
        start, end = (0, sc.pp_split) if p == 0 else (sc.pp_split, sc.layers)
        per_layer = 1 if sc.is_mla else 2
        assert link.mapper.num_pairs == (end - start) * per_layer


@PROPERTY_SETTINGS
@given(scenarios(way="equal", is_mla=False))
def test_head_slice_mapper_also_handles_equal_tp(sc: Scenario) -> None:
    out = simulate(replace(sc, force_head_slice=True))
    assert {lk.mapper.name for lk in out.links.values()} == {"head_slice"}


@PROPERTY_SETTINGS
@given(scenarios(is_mla=True))
def test_mla_exactly_one_sender_per_decode_rank(sc: Scenario) -> None:
    out = simulate(sc)
    for d in range(sc.tp_dst):
        live = [s for (_, s, dd), lk in out.links.items() if dd == d and not lk.mapper.is_dummy]
        assert live == [source_ranks(d, sc.tp_src, sc.tp_dst)[0]]


ALL_COMBOS = [
    (heads, tp_src, tp_dst, mla)
    for mla in (False, True)
    for heads in ((1,) if mla else range(1, 17))
    for way in WAYS
    for tp_src, tp_dst in tp_pairs(heads, mla, way)
]


@pytest.mark.parametrize(
    ("heads", "tp_src", "tp_dst", "mla"),
    ALL_COMBOS,
    ids=[f"{'mla' if m else f'H{h}'}-tp{a}-td{b}" for h, a, b, m in ALL_COMBOS],
)
def test_every_head_count_and_tp_pair(heads: int, tp_src: int, tp_dst: int, mla: bool) -> None:
    """Exhaustive over (H, Tp, Td, MLA); the properties above vary the rest of the shape."""
    sc = Scenario(heads=heads, tp_src=tp_src, tp_dst=tp_dst, is_mla=mla, head_dim=3)
    out = simulate(sc)
    live = sum(not lk.mapper.is_dummy for lk in out.links.values())
    if mla:
        assert live == tp_dst  # one sender per decode rank
    else:
        # one sender per distinct head group a decode rank needs from its prefill ranks
        per_dst = max(1, min(tp_src, heads) // min(tp_dst, heads)) if tp_src > tp_dst else 1
        assert live == tp_dst * per_dst


# --------------------------------------------------------------------------------------------
# Named cases
# --------------------------------------------------------------------------------------------


def row_offsets(rows: NDArray[np.uint64], rank: Rank) -> set[int]:
    """Byte offsets of rows inside their token row."""
    starts, _ = rank.bounds()
    pos = np.searchsorted(starts, rows[:, 0], side="right") - 1
    rel = rows[:, 0] - starts[pos]
    return {int(v) for v in np.unique(rel % U64(rank.layout.token_row_bytes))}


def live_senders(out: Outcome, d: int) -> list[int]:
    return sorted(s for (_, s, dd), lk in out.links.items() if dd == d and not lk.mapper.is_dummy)


def test_h8_tp4_to_td2_gather() -> None:
    sc = Scenario(heads=8, tp_src=4, tp_dst=2, head_dim=3, dtype="float16")  # 6 B per head
    out = simulate(sc)
    assert {lk.mapper.name for lk in out.links.values()} == {"head_slice"}
    assert live_senders(out, 0) == [0, 1] and live_senders(out, 1) == [2, 3]
    for (_, s, _), lk in out.links.items():
        # each prefill rank's 2 heads land at head offset (s % 2) * 2 of the 4 decode heads
        assert row_offsets(lk.tables.dst[lk.di], lk.dst) == {(s % 2) * 2 * 6}
        assert row_offsets(lk.tables.src[lk.si], lk.src) == {0}
        assert set(lk.tables.dst[lk.di, 1].tolist()) == {2 * 6}


def test_h8_tp2_to_td4_scatter() -> None:
    sc = Scenario(heads=8, tp_src=2, tp_dst=4, head_dim=2, dtype="float32")  # 8 B per head
    out = simulate(sc)
    for d in range(4):
        (lk,) = [lk for (_, _, dd), lk in out.links.items() if dd == d]
        assert lk.mapper.name == "head_slice" and not lk.mapper.is_dummy
        assert lk.src.layout.rank.tp_rank == d // 2
        assert row_offsets(lk.tables.src[lk.si], lk.src) == {((2 * d) % 4) * 8}
        assert row_offsets(lk.tables.dst[lk.di], lk.dst) == {0}


def test_h2_tp4_to_td1_gather_with_replicated_prefill() -> None:
    out = simulate(Scenario(heads=2, tp_src=4, tp_dst=1))
    dummies = sorted(s for (_, s, _), lk in out.links.items() if lk.mapper.is_dummy)
    assert dummies == [1, 3]
    assert live_senders(out, 0) == [0, 2]
    bph = 2 * 2  # head_dim 2 x float16
    for s, head in ((0, 0), (2, 1)):
        lk = out.links[(0, s, 0)]
        assert row_offsets(lk.tables.dst[lk.di], lk.dst) == {head * bph}


def test_h2_tp1_to_td4_scatter_with_replicated_decode() -> None:
    out = simulate(Scenario(heads=2, tp_src=1, tp_dst=4, head_dim=4, dtype="uint8"))
    bph = 4
    for d in range(4):
        lk = out.links[(0, 0, d)]
        assert not lk.mapper.is_dummy
        # decode ranks 0, 1 hold head 0; ranks 2, 3 hold head 1 (integer division, not modulo)
        assert row_offsets(lk.tables.src[lk.si], lk.src) == {(d // 2) * bph}


def test_h1_tp4_to_td2_single_head_dummies() -> None:
    out = simulate(Scenario(heads=1, tp_src=4, tp_dst=2))
    assert live_senders(out, 0) == [0] and live_senders(out, 1) == [2]
    dummies = sorted(s for (_, s, _), lk in out.links.items() if lk.mapper.is_dummy)
    assert dummies == [1, 3]


def test_mla_tp4_to_td1_dummies() -> None:
    sc = Scenario(heads=1, tp_src=4, tp_dst=1, is_mla=True, head_dim=5)
    out = simulate(sc)
    assert {lk.mapper.name for lk in out.links.values()} == {"mla"}
    assert [lk.mapper.is_dummy for _, lk in sorted(out.links.items())] == [
        False,
        True,
        True,
        True,
    ]
    lk = out.links[(0, 0, 0)]
    # whole pages: one row per (layer, page)
    assert lk.si.size == len(sc.src_pages) * sc.layers
    assert set(lk.tables.dst[lk.di, 1].tolist()) == {2 * 5 * 2}  # page_size * head_dim * 2 B


def test_pp2_prefill_to_pp1_decode() -> None:
    sc = Scenario(heads=4, tp_src=2, tp_dst=4, layers=4, pp_split=2)
    out = simulate(sc)
    assert sorted({p for p, _, _ in out.links}) == [0, 1]
    for (p, _, _), lk in out.links.items():
        assert lk.mapper.num_pairs == 4  # 2 layers x K/V per stage
        layers = {int(k[0]) for k in lk.src.layout.buffer_keys}
        assert layers == ({0, 1} if p == 0 else {2, 3})


def test_pp2_mla() -> None:
    simulate(Scenario(heads=1, tp_src=2, tp_dst=1, is_mla=True, layers=3, pp_split=1))


def test_empty_chunk_moves_nothing() -> None:
    out = simulate(Scenario(heads=4, tp_src=4, tp_dst=2, src_pages=(), dst_pages=()))
    assert all(lk.si.size == 0 and lk.di.size == 0 for lk in out.links.values())


# --------------------------------------------------------------------------------------------
# Negative cases
# --------------------------------------------------------------------------------------------


def pair(
    sc: Scenario, s: int = 0, d: int = 0, model_dst: ModelSpec | None = None
) -> tuple[KVLayout, KVLayout]:
    src = build_side(sc.model(), sc.tp_src, sc.src_slots, [(0, sc.layers)])
    dst = build_side(model_dst or sc.model(), sc.tp_dst, sc.dst_slots, [(0, sc.layers)])
    return src.ranks[(0, s)].layout, dst.ranks[(0, d)].layout


NEGATIVE_CASES = {
    "equal_tp": (Scenario(heads=4, tp_src=2, tp_dst=2), 0, 0),
    "head_slice": (Scenario(heads=4, tp_src=4, tp_dst=2), 1, 0),
    "mla": (Scenario(heads=1, tp_src=1, tp_dst=2, is_mla=True), 0, 1),
    "mla-dummy": (Scenario(heads=1, tp_src=4, tp_dst=2, is_mla=True), 3, 1),
}


@pytest.mark.parametrize("case", sorted(NEGATIVE_CASES))
def test_out_of_range_pages_raise(case: str) -> None:
    sc, s, d = NEGATIVE_CASES[case]
    src, dst = pair(sc, s, d)
    mapper = MAPPERS[default_mapper_name(src, dst)](src, dst)
    assert mapper.is_dummy == (case == "mla-dummy")
    ns, nd = sc.src_slots, sc.dst_slots
    with pytest.raises(DescriptorError, match=rf"source page.*\[0, {ns}\].*{ns} page slots"):
        mapper.map_chunk([0, ns], [0, 1])
    with pytest.raises(DescriptorError, match=rf"source page.*\[-1, 0\].*{ns} page slots"):
        mapper.map_chunk([-1, 0], [0, 1])
    with pytest.raises(
        DescriptorError, match=rf"destination page.*\[1, {nd + 2}\].*{nd} page slots"
    ):
        mapper.map_chunk([0, 1], np.array([nd + 2, 1], dtype=np.int32))
    with pytest.raises(DescriptorError, match="integers"):
        mapper.map_chunk([0.0, 1.0], [0, 1])
    with pytest.raises(DescriptorError, match="1-D"):
        mapper.map_chunk([[0, 1]], [[0, 1]])
    # the largest valid indices are accepted
    si, di = mapper.map_chunk([ns - 1], [nd - 1])
    assert len(si) == len(di)


@pytest.mark.parametrize("case", sorted(NEGATIVE_CASES))
def test_mismatched_page_counts_raise(case: str) -> None:
    sc, s, d = NEGATIVE_CASES[case]
    src, dst = pair(sc, s, d)
    mapper = MAPPERS[default_mapper_name(src, dst)](src, dst)
    with pytest.raises(DescriptorError, match="3 source pages but 2 destination pages"):
        mapper.map_chunk([0, 1, 2], [0, 1])
    with pytest.raises(DescriptorError, match="0 source pages but 1 destination pages"):
        mapper.map_chunk([], [0])


# page sizes may differ: the core mappers convert them (test_page_convert.py)
INCOMPATIBLE = [
    ("dtype", "float32"),
    ("head_dim", 5),
    ("num_layers", 3),
]


@pytest.mark.parametrize("case", ["equal_tp", "head_slice", "mla"])
@pytest.mark.parametrize(("field_name", "value"), INCOMPATIBLE)
def test_incompatible_models_raise_layout_error(case: str, field_name: str, value: object) -> None:
    sc, s, d = NEGATIVE_CASES[case]
    other = sc.model().model_copy(update={field_name: value})
    src, dst = pair(sc, s, d, model_dst=other)
    cls = MAPPERS[case]
    with pytest.raises(LayoutError) as err:
        cls(src, dst)
    msg = str(err.value)
    assert field_name in msg
    assert repr(getattr(sc.model(), field_name)) in msg and repr(value) in msg
    # the other fields, which agree, are not blamed
    for other_name, _ in INCOMPATIBLE:
        if other_name != field_name:
            assert f"{other_name}:" not in msg


def test_total_heads_mismatch_raises() -> None:
    sc = Scenario(heads=4, tp_src=2, tp_dst=2)
    src, dst = pair(sc, model_dst=sc.model().model_copy(update={"total_kv_heads": 8}))
    with pytest.raises(LayoutError, match="total_kv_heads"):
        EqualTPMapper(src, dst)


def test_wrong_mapper_for_layout_pair_raises() -> None:
    src, dst = pair(Scenario(heads=4, tp_src=4, tp_dst=2), 2, 0)
    with pytest.raises(LayoutError, match="does not feed"):
        HeadSliceMapper(src, dst)
    with pytest.raises(LayoutError, match="head_slice"):
        EqualTPMapper(src, dst)
    with pytest.raises(LayoutError, match="MLA"):
        MLAMapper(src, dst)
    mla_src, mla_dst = pair(Scenario(heads=1, tp_src=2, tp_dst=1, is_mla=True))
    with pytest.raises(LayoutError, match="mla"):
        HeadSliceMapper(mla_src, mla_dst)


# --------------------------------------------------------------------------------------------
# Rank mapping
# --------------------------------------------------------------------------------------------

RANK_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
VALID_TP = [(a, b) for a in RANK_SIZES for b in RANK_SIZES if a % b == 0 or b % a == 0]


@pytest.mark.parametrize(("tp_src", "tp_dst"), VALID_TP)
def test_source_and_target_ranks_are_inverse(tp_src: int, tp_dst: int) -> None:
    sources = {d: source_ranks(d, tp_src, tp_dst) for d in range(tp_dst)}
    targets = {s: target_ranks(s, tp_src, tp_dst) for s in range(tp_src)}
    for ss in sources.values():
        assert ss == sorted(set(ss)) and len(ss) == max(1, tp_src // tp_dst)
        assert all(0 <= s < tp_src for s in ss)
    for ds in targets.values():
        assert ds == sorted(set(ds)) and len(ds) == max(1, tp_dst // tp_src)
        assert all(0 <= d < tp_dst for d in ds)
    for d in range(tp_dst):
        for s in range(tp_src):
            assert (s in sources[d]) == (d in targets[s]), (s, d)
    # every prefill rank feeds max(1, Td/Tp) decode ranks, every decode rank is fed
    fan_out = max(1, tp_dst // tp_src)
    assert sorted(s for ss in sources.values() for s in ss) == sorted(list(range(tp_src)) * fan_out)
    assert sorted(d for ds in targets.values() for d in ds) == sorted(
        list(range(tp_dst)) * max(1, tp_src // tp_dst)
    )


def test_rank_mapping_formulas() -> None:
    assert source_ranks(3, 2, 4) == [1]
    assert source_ranks(1, 8, 2) == [4, 5, 6, 7]
    assert target_ranks(1, 2, 8) == [4, 5, 6, 7]
    assert target_ranks(5, 8, 2) == [1]
    assert source_ranks(2, 4, 4) == [2] and target_ranks(2, 4, 4) == [2]


@pytest.mark.parametrize(("tp_src", "tp_dst"), [(2, 3), (4, 6), (0, 1), (1, 0), (3, 2)])
def test_invalid_tp_pairs_raise(tp_src: int, tp_dst: int) -> None:
    with pytest.raises(LayoutError):
        source_ranks(0, tp_src, tp_dst)
    with pytest.raises(LayoutError):
        target_ranks(0, tp_src, tp_dst)


def test_rank_out_of_range_raises() -> None:
    with pytest.raises(LayoutError, match=r"not in \[0, 2\)"):
        source_ranks(2, 4, 2)
    with pytest.raises(LayoutError, match=r"not in \[0, 4\)"):
        target_ranks(-1, 4, 2)
