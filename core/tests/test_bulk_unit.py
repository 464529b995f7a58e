"""The bulk staging strategy on its own (no processes): request ordering and retries, grants,
readiness, staging buffers given back, oversize fallback, gather/scatter round trip."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvwire.control.wire import (
    Message,
    StagingDeny,
    StagingGrant,
    StagingRequest,
    StagingWatermark,
)
from kvwire.errors import ConfigError, TransferError
from kvwire.index.head_slice import HeadSliceMapper
from kvwire.layout import MemoryRegion, ModelSpec, RankPosition
from kvwire.staging.base import StagingContext
from kvwire.staging.bulk import FALLBACKS, BulkOptions, BulkStaging, block_bytes
from kvwire.testing.kvfill import fill_pages, make_pool, page_values

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=2)
OPTS = {
    "ring_bytes": 64 * 1024,
    "buffer_bytes": 4096,
    "block_bytes": 1024,
    "buffers_per_worker": 1,
    "request_retry_s": 0.05,
}


def make(role: str, tp: int, rank: int, sent: list[tuple[str, Message]]) -> tuple[Any, ...]:
    layout, arrays = make_pool(MODEL, RankPosition(tp_size=tp, tp_rank=rank), 16)
    registered: list[MemoryRegion] = []
    strat = BulkStaging(BulkOptions(**OPTS))
    strat.setup(
        StagingContext(
            layout,
            registered.extend,
            lambda regions: None,
            role=role,
            num_workers=1,
            kv_tensors=arrays,
            send_fn=lambda ep, msg: sent.append((ep, msg)) is None,
        )
    )
    return strat, layout, arrays, registered


def request(mapper: HeadSliceMapper, chunk: int, npages: int) -> StagingRequest:
    return StagingRequest(
        room=7,
        sender_id=0,
        session="p",
        chunk_id=chunk,
        nbytes=block_bytes(mapper, npages),
        dst_start=0,
        npages=npages,
    )


def grant(alloc: Any, chunk: int, wm: tuple[int, int] = (0, 0)) -> StagingGrant:
    return StagingGrant(
        room=7,
        sender_id=0,
        session="d",
        chunk_id=chunk,
        alloc_id=alloc.id,
        round=alloc.round,
        offset=alloc.offset,
        end=alloc.end,
        wm_round=wm[0],
        wm_tail=wm[1],
    )


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="multiple of block_bytes"):
        BulkOptions(ring_bytes=1000, block_bytes=1024)
    with pytest.raises(ValueError, match="exceeds ring_bytes"):
        BulkOptions(ring_bytes=4096, buffer_bytes=8192, block_bytes=1024)
    with pytest.raises(ConfigError, match="kv_tensors"):
        layout, _ = make_pool(MODEL, RankPosition(), 4)
        BulkStaging().setup(StagingContext(layout, lambda r: None, lambda r: None))


def test_gather_write_scatter_round_trip_and_buffer_reuse() -> None:
    sent: list[tuple[str, Message]] = []
    pre, play, parr, preg = make("prefill", 2, 1, sent)
    dec, dlay, darr, dreg = make("decode", 1, 0, [])
    assert preg and dreg  # memory went through register_fn
    mapper = HeadSliceMapper(play, dlay)
    src, dst = np.array([3, 5]), np.array([9, 2])
    fill_pages(play, parr, src, 0)
    req = request(mapper, 0, 2)
    pre.request(req, "d", "tcp://decode", 60.0)
    assert sent == [("tcp://decode", req)]
    assert pre.plan(7, 0, mapper, src, dst, dest="d") is None  # no grant yet
    alloc = dec.grant(7, "p", 0, req.nbytes, 0, 2)
    pre.on_control(grant(alloc, 0))
    plan = pre.plan(7, 0, mapper, src, dst, dest="d")
    assert plan is not None and plan.table == "staging" and plan.what == "staged"
    assert plan.src_idx.size == -(-req.nbytes // OPTS["block_bytes"])
    # the "transfer": copy the gathered blocks into the ring
    b = OPTS["block_bytes"]
    for s_row, d_row in zip(plan.src_idx, plan.dst_idx, strict=True):
        dec._ring_mem[d_row * b : (d_row + 1) * b] = pre._buffers[s_row * b : (s_row + 1) * b]
    dmapper = HeadSliceMapper(play, dlay)
    dec.scatter(7, "p", 0, dmapper, dst)
    # prefill rank 1 of TP 2 wrote heads 2-3 of every decode token row; heads 0-1 untouched
    for b, arr in enumerate(darr):
        want = page_values(dlay, b, 0, 2)
        assert np.array_equal(arr[dst][:, :, 2:, :], want[:, :, 2:, :])
        assert not arr[dst][:, :, :2, :].any()
    assert dec.ring.live == 0
    # the buffer is busy until the write ends, then reusable
    pre.request(request(mapper, 1, 2), "d", "tcp://decode", 60.0)
    alloc2 = dec.grant(7, "p", 1, req.nbytes, 0, 2)
    pre.on_control(grant(alloc2, 1))
    assert pre.plan(7, 1, mapper, src, dst, dest="d") is None  # the only buffer is in use
    pre.on_sent(7, plan, True)
    assert pre.plan(7, 1, mapper, src, dst, dest="d") is not None


def test_a_buffer_comes_back_when_the_write_was_never_posted() -> None:
    sent: list[tuple[str, Message]] = []
    pre, play, _, _ = make("prefill", 2, 0, sent)
    dec, dlay, _, _ = make("decode", 1, 0, [])
    mapper = HeadSliceMapper(play, dlay)
    for chunk in (0, 1):
        req = request(mapper, chunk, 1)
        pre.request(req, "d", "ep", 60.0)
        pre.on_control(grant(dec.grant(7, "p", chunk, req.nbytes, 0, 1), chunk))
    plan = pre.plan(7, 0, mapper, [1], [1], dest="d")
    assert plan is not None
    pre.on_sent(7, plan, False)  # what the pipeline does when submit raises
    assert pre.plan(7, 1, mapper, [1], [1], dest="d") is not None


def test_requests_of_a_room_go_out_in_order_and_are_retried() -> None:
    sent: list[tuple[str, Message]] = []
    pre, play, _, _ = make("prefill", 2, 0, sent)
    _, dlay, _, _ = make("decode", 1, 0, [])
    mapper = HeadSliceMapper(play, dlay)
    for chunk in range(3):
        pre.request(request(mapper, chunk, 1), "d", "ep", 60.0)
    assert [m.chunk_id for _, m in sent] == [0]  # later chunks wait for grant 0
    time.sleep(0.06)
    assert pre.plan(7, 0, mapper, [1], [1], dest="d") is None
    assert [m.chunk_id for _, m in sent] == [0, 0]  # retried
    pre.on_control(
        StagingGrant(
            room=7,
            sender_id=0,
            session="d",
            chunk_id=0,
            alloc_id=1,
            round=0,
            offset=0,
            end=1024,
            wm_round=0,
            wm_tail=0,
        )
    )
    assert [m.chunk_id for _, m in sent] == [0, 0, 1]
    pre.on_control(
        StagingGrant(
            room=7,
            sender_id=0,
            session="d",
            chunk_id=0,
            alloc_id=1,
            round=0,
            offset=0,
            end=1024,
            wm_round=0,
            wm_tail=0,
        )
    )
    assert len(sent) == 3  # a duplicate grant sends nothing more


def test_readiness_waits_for_the_watermark() -> None:
    pre, play, _, _ = make("prefill", 2, 0, [])
    _, dlay, _, _ = make("decode", 1, 0, [])
    mapper = HeadSliceMapper(play, dlay)
    pre.request(request(mapper, 0, 1), "d", "ep", 60.0)
    pre.on_control(
        StagingGrant(
            room=7,
            sender_id=0,
            session="d",
            chunk_id=0,
            alloc_id=9,
            round=2,
            offset=0,
            end=1024,
            wm_round=1,
            wm_tail=0,
        )
    )
    assert pre.plan(7, 0, mapper, [1], [1], dest="d") is None  # round 1 still holds it
    pre.on_control(StagingWatermark(session="d", round=1, tail=1024))
    assert pre.plan(7, 0, mapper, [1], [1], dest="d") is not None


def test_deny_and_missing_grant_fail_the_chunk() -> None:
    pre, play, _, _ = make("prefill", 2, 0, [])
    _, dlay, _, _ = make("decode", 1, 0, [])
    mapper = HeadSliceMapper(play, dlay)
    pre.request(request(mapper, 0, 1), "d", "ep", 60.0)
    pre.on_control(StagingDeny(room=7, sender_id=0, session="d", chunk_id=0, reason="gone"))
    with pytest.raises(TransferError, match="refused staging space: gone"):
        pre.plan(7, 0, mapper, [1], [1], dest="d")
    pre.request(request(mapper, 1, 1), "d", "ep", 0.0)
    with pytest.raises(TransferError, match="no staging grant"):
        pre.plan(7, 1, mapper, [1], [1], dest="d")


def test_oversize_chunks_fall_back_before_allocating_and_are_counted() -> None:
    pre, play, _, _ = make("prefill", 2, 0, [])
    _, dlay, _, _ = make("decode", 1, 0, [])
    mapper = HeadSliceMapper(play, dlay)
    before = FALLBACKS._value.get()
    too_many = OPTS["buffer_bytes"] // block_bytes(mapper, 1) + 1
    assert pre.fits(mapper, 1)
    assert not pre.fits(mapper, too_many)
    assert FALLBACKS._value.get() == before + 1
    strict = BulkStaging(BulkOptions(**{**OPTS, "fallback_oversize": False}))
    with pytest.raises(ConfigError, match="fallback_oversize"):
        strict.fits(mapper, too_many)
