"""Bulk staging's kernels compiled at a link's handshake (:mod:`kvwire.movers.warmup`):
prefill warms the link's gather and decode its scatter, each with the slice and units its
chunks will move, on the strategy's warm-up thread; and a warm-up launches nothing. No GPU
here: the fused moves run on Triton's interpreter, which compiles nothing (the compile is
checked on two GPUs by ``scripts/gpu_warm_check.py --staged``)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from kvwire.index.equal_tp import EqualTPMapper
from kvwire.index.head_slice import HeadSliceMapper
from kvwire.layout import ModelSpec, RankPosition
from kvwire.movers.warmup import Warmer
from kvwire.staging.base import StagingContext
from kvwire.staging.bulk import BulkOptions, BulkStaging
from kvwire.staging.bulk_ring import unit_tokens
from kvwire.staging.kernels import KVTensors
from kvwire.testing.kvfill import make_pool
from kvwire.testing.pair import wait_for

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=2)
OPTS: dict[str, Any] = {
    "ring_bytes": 64 * 1024,
    "buffer_bytes": 4096,
    "block_bytes": 1024,
    "buffers_per_worker": 1,
    "equal_tp": "always",
}


def _strategy(role: str, tp: int = 1, rank: int = 0) -> tuple[BulkStaging, Any]:
    layout, arrays = make_pool(MODEL, RankPosition(tp_size=tp, tp_rank=rank), 16)
    strat = BulkStaging(BulkOptions(**OPTS))
    strat.setup(
        StagingContext(layout, lambda r: None, lambda r: None, role=role, kv_tensors=arrays)
    )
    side = strat.ring or strat.writer
    assert side is not None
    side.kv.moves = side.kv.fused_moves("cpu")  # the GPU path's moves, interpreted
    return strat, layout


@pytest.mark.parametrize("tp", [1, 2], ids=["equal-tp", "tp-2-to-1"])
def test_each_side_warms_its_links_move_at_the_handshake(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tp: int
) -> None:
    """Prefill's link staging warms its gather of the mapper's source buffers and slice,
    decode's link its scatter of the destination buffers and slice, each once per link and
    logged; the link's staging tables come back as before."""
    pytest.importorskip("triton")
    calls: list[tuple[str, list[int], int, int, int, bool]] = []

    def warm(self: KVTensors, bufs: Any, lo: int, hi: int, unit: int = 0, *, to_pool: bool) -> int:
        calls.append(("decode" if to_pool else "prefill", list(bufs), lo, hi, unit, to_pool))
        return 1

    monkeypatch.setattr(KVTensors, "warm", warm)
    caplog.set_level(logging.INFO, logger="kvwire.movers.warmup")
    pre, play = _strategy("prefill", tp, tp - 1)
    dec, dlay = _strategy("decode")
    try:
        mapper = EqualTPMapper(play, dlay) if tp == 1 else HeadSliceMapper(play, dlay)
        sl = mapper.staged_slice()
        assert sl is not None
        dec.on_link("p", "ep-p", mapper)
        tables = pre.link_tables(mapper, dec.describe(), session="d")
        assert "staging" in tables
        wait_for(lambda: len(calls) == 2)
        ut = unit_tokens(mapper)  # the page, where page sizes are equal
        want_pre = ("prefill", list(mapper.src_buf), sl.src_lo, sl.src_lo + sl.nbytes, ut, False)
        want_dec = ("decode", list(mapper.dst_buf), sl.dst_lo, sl.dst_lo + sl.nbytes, ut, True)
        assert sorted(calls) == sorted([want_pre, want_dec])
        ready = "1 kernel variant(s) compiled"
        wait_for(lambda: sum(ready in r.getMessage() for r in caplog.records) == 2)
    finally:
        pre.close()
        dec.close()


def test_a_warm_up_launches_nothing() -> None:
    """Under the copier's compiling mode a gather and a scatter of the fused moves (here on
    Triton's interpreter) move no byte: the pool and the block stay as they were."""
    pytest.importorskip("triton")
    layout, arrays = make_pool(MODEL, RankPosition(), 8)
    rng = np.random.default_rng(3)
    for a in arrays:
        a[...] = rng.integers(-(2**31), 2**31 - 1, a.shape, dtype=np.int64).astype(np.int32)
    before = [a.copy() for a in arrays]
    kv = KVTensors(layout, arrays)
    kv.moves = kv.fused_moves("cpu")
    assert kv.moves is not None
    bufs = np.arange(len(layout.buffers), dtype=np.int64)
    row = layout.token_row_bytes
    with kv.moves.compiling() as done:
        block = np.zeros(4096, dtype=np.uint8)
        kv.moves.pages(bufs, np.array([1, 2]), 0, row, block.ctypes.data, to_pool=True,
                       stream=None)  # fmt: skip
        kv.moves.pages(bufs, np.array([3]), 0, row, block.ctypes.data, to_pool=False, stream=None)
    assert done == []  # the interpreter compiles nothing
    assert not block.any()
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before, strict=True))
    assert kv.warm(bufs, 0, row, to_pool=True) == 0


def test_a_closed_warmer_runs_nothing_and_a_failed_warm_up_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []
    w = Warmer("test")

    def fails() -> int:
        raise RuntimeError("stand-in compile failure")

    caplog.set_level(logging.WARNING, logger="kvwire.movers.warmup")
    w.submit("a failing warm-up", fails)
    w.submit("a warm-up", lambda: ran.append("one") or 0)
    wait_for(lambda: ran == ["one"])
    assert any("compiling a failing warm-up failed" in r.getMessage() for r in caplog.records)
    w.close()
    w.submit("after close", lambda: ran.append("two") or 0)
    assert ran == ["one"]


def test_pools_without_fused_moves_start_no_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host pools (no fused moves) compile nothing: the strategy hands no warm-up over."""
    submitted: list[str] = []
    monkeypatch.setattr(Warmer, "submit", lambda self, what, warm: submitted.append(what))
    pre, play = _strategy("prefill")
    dec, dlay = _strategy("decode")
    try:
        for s in (pre, dec):
            side = s.ring or s.writer
            assert side is not None
            side.kv.moves = None
        mapper = EqualTPMapper(play, dlay)
        dec.on_link("p", "ep-p", mapper)
        assert "staging" in pre.link_tables(mapper, dec.describe(), session="d")
        assert submitted == []
    finally:
        pre.close()
        dec.close()


def test_each_side_warms_a_link_of_its_own_layout_at_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    """At setup, before any link, a pool with fused moves warms the whole-row gather
    (prefill) or scatter (decode) of every buffer, one page a unit: the move of an
    equal-TP link to a rank of its own layout."""
    pytest.importorskip("triton")
    calls: list[tuple[list[int], int, int, int, bool]] = []

    def warm(self: KVTensors, bufs: Any, lo: int, hi: int, unit: int = 0, *, to_pool: bool) -> int:
        calls.append((list(bufs), lo, hi, unit, to_pool))
        return 0

    class Fused(KVTensors):  # the GPU path's moves, interpreted, from construction on
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.moves = self.fused_moves("cpu")

    monkeypatch.setattr(KVTensors, "warm", warm)
    monkeypatch.setattr("kvwire.staging.bulk.KVTensors", Fused)
    for role, to_pool in (("prefill", False), ("decode", True)):
        calls.clear()
        strat, layout = _strategy(role)
        try:
            wait_for(lambda: len(calls) == 1)
            every = list(range(len(layout.buffers)))
            assert calls == [(every, 0, layout.token_row_bytes, MODEL.page_size, to_pool)]
        finally:
            strat.close()
