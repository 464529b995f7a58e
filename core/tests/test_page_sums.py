"""KV checksums from a chunk's page form (issue 26 item 1): the page-form sums equal the
row-form sums bit for bit (an unchanged peer, or a link summed as rows, still agrees), on
both sides of every link with a page form, and catch a flipped byte and a page written to
the wrong place. About a second. The device kernel is checked against this NumPy path under
Triton's CPU interpreter in core/tests/test_checksums.py (one interpreter start for both
kernels).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.config import KVWireConfig
from kvwire.descriptors import ADDR, LEN
from kvwire.errors import DescriptorError
from kvwire.index import EqualTPMapper, HeadSliceMapper, IndexMapper, MLAMapper, default_mapper_name
from kvwire.index.ranks import source_ranks
from kvwire.integrity import RowHasher, add_sums, mismatched_layers
from kvwire.layout import ModelSpec, RankPosition
from kvwire.page_form import PageSide, page_sides
from kvwire.session.checksums import LandedSums, SentSums
from kvwire.testing.kvfill import make_pool

MAPPERS: dict[str, type[IndexMapper]] = {
    "equal_tp": EqualTPMapper,
    "mla": MLAMapper,
    "head_slice": HeadSliceMapper,
}
SLOTS = 6


class Link:
    """Two filled pools (kept alive here) and the core mapper between them."""

    def __init__(
        self, heads: int, tp: tuple[int, int], ranks: tuple[int, int], mla: bool, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        pools = []
        for i in (0, 1):
            model = ModelSpec(
                num_layers=3, total_kv_heads=heads, head_dim=4, dtype="int32", page_size=4,
                is_mla=mla,
            )  # fmt: skip
            layout, arrs = make_pool(model, RankPosition(tp_size=tp[i], tp_rank=ranks[i]), SLOTS)
            for a in arrs:
                flat = a.reshape(-1).view(np.uint8)
                flat[:] = rng.integers(0, 256, flat.size, dtype=np.uint8)
            pools.append((layout, arrs))
        (self.src, self.src_arrs), (self.dst, self.dst_arrs) = pools
        self.mapper = MAPPERS[default_mapper_name(self.src, self.dst)](self.src, self.dst)
        self.tables = self.mapper.build_tables()

    def copy_rows(self, src_idx: np.ndarray, dst_idx: np.ndarray) -> None:
        """Move rows as a transport would (a byte copy per row: tiny chunks only)."""
        s, d = self.tables.src, self.tables.dst
        for i, j in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
            ctypes.memmove(int(d[j, ADDR]), int(s[i, ADDR]), int(s[i, LEN]))


@st.composite
def links(draw: st.DrawFn) -> Link:
    """A link whose chunks have a page form: equal TP, head slices (TP 2 -> 1, 1 -> 2, GQA
    replication) or an MLA sender."""
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4]))
    tp = (draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4])))
    d = draw(st.integers(0, tp[1] - 1))
    s = 0 if mla else draw(st.sampled_from(list(source_ranks(d, tp[0], tp[1]))))
    return Link(heads, tp, (s, d), mla, draw(st.integers(0, 1 << 30)))


@settings(max_examples=40, deadline=None)
@given(lk=links(), data=st.data())
def test_page_form_sums_equal_row_form_sums_on_both_sides(lk: Link, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, SLOTS))
    sp = np.array(data.draw(st.permutations(range(SLOTS)))[:n], dtype=np.int64)
    dp = np.array(data.draw(st.permutations(range(SLOTS)))[:n], dtype=np.int64)
    chunk = lk.mapper.page_chunk(sp, dp)
    if chunk is None:  # an MLA dummy sender: rows (none) only
        assert lk.mapper.is_dummy
        return
    src_side, dst_side = page_sides(chunk.geometry, lk.tables.src, lk.tables.dst)
    si, di = lk.mapper.map_chunk(sp, dp)
    keys = lk.tables.dst[di, ADDR]
    prefill, decode = RowHasher(lk.src), RowHasher(lk.dst)
    rows_sent = prefill.sums(lk.tables.src, si, keys)
    sent = prefill.page_sums(src_side, sp, dst_side, dp)
    assert sent == rows_sent and sent
    layer = data.draw(st.integers(0, 2))
    assert prefill.page_sums(src_side, sp, dst_side, dp, range(layer, layer + 1)) == {
        layer: sent[layer]
    }
    assert prefill.page_sums(src_side, sp, dst_side, dp, [layer]) == {layer: sent[layer]}
    # decode, before and after the chunk's rows moved: what landed sums to what was sent
    assert decode.page_sums(dst_side, dp, dst_side, dp) == decode.sums(lk.tables.dst, di, keys)
    lk.copy_rows(si, di)
    landed = decode.page_sums(dst_side, dp, dst_side, dp)
    assert landed == sent
    # and through the link objects each side builds (SentSums, LandedSums)
    assert SentSums(lk.mapper, lk.src).chunk(sp, dp) == sent
    got = LandedSums(KVWireConfig(), lk.src, lk.dst).chunk(n, dp, 0, (0, n))
    assert got == sent
    # a flipped byte in one landed row changes its layer's sum
    row = data.draw(st.integers(0, si.size - 1))
    addr = int(lk.tables.dst[di[row], ADDR]) + data.draw(st.integers(0, chunk.geometry.n - 1))
    byte = ctypes.c_uint8.from_address(addr)
    byte.value ^= 0x04
    bad = decode.page_sums(dst_side, dp, dst_side, dp)
    flipped = decode.row_layers(lk.tables.dst, di[row : row + 1]).tolist()
    assert mismatched_layers(sent, bad) == flipped
    byte.value ^= 0x04


def test_a_page_written_to_the_wrong_place_is_caught() -> None:
    """The right bytes in the wrong destination page (a transport that swapped two pages,
    or wrote one page twice) are caught in every layer the swap touched."""
    lk = Link(4, (2, 1), (1, 0), False, 3)  # a TP 2 -> 1 head slice
    sp, dp = np.array([0, 3, 5]), np.array([4, 1, 2])
    chunk = lk.mapper.page_chunk(sp, dp)
    assert chunk is not None and chunk.geometry.tokens > 1, "a head slice: pieces per page"
    src_side, dst_side = page_sides(chunk.geometry, lk.tables.src, lk.tables.dst)
    sent = RowHasher(lk.src).page_sums(src_side, sp, dst_side, dp)
    swapped = dp[[1, 0, 2]]
    si, di = lk.mapper.map_chunk(sp, swapped)
    lk.copy_rows(si, di)
    decode = RowHasher(lk.dst)
    assert mismatched_layers(sent, decode.page_sums(dst_side, dp, dst_side, dp)) == [0, 1, 2]
    si, di = lk.mapper.map_chunk(sp, dp)
    lk.copy_rows(si, di)
    assert decode.page_sums(dst_side, dp, dst_side, dp) == sent
    # the pages of only the first pair of layer 1 swapped: only layer 1 differs
    g = chunk.geometry
    pair = int(np.flatnonzero(decode._pairs(dst_side)[1] == 1)[0])
    n_pair = sp.size * g.tokens
    s1, d1 = si[pair * n_pair : (pair + 1) * n_pair], di[pair * n_pair : (pair + 1) * n_pair]
    lk.copy_rows(np.roll(s1, g.tokens), d1)  # each page's pieces into the next page
    assert mismatched_layers(sent, decode.page_sums(dst_side, dp, dst_side, dp)) == [1]


def test_bad_page_lists_and_sides_are_refused() -> None:
    lk = Link(2, (1, 1), (0, 0), False, 4)
    chunk = lk.mapper.page_chunk([0], [1])
    assert chunk is not None
    src_side, dst_side = page_sides(chunk.geometry, lk.tables.src, lk.tables.dst)
    h = RowHasher(lk.src)
    with pytest.raises(DescriptorError, match="out of range"):
        h.page_sums(src_side, np.array([SLOTS]), dst_side, np.array([0]))
    with pytest.raises(DescriptorError, match="2 checksummed pages but 1 destination"):
        h.page_sums(src_side, np.array([0, 1]), dst_side, np.array([0]))
    other = PageSide(dst_side.base[:1], dst_side.slot, dst_side.row, dst_side.n, 1, SLOTS)
    with pytest.raises(DescriptorError, match="not one geometry's"):
        h.page_sums(src_side, np.array([0]), other, np.array([0]))
    # a side reaching past this rank's buffers (the other pool's side, or a wrong stride)
    with pytest.raises(DescriptorError, match="outside the rank's KV buffers"):
        h.page_sums(dst_side, np.array([0]), dst_side, np.array([0]))
    far = PageSide(src_side.base, src_side.slot * 2, src_side.row, src_side.n, 1, SLOTS)
    with pytest.raises(DescriptorError, match="outside the rank's KV buffers"):
        RowHasher(lk.src).page_sums(far, np.array([0]), dst_side, np.array([0]))
    assert h.page_sums(src_side, np.array([], np.int64), dst_side, np.array([], np.int64)) == {}


def test_groups_of_layers_add_up_to_the_chunk() -> None:
    lk = Link(4, (1, 2), (0, 1), False, 9)  # a TP 1 -> 2 head slice
    sp, dp = np.array([2, 0]), np.array([5, 3])
    sent = SentSums(lk.mapper, lk.src)
    whole = sent.chunk(sp, dp)
    parts: dict[int, int] = {}
    for a in range(3):
        add_sums(parts, sent.chunk(sp, dp, (a, a + 1)))
    assert parts == whole and set(whole) == {0, 1, 2}


def test_a_checked_transfer_is_summed_from_pages_on_both_sides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two managers over tcp, a chunked request checked end to end: every chunk is summed
    from its page form on prefill and on decode (no row list is summed), and lands verified.
    Heterogeneous TP end to end (head slices) runs across processes in
    tests/test_checksums_cluster.py."""
    from kvwire.session import KVPoll
    from kvwire.testing.kvfill import count_mismatches, fill_pages
    from kvwire.testing.pair import config, pair, wait_for

    calls = {"pages": 0, "rows": 0}
    page_sums, sums = RowHasher.page_sums, RowHasher.sums

    def counted_pages(self: RowHasher, *args: object, **kw: object) -> object:
        calls["pages"] += 1
        return page_sums(self, *args, **kw)  # type: ignore[arg-type]

    def counted_rows(self: RowHasher, *args: object, **kw: object) -> object:
        calls["rows"] += 1
        return sums(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(RowHasher, "page_sums", counted_pages)
    monkeypatch.setattr(RowHasher, "sums", counted_rows)
    with pair(config(), config(kv_checksum=True)) as p:
        r = p.decode.receiver(5, p.addr)
        r.init()
        dst = np.array([7, 3, 5, 1])
        r.send_metadata(dst, aux_index=1, cached_tokens=0)
        s = p.prefill.sender(5)
        src = np.array([2, 6, 4, 0])
        fill_pages(p.play, p.parr, src, 0)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(4, aux_index=2)
        s.send(src[:3], last=False)
        s.send(src[3:], last=True)
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll())
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        assert calls == {"pages": 4, "rows": 0}, calls  # 2 chunks, each summed on both sides
        r.clear()
        s.clear()


