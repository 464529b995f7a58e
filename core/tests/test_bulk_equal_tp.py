"""Bulk staging of equal-TP links (whole pages) on its own (no processes): the mapper seam
(:meth:`~kvwire.index.base.IndexMapper.staged_slice`), the rule that decides which equal-TP
links stage, a gather -> write -> scatter round trip through the seam's hooks, and the byte
runs the GPU path hands the fused mover (:meth:`KVTensors.runs`), checked against the indexed
copies with the CPU reference mover as the oracle."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.control.wire import Message
from kvwire.index.equal_tp import EqualTPMapper, MLAMapper
from kvwire.index.head_slice import HeadSliceMapper
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.movers import copy_runs_reference
from kvwire.regions import MemKind
from kvwire.staging.base import ArrivedChunk, PlanRequest, QueuedChunk, StagingContext
from kvwire.staging.bulk import BulkOptions, BulkStaging, block_bytes
from kvwire.staging.kernels import KVTensors, block_view
from kvwire.testing.kvfill import fill_pages, make_pool, page_values

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=2)
OPTS: dict[str, Any] = {
    "ring_bytes": 64 * 1024,
    "buffer_bytes": 4096,
    "block_bytes": 1024,
    "buffers_per_worker": 1,
    "request_retry_s": 0.05,
}
DST = np.array([9, 2, 4, 6], dtype=np.int64)


def _make(role: str, sent: list[tuple[str, Message]], session: str, opts: dict[str, Any]) -> Any:
    layout, arrays = make_pool(MODEL, RankPosition(tp_size=1, tp_rank=0), 16)
    strat = BulkStaging(BulkOptions(**opts))
    strat.setup(
        StagingContext(
            layout,
            lambda regions: None,
            lambda regions: None,
            role=role,
            kv_tensors=arrays,
            send_fn=lambda ep, msg: sent.append((ep, msg)) is None,
            session=session,
            room_pages=lambda room: DST if room == 7 else None,
        )
    )
    return strat, layout, arrays


def _relay(src: list[tuple[str, Message]], dst: BulkStaging, endpoint: str) -> None:
    while src:
        _, msg = src.pop(0)
        if getattr(msg, "strategy", None) == "bulk":
            dst.on_message(endpoint, msg)  # type: ignore[arg-type]


def test_staged_slices_of_the_core_mappers() -> None:
    one = RankPosition(tp_size=1, tp_rank=0)
    a, _ = make_pool(MODEL, one, 4)
    b, _ = make_pool(MODEL, one, 4)
    sl = EqualTPMapper(a, b).staged_slice()
    assert sl is not None and sl.whole_rows and (sl.src_lo, sl.dst_lo) == (0, 0)
    assert sl.nbytes == a.token_row_bytes
    mla = MODEL.model_copy(update={"is_mla": True, "total_kv_heads": 1})
    m1, _ = make_pool(mla, one, 4)
    m2, _ = make_pool(mla, one, 4)
    ml = MLAMapper(m1, m2).staged_slice()  # MLA stages whole latent rows
    assert ml is not None and ml.whole_rows and ml.nbytes == m1.token_row_bytes
    p1, _ = make_pool(MODEL, RankPosition(tp_size=2, tp_rank=1), 4)
    hs = HeadSliceMapper(p1, b).staged_slice()
    assert hs is not None and not hs.whole_rows
    assert (hs.src_lo, hs.dst_lo, hs.nbytes) == (0, 2 * 32, 2 * 32)  # heads 2-3 of decode
    small = MODEL.model_copy(update={"page_size": 1})
    c, _ = make_pool(small, one, 8)
    conv = EqualTPMapper(a, c).staged_slice()  # page-size conversion: whole rows by granule
    assert conv is not None and conv.whole_rows and conv.nbytes == a.token_row_bytes


def test_the_rule_stages_equal_tp_on_gpu_pools_with_small_pages_only() -> None:
    sent: list[tuple[str, Message]] = []
    vram = {"strategy": "bulk", "wire": 1, "ring_addr": 1 << 20, "ring_bytes": 65536,
            "block_bytes": 1024, "device_id": 0, "kind": int(MemKind.VRAM)}  # fmt: skip
    dram = {**vram, "kind": int(MemKind.DRAM)}
    from kvwire.staging.bulk_wire import WIRE_VERSION

    vram["wire"] = dram["wire"] = WIRE_VERSION
    auto, layout, _ = _make("prefill", sent, "p", OPTS)
    _, dlay, _ = _make("decode", sent, "d", OPTS)
    mapper = EqualTPMapper(layout, dlay)
    assert auto.link_tables(mapper, vram) == {}  # host pool here: per page
    auto.writer.kv.on_device = True  # as a GPU pool would be (the rule reads only this)
    assert "staging" in auto.link_tables(mapper, vram)
    assert auto.link_tables(mapper, dram) == {}  # decode's ring in host memory
    big = BulkStaging(BulkOptions(**OPTS, equal_tp_below_bytes=layout.page_bytes))
    big.writer = auto.writer
    assert big.link_tables(mapper, vram) == {}  # pages not below the threshold
    always, _, _ = _make("prefill", sent, "p", {**OPTS, "equal_tp": "always"})
    assert "staging" in always.link_tables(mapper, dram)
    never, _, _ = _make("prefill", sent, "p", {**OPTS, "equal_tp": "never"})
    never.writer.kv.on_device = True
    assert never.link_tables(mapper, vram) == {}


def test_auto_sends_small_equal_tp_chunks_per_page() -> None:
    """Under ``equal_tp="auto"`` a chunk below ``equal_tp_min_chunk_bytes`` asks for no ring
    space: the worker's plan is the mapper's own rows (per page)."""
    sent: list[tuple[str, Message]] = []
    one_page = 2 * 2 * 2 * 4 * 32  # pairs x page bytes
    opts = {**OPTS, "equal_tp_min_chunk_bytes": 2 * one_page}
    pre, play, _ = _make("prefill", sent, "p", opts)
    _, dlay, _ = _make("decode", [], "d", OPTS)
    mapper = EqualTPMapper(play, dlay)
    assert pre.small_whole_pages(mapper, 1) and not pre.small_whole_pages(mapper, 2)
    pre.on_queued(QueuedChunk(7, 0, mapper, 1, 0, "d", "ep-d", 0, "p", 60.0))
    assert sent == []  # no ask
    plan = pre.plan(PlanRequest(7, 0, mapper, np.array([3]), DST[:1], dest="d"))
    assert plan is not None and plan.table == "kv" and plan.src_idx.size == 2 * 2
    pre.on_queued(QueuedChunk(7, 1, mapper, 2, 1, "d", "ep-d", 0, "p", 60.0))
    assert len(sent) == 1  # big enough: staged
    always, _, _ = _make("prefill", [], "p", {**opts, "equal_tp": "always"})
    assert not always.small_whole_pages(mapper, 1)
    hetero, _ = make_pool(MODEL, RankPosition(tp_size=2, tp_rank=0), 16)
    assert not pre.small_whole_pages(HeadSliceMapper(hetero, dlay), 1)  # not equal TP


def test_equal_tp_round_trip_through_the_ring() -> None:
    to_d: list[tuple[str, Message]] = []
    to_p: list[tuple[str, Message]] = []
    opts = {**OPTS, "equal_tp": "always"}
    pre, play, parr = _make("prefill", to_d, "p", opts)
    dec, dlay, darr = _make("decode", to_p, "d", opts)
    mapper = EqualTPMapper(play, dlay)
    dec.on_link("p", "ep-p", EqualTPMapper(play, dlay))
    src, dst = np.array([3, 5, 11]), DST[:3]
    fill_pages(play, parr, src, 0)
    pre.on_queued(QueuedChunk(7, 0, mapper, 3, 0, "d", "ep-d", 0, "p", 60.0))
    _relay(to_d, dec, "ep-p")
    _relay(to_p, pre, "ep-d")
    plan = pre.plan(PlanRequest(7, 0, mapper, src, dst, dest="d"))
    assert plan is not None and plan.what == "staged"
    b = OPTS["block_bytes"]
    assert block_bytes(mapper, 3) == 2 * 2 * 3 * 2 * 4 * 32  # pairs x pages x page bytes
    assert plan.src_idx.size == -(-block_bytes(mapper, 3) // b)  # 3 descriptors, not 12
    ring, buffers = dec.ring.mem, pre.writer.buffers
    for s_row, d_row in zip(plan.src_idx, plan.dst_idx, strict=True):
        ring[d_row * b : (d_row + 1) * b] = buffers[s_row * b : (s_row + 1) * b]
    dec.on_arrival(ArrivedChunk(7, "p", 0, "staged", DST))
    for i, arr in enumerate(darr):
        assert np.array_equal(arr[dst], page_values(dlay, i, 0, 3))
        others = np.setdiff1d(np.arange(16), dst)
        assert not arr[others].any()  # nothing else written
    assert dec.ring.ring.live == 0
    pre.on_sent(7, plan, True)


def _pool_in(mem: np.ndarray, model: ModelSpec, slots: int, heads: int) -> tuple[Any, Any]:
    """KV buffers carved out of one byte array (so runs are offsets into it)."""
    shape = (slots, model.page_size, heads, model.head_dim)
    per = int(np.prod(shape)) * 4
    arrays = [mem[i * per : (i + 1) * per].view(np.int32).reshape(shape) for i in range(4)]
    layout = KVLayout.from_tensors(model, arrays, RankPosition(tp_size=1, tp_rank=0))
    return layout, arrays


@settings(max_examples=40, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    heads=st.integers(1, 4),
    lo_heads=st.data(),
    pages=st.lists(st.integers(0, 7), min_size=1, max_size=6, unique=True),
    seed=st.integers(0, 2**31),
)
def test_mover_runs_match_indexed_copies(
    page_size: int, heads: int, lo_heads: Any, pages: list[int], seed: int
) -> None:
    """The runs of a gather (and of a scatter) copied by the reference mover give exactly
    what the indexed copies give: whole rows and head slices, any page order."""
    model = ModelSpec(
        num_layers=2, total_kv_heads=heads, head_dim=4, dtype="int32", page_size=page_size
    )
    slots = 8
    hb = model.head_dim * 4
    pool_bytes = 4 * slots * page_size * heads * hb
    rng = np.random.default_rng(seed)
    a = lo_heads.draw(st.integers(0, heads - 1))
    z = lo_heads.draw(st.integers(a + 1, heads))
    lo, hi = a * hb, z * hb
    p = np.array(pages, dtype=np.int64)
    bufs = np.array([0, 2, 3], dtype=np.int64)
    nblock = bufs.size * p.size * page_size * (hi - lo)
    mem = rng.integers(0, 256, pool_bytes + nblock, dtype=np.uint8)
    layout, arrays = _pool_in(mem, model, slots, heads)
    kv = KVTensors(layout, arrays)
    base = mem.ctypes.data
    shape = (bufs.size, p.size, page_size, hi - lo)
    # gather: indexed copy into a separate block vs the runs into the block inside mem
    want = np.zeros(shape, dtype=np.uint8)
    kv.gather(bufs, p, lo, hi, want)
    pool, blk, lens = kv.runs(bufs, p, lo, hi, base + pool_bytes)
    assert pool.size == bufs.size * p.size * (1 if hi - lo == kv.row else page_size)
    copy_runs_reference(mem, pool - base, blk - base, lens)
    assert np.array_equal(block_view(mem, pool_bytes, shape), want)
    # scatter: fresh bytes in the block, written back both ways
    fresh = rng.integers(0, 256, shape, dtype=np.uint8)
    mem[pool_bytes:] = fresh.ravel()
    by_runs = mem.copy()
    copy_runs_reference(by_runs, blk - base, pool - base, lens)
    kv.scatter(bufs, p, lo, hi, fresh)  # writes into mem's pool
    assert np.array_equal(by_runs[:pool_bytes], mem[:pool_bytes])
