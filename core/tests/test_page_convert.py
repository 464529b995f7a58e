"""Different page sizes on prefill and decode: token ranges, checked against a token-by-token
reference.

Each simulated prefill rank holds a request's prompt in random page slots; every byte encodes
(layer, K/V, global head, token position, byte). The mappers' tables and chunk index arrays
(``chunk_slice`` then ``map_chunk``, exactly as the session drives them, chunk by chunk) move
it to simulated decode ranks. An independent reference moves the same tokens one at a time in
NumPy (for each token and each head the decode rank holds, it finds the prefill rank, page and
row holding that head and copies it). The two decode memories must agree on every token the
request has, every due byte must be written exactly once, and nothing outside the request's
decode pages may change.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from kvwire.errors import DescriptorError, KVWireError, LayoutError
from kvwire.index import EqualTPMapper, HeadSliceMapper, IndexMapper, MLAMapper, source_ranks
from kvwire.index.base import default_mapper_name
from kvwire.index.paging import PageConversion
from kvwire.layout import BufferGroup, KVLayout, MemoryRegion, ModelSpec, RankPosition
from kvwire.session import KVPoll
from kvwire.session.handshake import handshake_problems
from kvwire.testing.kvfill import count_mismatches, fill_pages
from kvwire.testing.pair import MODEL, config, no_rooms, pair, wait_for

U64 = np.uint64
MAPPERS: dict[str, type[IndexMapper]] = {
    "equal_tp": EqualTPMapper,
    "mla": MLAMapper,
    "head_slice": HeadSliceMapper,
}
PAGE_SIZES = (1, 2, 3, 4, 6, 8, 16)
SETTINGS = settings(max_examples=40, deadline=None)


def encode(
    layer: int, kv: int, heads: NDArray[np.int64], pos: NDArray[np.int64], nbytes: int
) -> NDArray[np.uint8]:
    """Bytes ``pos.shape + (len(heads), nbytes)`` mixing every coordinate."""
    x = (
        np.asarray(pos, dtype=U64)[..., None, None] * U64(0x9E3779B97F4A7C15)
        + np.asarray(heads, dtype=U64)[:, None] * U64(0xC2B2AE3D27D4EB4F)
        + np.arange(nbytes, dtype=U64) * U64(0x165667B1)
        + U64(1 + layer * 0x3C6EF372 + kv * 0x7F4A7C15)
    )
    x ^= x >> U64(29)
    x *= U64(0xFF51AFD7ED558CCD)
    x ^= x >> U64(32)
    return (x & U64(0xFF)).astype(np.uint8)


def global_heads(model: ModelSpec, tp: int, rank: int) -> NDArray[np.int64]:
    h = model.total_kv_heads
    local = 1 if model.is_mla else max(1, h // tp)
    return (rank // max(1, tp // h)) * local + np.arange(local, dtype=np.int64)


@dataclass
class SimRank:
    layout: KVLayout
    arena: NDArray[np.uint8]
    arrays: list[NDArray[np.uint8]]  # [slots, page, heads, head_bytes] per buffer
    keys: list[tuple[int, int]]
    heads: NDArray[np.int64]


def make_rank(model: ModelSpec, tp: int, r: int, slots: int) -> SimRank:
    heads = global_heads(model, tp, r)
    hb = model.head_dim * model.dtype_size
    shape = (slots, model.page_size, heads.size, hb)
    size = int(np.prod(shape))
    kinds = (0,) if model.is_mla else (0, 1)
    keys = [(layer, kv) for kv in kinds for layer in range(model.num_layers)]
    arena = np.zeros(8 + len(keys) * (size + 8), dtype=np.uint8)
    arrays = [
        arena[8 + i * (size + 8) : 8 + i * (size + 8) + size].reshape(shape)
        for i in range(len(keys))
    ]
    layout = KVLayout.from_tensors(model, arrays, rank=RankPosition(tp_size=tp, tp_rank=r))
    return SimRank(layout, arena, arrays, keys, heads)


@dataclass(frozen=True)
class Case:
    heads: int
    tp_src: int
    tp_dst: int
    src_page: int
    dst_page: int
    tokens: int
    prefix: int  # tokens decode keeps cached (a multiple of gcd(src_page, dst_page))
    cuts: tuple[int, ...]  # chunk boundaries, in prefill pages
    layers: int = 2
    head_dim: int = 2
    dtype: str = "uint8"
    is_mla: bool = False
    seed: int = 0

    def model(self, page: int) -> ModelSpec:
        return ModelSpec(
            num_layers=self.layers,
            total_kv_heads=self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_size=page,
            is_mla=self.is_mla,
        )


def run_case(cs: Case) -> None:
    """Move the request with the mappers and with the reference; compare."""
    rng = np.random.default_rng(cs.seed)
    pm, dm = cs.model(cs.src_page), cs.model(cs.dst_page)
    pp, pd, t_end, c = cs.src_page, cs.dst_page, cs.tokens, cs.prefix
    n = -(-t_end // pp)
    m = -(-(t_end - c) // pd)
    s_slots, d_slots = n + int(rng.integers(0, 3)), m + int(rng.integers(0, 3))
    src = [make_rank(pm, cs.tp_src, r, s_slots) for r in range(cs.tp_src)]
    dst = [make_rank(dm, cs.tp_dst, r, d_slots) for r in range(cs.tp_dst)]
    pages = rng.permutation(s_slots)[:n].astype(np.int64)
    dpages = rng.permutation(d_slots)[:m].astype(np.int64)
    hb = pm.head_dim * pm.dtype_size

    # prefill: the request's slots hold positions 0.. (whole pages); the rest junk positions
    pos = (1 << 20) + np.arange(s_slots * pp, dtype=np.int64).reshape(s_slots, pp)
    pos[pages] = np.arange(n * pp, dtype=np.int64).reshape(n, pp)
    for rk in src:
        for arr, (layer, kv) in zip(rk.arrays, rk.keys, strict=True):
            arr[...] = encode(layer, kv, rk.heads, pos, hb)
    for rk in dst:
        rk.arena[:] = rng.integers(0, 256, size=rk.arena.size, dtype=np.uint8)

    # the reference: token by token, head by head, from whichever prefill rank holds the head
    ref = [rk.arena.copy() for rk in dst]
    dues = [np.zeros(rk.arena.size, dtype=bool) for rk in dst]
    for d, rk in enumerate(dst):
        for b, (layer, kv) in enumerate(rk.keys):
            off, shape = rk.arrays[b].ctypes.data - rk.arena.ctypes.data, rk.arrays[b].shape
            view = ref[d][off : off + rk.arrays[b].nbytes].reshape(shape)
            mark = dues[d][off : off + rk.arrays[b].nbytes].reshape(shape)
            for t in range(c, t_end):
                dp_, dt = dpages[(t - c) // pd], (t - c) % pd
                for j, h in enumerate(rk.heads):
                    s = next(s for s in src if h in s.heads)
                    sb = s.keys.index((layer, kv))
                    k = int(np.flatnonzero(s.heads == h)[0])
                    view[dp_, dt, j] = s.arrays[sb][pages[t // pp], t % pp, k]
                    mark[dp_, dt, j] = True

    # the mappers, chunk by chunk as the session drives them
    writes = [np.zeros(rk.arena.size, dtype=np.int32) for rk in dst]
    bounds = [0, *cs.cuts, n]
    for d, drk in enumerate(dst):
        for s in source_ranks(d, cs.tp_src, cs.tp_dst):
            srk = src[s]
            name = default_mapper_name(srk.layout, drk.layout)
            mapper = MAPPERS[name](srk.layout, drk.layout)
            assert (mapper.paging is not None) == (pp != pd)
            tables = mapper.build_tables()
            for start, end in itertools.pairwise(bounds):
                sp, lo, hi = mapper.chunk_slice(n, dpages, pages[start:end], start, end, c)
                si, di = mapper.map_chunk(sp, dpages[lo:hi])
                assert si.size == di.size
                if mapper.is_dummy:
                    assert si.size == 0
                    continue
                srows, drows = tables.src[si], tables.dst[di]
                assert (srows[:, 1] == drows[:, 1]).all(), "row lengths differ"
                sb, db = U64(srk.arena.ctypes.data), U64(drk.arena.ctypes.data)
                for length in np.unique(srows[:, 1]):
                    k = srows[:, 1] == length
                    span = np.arange(int(length), dtype=np.int64)
                    so = (srows[k, 0] - sb).astype(np.int64)[:, None] + span
                    do = (drows[k, 0] - db).astype(np.int64)[:, None] + span
                    drk.arena[do] = srk.arena[so]
                    np.add.at(writes[d], do.ravel(), 1)

    for d, rk in enumerate(dst):
        due = dues[d]
        assert (writes[d] <= 1).all(), f"decode rank {d}: a byte was written twice"
        # every byte of every token the request has, exactly as the reference moved it
        bad = (rk.arena != ref[d]) & ((writes[d] == 0) | due)
        assert not bad.any(), f"decode rank {d}: {int(bad.sum())} bytes differ from the reference"
        assert (writes[d][due] == 1).all(), f"decode rank {d}: a due byte was not written"
        # bytes written beyond the prompt: the request's own positions past its end, in its
        # last decode page only (as with equal page sizes, whole last pages move)
        extra = (writes[d] == 1) & ~due
        if extra.any():
            for b, (layer, kv) in enumerate(rk.keys):
                arr = rk.arrays[b]
                off = arr.ctypes.data - rk.arena.ctypes.data
                w = writes[d][off : off + arr.nbytes].reshape(arr.shape)
                e = extra[off : off + arr.nbytes].reshape(arr.shape)
                slot, tok = np.nonzero(e.any(axis=(2, 3)))
                assert set(slot.tolist()) <= {int(dpages[-1])}, "written outside the last page"
                p_ = c + (m - 1) * pd + tok
                assert (p_ >= t_end).all() and (p_ < n * pp).all()
                want = encode(layer, kv, rk.heads, p_, hb)
                np.testing.assert_array_equal(
                    arr[slot, tok][w[slot, tok] == 1], want[w[slot, tok] == 1]
                )


def fits(tp: int, heads: int, mla: bool) -> bool:
    return mla or heads % tp == 0 or tp % heads == 0


@st.composite
def cases(draw: st.DrawFn, mla: bool | None = None, equal_tp: bool | None = None) -> Case:
    is_mla = draw(st.booleans()) if mla is None else mla

    def tp_pairs(heads: int) -> list[tuple[int, int]]:
        return [
            (a, b)
            for a in (1, 2, 4)
            for b in (1, 2, 4)
            if (a % b == 0 or b % a == 0)
            and fits(a, heads, is_mla)
            and fits(b, heads, is_mla)
            and (equal_tp is None or (a == b) == equal_tp)
        ]

    heads = 1 if is_mla else draw(st.sampled_from([h for h in (1, 2, 3, 4, 8) if tp_pairs(h)]))
    tps = tp_pairs(heads)
    tp_src, tp_dst = draw(st.sampled_from(tps))
    pp = draw(st.sampled_from(PAGE_SIZES))
    pd = draw(st.sampled_from(PAGE_SIZES).filter(lambda x: x != pp))
    g = math.gcd(pp, pd)  # every core mapper moves granules of gcd(pp, pd) tokens or finer
    tokens = draw(st.integers(1, min(6 * max(pp, pd), 60)))
    prefix = g * draw(st.integers(0, (tokens - 1) // g))
    n = -(-tokens // pp)
    cuts = tuple(sorted(draw(st.lists(st.integers(0, n), max_size=3))))
    return Case(
        heads=heads,
        tp_src=tp_src,
        tp_dst=tp_dst,
        src_page=pp,
        dst_page=pd,
        tokens=tokens,
        prefix=prefix,
        cuts=cuts,
        layers=draw(st.integers(1, 2)),
        head_dim=draw(st.integers(1, 3)),
        dtype=draw(st.sampled_from(("uint8", "float16"))),
        is_mla=is_mla,
        seed=draw(st.integers(0, 2**16)),
    )


@SETTINGS
@given(cs=cases(mla=False, equal_tp=True))
def test_equal_tp_pages_convert(cs: Case) -> None:
    run_case(cs)


@SETTINGS
@given(cs=cases(mla=False, equal_tp=False))
def test_head_slices_pages_convert(cs: Case) -> None:
    run_case(cs)


@SETTINGS
@given(cs=cases(mla=True))
def test_mla_pages_convert(cs: Case) -> None:
    run_case(cs)


@pytest.mark.parametrize(
    ("pp", "pd", "tokens", "cuts"),
    [
        (64, 16, 200, (1, 3)),  # decode finer: chunk boundaries are decode page boundaries
        (16, 64, 200, (1, 3, 5, 9)),  # decode coarser: decode pages filled by several chunks
        (16, 1, 37, (1,)),  # token granularity
        (1, 16, 37, (5, 20)),
        (6, 4, 29, (1, 2, 3)),  # neither divides the other
    ],
)
def test_named_shapes(pp: int, pd: int, tokens: int, cuts: tuple[int, ...]) -> None:
    for tps in ((2, 2), (2, 1), (1, 2)):
        run_case(
            Case(
                heads=2,
                tp_src=tps[0],
                tp_dst=tps[1],
                src_page=pp,
                dst_page=pd,
                tokens=tokens,
                prefix=0,
                cuts=cuts,
            )
        )
    big = math.lcm(pp, pd)
    run_case(
        Case(
            heads=1,
            tp_src=2,
            tp_dst=1,
            src_page=pp,
            dst_page=pd,
            tokens=tokens,
            prefix=big * ((tokens - 1) // big),
            cuts=cuts,
            is_mla=True,
        )
    )


def test_decode_must_say_its_cached_prefix() -> None:
    """The page counts alone cannot place tokens: a 16-token prefix cached on decode (pages of
    16) under prefill pages of 64 gives the same counts as no prefix at all, so a converting
    link refuses a request without ``cached_tokens`` and checks the value it gets."""
    pc = PageConversion(64, 16, 16)
    # prompt of 100 tokens: 2 prefill pages; decode keeps 16 and asks for 6 pages of 16 -
    # exactly what a 96-token prompt with nothing cached would ask for
    assert -(-100 // 64) == -(-96 // 64) == 2 and -(-(100 - 16) // 16) == -(-96 // 16) == 6
    with pytest.raises(DescriptorError, match=r"send_metadata\(\.\.\., cached_tokens=N\)"):
        pc.prefix_of(2, 6, None)
    assert pc.prefix_of(2, 6, 16) == 16 and pc.prefix_of(2, 6, 0) == 0
    with pytest.raises(DescriptorError, match="not a multiple of 16"):
        pc.prefix_of(2, 6, 8)
    with pytest.raises(DescriptorError, match="which no prompt of 2 prefill pages"):
        pc.prefix_of(2, 6, 64)


def test_impossible_counts_name_both() -> None:
    pc = PageConversion(64, 16, 16)
    with pytest.raises(DescriptorError, match=r"9 pages of 16 tokens.*2 prefill pages of 64"):
        pc.prefix_of(2, 9, 0)
    with pytest.raises(DescriptorError, match="does not fill"):
        pc.stream_granules(np.arange(5), np.array([0]), 4, 4)
    with pytest.raises(LayoutError, match="divide both page sizes"):
        PageConversion(4, 6, 4)


def test_chunk_sharing_a_decode_page() -> None:
    """Prefill 16, decode 64 (granules of 16 tokens): the chunk of request page 1 (slot 2)
    writes the second quarter of decode page slot 1; its stream starts with one 'not mine'
    granule (the quarter the previous chunk wrote)."""
    m = ModelSpec(num_layers=1, total_kv_heads=1, head_dim=1, dtype="uint8", page_size=16)
    src = make_rank(m, 1, 0, 4).layout
    dst = make_rank(m.model_copy(update={"page_size": 64}), 1, 0, 2).layout
    mapper = EqualTPMapper(src, dst)
    stream, lo, hi = mapper.chunk_slice(3, np.array([1]), np.array([2]), 1, 2, 0)
    assert (lo, hi) == (0, 1)
    assert stream.tolist() == [-1, 2]
    si, di = mapper.map_chunk(stream, np.array([1]))
    assert (si.tolist(), di.tolist()) == ([2, 6], [5, 13])  # K, then V (4 and 8 rows on)


def _layout(page: int, groups: tuple[BufferGroup, ...] = ()) -> KVLayout:
    m = ModelSpec(num_layers=1, total_kv_heads=2, head_dim=4, page_size=page)
    item = page * 2 * 4 * 2
    bufs = tuple(MemoryRegion.from_pointer(0x10000 * (i + 1), item * 8, item) for i in range(2))
    return KVLayout(model=m, buffers=bufs, groups=groups)


def test_handshake_allows_page_sizes_and_refuses_paged_groups() -> None:
    assert handshake_problems(_layout(64), _layout(16), "tcp", "tcp") == []
    assert _layout(64).compatibility_hash(16) == _layout(16).compatibility_hash()
    assert _layout(64).compatibility_hash() != _layout(16).compatibility_hash()

    def draft(page: int) -> BufferGroup:
        item = page * 2 * 4 * 2
        return BufferGroup(
            name="draft",
            kind="paged",
            num_layers=1,
            per_layer=2,
            total_heads=2,
            head_elems=4,
            page_size=page,
            buffers=tuple(
                MemoryRegion.from_pointer(0x100000 * (i + 1), item * 8, item) for i in range(2)
            ),
        )

    problems = handshake_problems(
        _layout(64, (draft(64),)), _layout(16, (draft(16),)), "tcp", "tcp"
    )
    assert any(p.startswith("page_size: prefill=64 decode=16") and "'draft'" in p for p in problems)


def test_a_mapper_without_conversion_refuses_naming_both() -> None:
    class Plain(EqualTPMapper):
        name = "plain"
        relaxed_fields = ()

    with pytest.raises(
        LayoutError, match=r"page_size: local=64 remote=16.*plain mapper does not convert"
    ):
        Plain(_layout(64), _layout(16))


@pytest.mark.parametrize(("dst_page", "chunks"), [(4, (1, 3)), (1, (2, 2)), (4, (3, 1))])
def test_session_moves_between_page_sizes(dst_page: int, chunks: tuple[int, ...]) -> None:
    """Two managers over tcp: prefill pages of 2 tokens, decode pages of ``dst_page``; with
    chunks (1, 3) decode page 0 is filled by two chunks. Every element verified."""
    dmodel = MODEL.model_copy(update={"page_size": dst_page})
    with pair(config(), dmodel=dmodel) as p:
        n = 4
        m = n * MODEL.page_size // dst_page
        r = p.decode.receiver(7, p.addr)
        r.init()
        dst = np.arange(m) + 5
        r.send_metadata(dst, aux_index=1, cached_tokens=0)
        s = p.prefill.sender(7)
        src = np.arange(n) + 3
        fill_pages(p.play, p.parr, src, 0)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(n, aux_index=2)
        off = 0
        for i, k in enumerate(chunks):
            s.send(src[off : off + k], last=i == len(chunks) - 1)
            off += k
        wait_for(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success)
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        others = np.setdiff1d(np.arange(p.dlay.num_slots), dst)
        assert all((a[others] == 0).all() for a in p.darr), "decode slots outside the request"
        r.clear()
        s.clear()


def test_a_prefix_not_on_both_page_sizes_is_placed_by_cached_tokens() -> None:
    """Prefill pages of 2 tokens, decode pages of 4; decode keeps 2 tokens cached (half a
    decode page, not a multiple of lcm = 4). With ``cached_tokens=2`` every token lands where
    it belongs; without it the request fails on both sides at once, naming the option (the
    counts alone would have placed the tokens 2 positions off, silently)."""
    dmodel = MODEL.model_copy(update={"page_size": 4})
    with pair(config(), dmodel=dmodel) as p:
        n, c = 5, 2
        src = np.arange(n) + 3
        fill_pages(p.play, p.parr, src, 0)
        for room, cached in ((8, c), (9, None)):
            dst = np.arange(2) + 5 + 4 * (room - 8)
            r = p.decode.receiver(room, p.addr)
            r.init()
            r.send_metadata(dst, aux_index=room - 7, cached_tokens=cached)
            s = p.prefill.sender(room)
            wait_for(lambda s=s: s.poll() >= KVPoll.WaitingForInput)
            s.init(n, aux_index=room - 6)
            t0 = time.monotonic()
            try:
                s.send(src[:2])
                s.send(src[2:], last=True)
            except KVWireError:
                pass  # the refusal may already be raised here, on the engine's thread
            if cached is not None:
                wait_for(lambda r=r, s=s: r.poll() == KVPoll.Success == s.poll())
                assert count_mismatches(p.dlay, p.darr, dst, c) == 0  # positions 2..9
            else:
                wait_for(lambda r=r, s=s: r.poll() == KVPoll.Failed == s.poll())
                assert time.monotonic() - t0 < 5.0  # pushed, not timed out (30-60 s)
                for side in (r, s):
                    with pytest.raises(KVWireError, match="cached_tokens"):
                        side.failure_exception()
            r.clear()
            s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


@pytest.mark.parametrize(("pages", "cached"), [(0, 0), (0, 4), (1, 0)])
def test_too_few_decode_pages_are_refused_at_once(pages: int, cached: int) -> None:
    """Prefill pages of 2 tokens, decode pages of 4, a prompt of 4 prefill pages (7-8 tokens).
    Decode asking for too few pages for the tokens it does not keep (none at all included:
    that once "completed" with no KV moved) fails on both sides at once, naming the page
    counts and sizes, and leaves no room behind."""
    dmodel = MODEL.model_copy(update={"page_size": 4})
    with pair(config(), dmodel=dmodel) as p:
        n = 4
        r = p.decode.receiver(11, p.addr)
        r.init()
        r.send_metadata(np.arange(pages) + 5, aux_index=1, cached_tokens=cached)
        s = p.prefill.sender(11)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        t0 = time.monotonic()
        s.init(n, aux_index=2)
        with contextlib.suppress(KVWireError):  # may already be raised on the engine thread
            s.send(np.arange(n) + 3, last=True)
        wait_for(lambda: r.poll() == KVPoll.Failed == s.poll())
        assert time.monotonic() - t0 < 5.0  # at once, not by the waiting timeout
        want = f"asks for {pages} pages of 4 tokens, which no prompt of 4 prefill pages of 2"
        for side in (r, s):
            with pytest.raises(KVWireError, match=want):
                side.failure_exception()
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