def test_a_checked_page_form_chunk_is_posted_as_pages_its_rows_never_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefill's worker with checksums on, a GPU pool's hasher (it never cuts a chunk in
    pieces) and a backend with page writes (cudaipc): the chunk's segment goes to
    ``submit_pages`` and its rows are never expanded, neither to cut pieces nor to sum it."""
    from types import SimpleNamespace

    from kvwire.session.prefill.posting import submit_rows, summed_pieces
    from kvwire.staging import ChunkPlan

    lk = Link(4, (2, 1), (1, 0), False, 5)  # a TP 2 -> 1 head slice
    sent = SentSums(lk.mapper, lk.src)
    monkeypatch.setattr(sent.hasher, "PIECE_BYTES", 0)  # as DeviceRowHasher
    sp, dp = np.array([5, 1, 3]), np.array([0, 4, 2])
    plan = ChunkPlan.direct(lk.mapper, sp, dp)
    seg = plan.segment("kv")
    job = SimpleNamespace(
        link=SimpleNamespace(checksums=sent), pool="kv", target=SimpleNamespace(table="kv")
    )
    segs, pieces = summed_pieces(job, plan, [seg], evented=True)  # type: ignore[arg-type]
    assert pieces is None and segs == [seg]
    si, di = lk.mapper.map_chunk(sp, dp)  # the same chunk as rows, for the expected sums
    assert sent.chunk(sp, dp) == RowHasher(lk.src).sums(lk.tables.src, si, lk.tables.dst[di, ADDR])
    posted: list[object] = []
    backend = SimpleNamespace(
        capabilities=SimpleNamespace(page_writes=True),
        submit_pages=lambda op, pair, pages, note, wake: posted.append(pages) or "handle",
    )
    assert submit_rows(backend, None, seg, b"note", lambda: None) == "handle"  # type: ignore[arg-type]
    assert posted == [seg.pages] and seg.pages is not None
    assert seg._src is None and seg._dst is None, "the segment's rows were expanded"
