"""The bulk staging strategy on its own (no processes), driven through the staging seam's
hooks only (``on_queued``, ``on_message``, ``on_link``, ``plan``, ``on_sent``, ``on_arrival``):
request ordering and retries, grants, readiness, staging buffers given back, oversize
fallback, gather/scatter round trip, messages core routes without reading."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvwire.control.wire import Message, StagingMessage, WritesQuery
from kvwire.errors import ConfigError, TransferError
from kvwire.index.head_slice import HeadSliceMapper
from kvwire.layout import MemKind, MemoryRegion, ModelSpec, RankPosition
from kvwire.staging.base import ArrivedChunk, PlanRequest, QueuedChunk, StagingContext
from kvwire.staging.bulk import FALLBACKS, BulkOptions, BulkStaging, block_bytes
from kvwire.staging.bulk_ring import chunk_limit
from kvwire.staging.bulk_wire import Deny, Grant, Watermark
from kvwire.testing.kvfill import fill_pages, make_pool, page_values

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=2)
OPTS = {
    "ring_bytes": 64 * 1024,
    "buffer_bytes": 4096,
    "block_bytes": 1024,
    "buffers_per_worker": 1,
    "request_retry_s": 0.05,
}
#: Destination pages of room 7 on decode (what ``room_pages`` answers).
DST = np.array([9, 2, 4, 6], dtype=np.int64)


def make(
    role: str,
    tp: int,
    rank: int,
    sent: list[tuple[str, Message]],
    session: str,
    opts: dict[str, Any] | None = None,
    tensors: bool = True,
) -> tuple[Any, ...]:
    """A strategy of ``role`` on a fresh pool; ``tensors=False``: no ``kv_tensors`` (the
    strategy views the layout's buffers by address, as under an engine adapter)."""
    layout, arrays = make_pool(MODEL, RankPosition(tp_size=tp, tp_rank=rank), 16)
    registered: list[MemoryRegion] = []
    strat = BulkStaging(BulkOptions(**(opts or OPTS)))
    strat.setup(
        StagingContext(
            layout,
            registered.extend,
            lambda regions: None,
            role=role,
            num_workers=1,
            kv_tensors=arrays if tensors else None,
            send_fn=lambda ep, msg: sent.append((ep, msg)) is None,
            session=session,
            room_pages=lambda room: DST if room == 7 else None,
        )
    )
    return strat, layout, arrays, registered


def queued(
    mapper: HeadSliceMapper, chunk: int, npages: int, timeout_s: float = 60.0
) -> QueuedChunk:
    return QueuedChunk(7, chunk, mapper, npages, 0, "d", "ep-d", 0, "p", timeout_s)


def asks(sent: list[tuple[str, Message]]) -> list[int]:
    """Chunk ids of the asks prefill sent (in order)."""
    return [
        m.body["chunk_id"] for _, m in sent if isinstance(m, StagingMessage) and m.type == "ask"
    ]


def pair() -> tuple[Any, ...]:
    """A prefill rank 0 of TP 2 and a decode rank of TP 1, linked."""
    to_d: list[tuple[str, Message]] = []
    to_p: list[tuple[str, Message]] = []
    pre, play, _, _ = make("prefill", 2, 0, to_d, "p")
    dec, dlay, _, _ = make("decode", 1, 0, to_p, "d")
    mapper = HeadSliceMapper(play, dlay)
    dec.on_link("p", "ep-p", HeadSliceMapper(play, dlay))
    return pre, dec, mapper, to_d, to_p


def relay(src: list[tuple[str, Message]], dst: BulkStaging, endpoint: str) -> int:
    """Deliver the staging messages queued in ``src`` to ``dst`` (what core's router does)."""
    n = 0
    while src:
        _, msg = src.pop(0)
        if isinstance(msg, StagingMessage):
            dst.on_message(endpoint, msg)
            n += 1
    return n


def answer(body: Any) -> StagingMessage:
    return StagingMessage(session="d", strategy="bulk", type=body.type, body=body.model_dump())


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="multiple of block_bytes"):
        BulkOptions(ring_bytes=1000, block_bytes=1024)
    with pytest.raises(ValueError, match="exceeds ring_bytes"):
        BulkOptions(ring_bytes=4096, buffer_bytes=8192, block_bytes=1024)


@pytest.mark.parametrize("tensors", [True, False], ids=["kv_tensors", "layout_views"])
def test_gather_write_scatter_round_trip_and_buffer_reuse(tensors: bool) -> None:
    """With the engine's tensors, and without (views of the layout's buffers by address:
    the gather reads the pool prefill filled, the scatter writes the arrays decode reads)."""
    to_d: list[tuple[str, Message]] = []
    to_p: list[tuple[str, Message]] = []
    pre, play, parr, preg = make("prefill", 2, 1, to_d, "p", tensors=tensors)
    dec, dlay, darr, dreg = make("decode", 1, 0, to_p, "d", tensors=tensors)
    assert preg and dreg  # memory went through register_fn
    mapper = HeadSliceMapper(play, dlay)
    dec.on_link("p", "ep-p", HeadSliceMapper(play, dlay))
    src, dst = np.array([3, 5]), DST[:2]
    fill_pages(play, parr, src, 0)
    pre.on_queued(queued(mapper, 0, 2))
    assert asks(to_d) == [0] and to_d[0][0] == "ep-d"
    assert pre.plan(PlanRequest(7, 0, mapper, src, dst, dest="d")) is None  # no grant yet
    assert relay(to_d, dec, "ep-p") == 1  # decode grants ...
    assert [m.type for _, m in to_p] == ["grant"]
    relay(to_p, pre, "ep-d")  # ... prefill takes it
    plan = pre.plan(PlanRequest(7, 0, mapper, src, dst, dest="d"))
    assert plan is not None and plan.table == "staging" and plan.what == "staged"
    assert plan.src_idx.size == -(-block_bytes(mapper, 2) // OPTS["block_bytes"])
    # the "transfer": copy the gathered blocks into the ring
    b = OPTS["block_bytes"]
    ring, buffers = dec.ring.mem, pre.writer.buffers
    for s_row, d_row in zip(plan.src_idx, plan.dst_idx, strict=True):
        ring[d_row * b : (d_row + 1) * b] = buffers[s_row * b : (s_row + 1) * b]
    dec.on_arrival(ArrivedChunk(7, "p", 0, "staged", DST))
    # prefill rank 1 of TP 2 wrote heads 2-3 of every decode token row; heads 0-1 untouched
    for i, arr in enumerate(darr):
        want = page_values(dlay, i, 0, 2)
        assert np.array_equal(arr[dst][:, :, 2:, :], want[:, :, 2:, :])
        assert not arr[dst][:, :, :2, :].any()
    assert dec.ring.ring.live == 0
    assert [m.type for _, m in to_p] == ["watermark"]  # the freed space is announced
    to_p.clear()
    # a late duplicate ask for the placed chunk allocates nothing and gets no answer
    pre.on_queued(queued(mapper, 0, 2))
    relay(to_d, dec, "ep-p")
    assert to_p == [] and dec.ring.ring.live == 0
    pre.release(7)
    # the buffer is busy until the write ends, then reusable
    pre.on_queued(queued(mapper, 1, 2))
    relay(to_d, dec, "ep-p")
    relay(to_p, pre, "ep-d")
    assert (
        pre.plan(PlanRequest(7, 1, mapper, src, dst, dest="d")) is None
    )  # the only buffer is in use
    pre.on_sent(7, plan, True)
    assert pre.plan(PlanRequest(7, 1, mapper, src, dst, dest="d")) is not None


def test_decode_refuses_bad_asks_naming_why() -> None:
    pre, dec, mapper, to_d, to_p = pair()
    pre.on_queued(QueuedChunk(7, 0, mapper, 3, 2, "d", "ep-d", 0, "p", 60.0))  # pages 2..5 of 4
    relay(to_d, dec, "ep-p")
    ((_, deny),) = to_p
    assert deny.type == "deny" and "outside the 4 destination pages" in deny.body["reason"]
    relay(to_p, pre, "ep-d")
    with pytest.raises(TransferError, match="refused staging space: pages"):
        pre.plan(PlanRequest(7, 0, mapper, [1, 2, 3], DST[2:], dest="d"))
    # a room decode does not know, and a sender it never linked with
    pre.on_queued(QueuedChunk(8, 0, mapper, 1, 0, "d", "ep-d", 0, "p", 60.0))
    relay(to_d, dec, "ep-p")
    assert "not live on decode" in to_p.pop()[1].body["reason"]
    stranger = StagingMessage(
        session="x",
        strategy="bulk",
        type="ask",
        body=dict(
            room=7, sender_id=0, chunk_id=0, nbytes=block_bytes(mapper, 1), dst_start=0, npages=1
        ),
    )
    dec.on_message("ep-x", stranger)
    assert "does not stage for that sender" in to_p.pop()[1].body["reason"]
    # malformed bodies and unknown types are dropped without an answer or an allocation
    dec.on_message("ep-p", StagingMessage(session="p", strategy="bulk", type="ask", body={}))
    dec.on_message("ep-p", StagingMessage(session="p", strategy="bulk", type="zzz", body={}))
    assert to_p == [] and dec.ring.ring.live == 0


def test_a_buffer_comes_back_when_the_write_was_never_posted() -> None:
    pre, dec, mapper, to_d, to_p = pair()
    for chunk in (0, 1):
        pre.on_queued(queued(mapper, chunk, 1))
        relay(to_d, dec, "ep-p")
        relay(to_p, pre, "ep-d")
    plan = pre.plan(PlanRequest(7, 0, mapper, [1], [1], dest="d"))
    assert plan is not None
    pre.on_sent(7, plan, False)  # what the pipeline does when submit raises
    assert pre.plan(PlanRequest(7, 1, mapper, [1], [1], dest="d")) is not None


def test_requests_of_a_room_go_out_in_order_and_are_retried() -> None:
    pre, dec, mapper, to_d, to_p = pair()
    for chunk in range(3):
        pre.on_queued(queued(mapper, chunk, 1))
    assert asks(to_d) == [0]  # later chunks wait for grant 0
    time.sleep(0.06)
    assert pre.plan(PlanRequest(7, 0, mapper, [1], [1], dest="d")) is None
    assert asks(to_d) == [0, 0]  # retried
    relay(to_d, dec, "ep-p")  # both copies reach decode: the same allocation twice
    grants = [m for _, m in to_p]
    assert [g.type for g in grants] == ["grant", "grant"]
    assert grants[0].body["alloc_id"] == grants[1].body["alloc_id"]
    assert dec.ring.ring.live == 1
    pre.on_message("ep-d", grants[0])
    assert asks(to_d) == [1]
    pre.on_message("ep-d", grants[1])
    assert len(to_d) == 1  # a duplicate grant sends nothing more


def test_readiness_waits_for_the_watermark() -> None:
    pre, _, mapper, _, _ = pair()
    pre.on_queued(queued(mapper, 0, 1))
    g = Grant(room=7, chunk_id=0, alloc_id=9, round=2, offset=0, end=1024, wm_round=1, wm_tail=0)
    pre.on_message("ep-d", answer(g))
    assert pre.plan(PlanRequest(7, 0, mapper, [1], [1], dest="d")) is None  # round 1 still holds it
    pre.on_message("ep-d", answer(Watermark(round=1, tail=1024)))
    assert pre.plan(PlanRequest(7, 0, mapper, [1], [1], dest="d")) is not None


def test_deny_and_missing_grant_fail_the_chunk() -> None:
    pre, _, mapper, _, _ = pair()
    pre.on_queued(queued(mapper, 0, 1))
    pre.on_message("ep-d", answer(Deny(room=7, chunk_id=0, reason="gone")))
    with pytest.raises(TransferError, match="refused staging space: gone"):
        pre.plan(PlanRequest(7, 0, mapper, [1], [1], dest="d"))
    pre.on_queued(queued(mapper, 1, 1, timeout_s=0.0))
    with pytest.raises(TransferError, match="no staging grant"):
        pre.plan(PlanRequest(7, 1, mapper, [1], [1], dest="d"))


def test_space_of_a_failed_request_is_freed_by_the_writer_or_by_its_eviction() -> None:
    pre, dec, mapper, to_d, to_p = pair()
    for chunk in (0, 1):
        pre.on_queued(queued(mapper, chunk, 1))
        relay(to_d, dec, "ep-p")
        relay(to_p, pre, "ep-d")
    assert dec.ring.ring.live == 2
    dec.release(7)  # cleared on decode: the writer is asked until it confirms
    to_p.clear()
    dec.tick(time.monotonic() + 1.0)
    queries = [m for _, m in to_p if isinstance(m, WritesQuery)]
    assert queries and queries[0].room == 7 and dec.ring.ring.live == 2
    dec.writes_ended(7, "p")
    assert dec.ring.ring.live == 0 and dec.room_tables()["staging_allocations"] == 0
    # the same with an evicted writer
    dec.on_link("p", "ep-p", mapper)
    pre.release(7)
    pre.on_queued(queued(mapper, 2, 1))
    relay(to_d, dec, "ep-p")
    assert dec.ring.ring.live == 1
    dec.peer_lost("p")
    assert dec.ring.ring.live == 0


def test_a_decode_that_stages_nothing_refuses_a_staged_block() -> None:
    _, _, _, _, _ = pair()
    pre, *_ = make("prefill", 2, 0, [], "p")
    with pytest.raises(TransferError, match="stages nothing"):
        pre.on_arrival(ArrivedChunk(7, "p", 0, "staged", DST))


def test_oversize_chunks_fall_back_before_allocating_and_are_counted() -> None:
    pre, _, mapper, _, _ = pair()
    before = FALLBACKS._value.get()
    too_many = OPTS["buffer_bytes"] // block_bytes(mapper, 1) + 1
    assert pre.fits(mapper, 1)
    assert not pre.fits(mapper, too_many)
    assert FALLBACKS._value.get() == before + 1
    strict = BulkStaging(BulkOptions(**{**OPTS, "fallback_oversize": False}))
    with pytest.raises(ConfigError, match="fallback_oversize"):
        strict.fits(mapper, too_many)


def test_a_chunk_longer_than_a_buffer_is_cut_where_pages_fit_it() -> None:
    """Prefill cuts a staged link's chunk at what one staging buffer holds (every pair's
    slice of every token of a page), so a large request is staged chunk by chunk instead
    of moving per token; decode computes the same bound for its offers."""
    pre, dec, mapper, _, _ = pair()
    per_page = block_bytes(mapper, 1)  # equal page sizes: a unit is a page
    limit = pre.chunk_pages(mapper)
    assert limit == OPTS["buffer_bytes"] // per_page and limit >= 1
    assert pre.fits(mapper, limit) and block_bytes(mapper, limit + 1) > OPTS["buffer_bytes"]
    assert chunk_limit(mapper, per_page - 1) is None  # not a page fits: per token, as before
    assert chunk_limit(mapper, 3 * per_page) == 3
    assert dec.chunk_pages(mapper) is None  # decode cuts nothing


# ------------------------------------------------------------------ offers ahead (issue 27)
def offered(sent: list[tuple[str, Message]]) -> list[dict[str, Any]]:
    """Bodies of the offers (unasked grants with ``npages``) decode sent."""
    return [
        m.body
        for _, m in sent
        if isinstance(m, StagingMessage) and m.type == "grant" and m.body.get("npages")
    ]


def write_and_place(pre: Any, dec: Any, plan: Any, chunk: int) -> None:
    """The "transfer" of a staged plan into the ring, then its arrival on decode."""
    b = OPTS["block_bytes"]
    ring, buffers = dec.ring.mem, pre.writer.buffers
    for s_row, d_row in zip(plan.src_idx, plan.dst_idx, strict=True):
        ring[d_row * b : (d_row + 1) * b] = buffers[s_row * b : (s_row + 1) * b]
    dec.on_arrival(ArrivedChunk(7, "p", chunk, "staged", DST))
    pre.on_sent(7, plan, True)


def linked_pair(**opts: Any) -> tuple[Any, ...]:
    """Prefill rank 1 of TP 2 -> decode TP 1 with pools to verify, and a count of the times
    prefill's strategy woke its workers."""
    to_d: list[tuple[str, Message]] = []
    to_p: list[tuple[str, Message]] = []
    wakes: list[int] = []
    pre, play, parr, _ = make("prefill", 2, 1, to_d, "p", {**OPTS, **opts})
    assert pre.context is not None
    pre.context.wake_fn = lambda: wakes.append(1)
    dec, dlay, darr, _ = make("decode", 1, 0, to_p, "d", {**OPTS, **opts})
    dec.on_link("p", "ep-p", HeadSliceMapper(play, dlay))
    return pre, dec, HeadSliceMapper(play, dlay), play, parr, dlay, darr, to_d, to_p, wakes


def check_heads(dlay: Any, darr: Any, dst: Any, first_page: int) -> None:
    for i, arr in enumerate(darr):
        want = page_values(dlay, i, first_page, dst.size)
        assert np.array_equal(arr[dst][:, :, 2:, :], want[:, :, 2:, :])


def test_an_offer_ahead_spares_the_ask_round_trip() -> None:
    pre, dec, mapper, play, parr, dlay, darr, to_d, to_p, wakes = linked_pair()
    src = np.array([3, 5, 6, 8])
    fill_pages(play, parr, src, 0)
    dec.on_requested(7, DST.size, ["p", "not-a-writer"])  # before the request goes out
    (offer,) = offered(to_p)
    assert (offer["chunk_id"], offer["dst_start"], offer["npages"]) == (0, 0, DST.size)
    assert offer["nbytes"] == block_bytes(mapper, DST.size) and dec.ring.ring.live == 1
    relay(to_p, pre, "ep-d")
    assert pre.room_tables()["staging_offers"] == 1
    pre.on_queued(queued(mapper, 0, DST.size))  # the engine's send(): the whole request
    assert asks(to_d) == [] and pre.room_tables()["staging_offers"] == 0  # no ask at all
    plan = pre.plan(PlanRequest(7, 0, mapper, src, DST, dest="d"))
    assert plan is not None and plan.what == "staged"  # granted already
    write_and_place(pre, dec, plan, 0)
    check_heads(dlay, darr, DST, 0)
    assert dec.ring.ring.live == 0 and dec.room_tables()["staging_allocations"] == 0
    assert pre.room_tables() == {"staging_requests": 0, "staging_offers": 0}
    # asked anyway (a retry of an older writer): the chunk is placed, nothing is allocated
    pre.on_queued(queued(mapper, 0, DST.size))
    relay(to_d, dec, "ep-p")
    assert offered(to_p) == [] and dec.ring.ring.live == 0
    assert not wakes  # nothing waited on a grant


def test_a_smaller_first_chunk_asks_and_decode_replaces_the_offer() -> None:
    pre, dec, mapper, play, parr, dlay, darr, to_d, to_p, wakes = linked_pair()
    src = np.array([3, 5, 6, 8])
    fill_pages(play, parr, src, 0)
    dec.on_requested(7, DST.size, ["p"])
    offer_id = offered(to_p)[0]["alloc_id"]
    relay(to_p, pre, "ep-d")
    pre.on_queued(queued(mapper, 0, 2))  # chunked prefill: pages 0-1 first
    assert asks(to_d) == [0] and pre.room_tables()["staging_offers"] == 0
    relay(to_d, dec, "ep-p")
    ((_, grant),) = [(e, m) for e, m in to_p if m.type == "grant"]
    assert grant.body["alloc_id"] != offer_id and grant.body.get("npages") is None
    assert dec.ring.ring.live == 1  # the offer was freed, the chunk's space allocated
    to_p.clear()
    pre.on_message("ep-d", grant)
    assert wakes  # the grant woke the workers
    plan = pre.plan(PlanRequest(7, 0, mapper, src[:2], DST[:2], dest="d"))
    assert plan is not None
    write_and_place(pre, dec, plan, 0)
    pre.on_queued(QueuedChunk(7, 1, mapper, 2, 2, "d", "ep-d", 0, "p", 60.0))
    relay(to_d, dec, "ep-p")
    relay(to_p, pre, "ep-d")
    plan = pre.plan(PlanRequest(7, 1, mapper, src[2:], DST[2:], dest="d"))
    assert plan is not None
    write_and_place(pre, dec, plan, 1)
    check_heads(dlay, darr, DST, 0)
    assert dec.ring.ring.live == 0


def test_a_writer_that_drops_offers_asks_and_gets_the_offered_space() -> None:
    """An older prefill ignores the unasked grant (no ``npages`` field for it) and asks: the
    ask names the same chunk and pages, so decode answers with the space it offered."""
    pre, dec, mapper, play, parr, dlay, darr, to_d, to_p, _ = linked_pair()
    src = np.array([3, 5, 6, 8])
    fill_pages(play, parr, src, 0)
    dec.on_requested(7, DST.size, ["p"])
    offer_id = offered(to_p)[0]["alloc_id"]
    to_p.clear()  # dropped by the older writer
    pre.on_queued(queued(mapper, 0, DST.size))
    relay(to_d, dec, "ep-p")
    (grant,) = [m.body for _, m in to_p if m.type == "grant"]
    assert grant["alloc_id"] == offer_id and dec.ring.ring.live == 1
    relay(to_p, pre, "ep-d")
    plan = pre.plan(PlanRequest(7, 0, mapper, src, DST, dest="d"))
    assert plan is not None
    write_and_place(pre, dec, plan, 0)
    check_heads(dlay, darr, DST, 0)
    assert dec.ring.ring.live == 0


def test_offers_only_where_the_chunk_would_stage_and_its_space_is_free_now() -> None:
    pre, dec, mapper, *_, to_p, _ = linked_pair()
    fit = OPTS["buffer_bytes"] // block_bytes(mapper, 1)
    dec.on_requested(7, fit + 3, ["p"])  # prefill cuts it: the offer is its first chunk's
    ((first,),) = [[o["npages"] for o in offered(to_p)]]
    assert first == fit == pre.chunk_pages(mapper) and dec.ring.ring.live == 1
    dec.release(7)
    dec.tick(time.monotonic() + BulkOptions().release_timeout_s + 1)
    assert dec.ring.ring.live == 0
    to_p.clear()
    off, *_, to_p2, _ = linked_pair(offer_ahead=False)
    off.on_requested(7, DST.size, ["p"])
    assert offered(to_p2) == []
    # the ring's end is held by another request: the offer would wrap onto live bytes
    ring = dec.ring.ring
    ring.allocate(OPTS["ring_bytes"] - 1024, ("other", "p", 0))
    head = ring.watermark
    dec.on_requested(7, DST.size, ["p"])
    assert offered(to_p) == [] and ring.live == 1 and ring.watermark == head
    # offers a chunk never took are forgotten: on release, on eviction, after their TTL
    pre.on_message("ep-d", answer(Grant(
        room=7, chunk_id=0, alloc_id=1, round=0, offset=0, end=2048, wm_round=0, wm_tail=0,
        dst_start=0, npages=4, nbytes=2048,
    )))  # fmt: skip
    assert pre.room_tables()["staging_offers"] == 1
    pre.release(7)
    assert pre.room_tables()["staging_offers"] == 0
    pre.on_message("ep-d", answer(Grant(
        room=8, chunk_id=0, alloc_id=2, round=0, offset=0, end=2048, wm_round=0, wm_tail=0,
        dst_start=0, npages=4, nbytes=2048,
    )))  # fmt: skip
    pre.tick(time.monotonic())
    assert pre.room_tables()["staging_offers"] == 1
    pre.tick(time.monotonic() + BulkOptions().release_timeout_s + 1)
    assert pre.room_tables()["staging_offers"] == 0


def test_an_offer_that_comes_after_the_ask_is_its_answer_only_for_the_same_pages() -> None:
    """The offer follows the transfer request; prefill's engine may have sent and asked
    before it arrives."""
    pre, dec, mapper, play, parr, dlay, darr, to_d, to_p, wakes = linked_pair()
    src = np.array([3, 5, 6, 8])
    fill_pages(play, parr, src, 0)
    pre.on_queued(queued(mapper, 0, 2))  # asked for a smaller chunk 0 first
    dec.on_requested(7, DST.size, ["p"])
    relay(to_p, pre, "ep-d")  # the offer (4 pages) is not taken for the 2-page ask
    assert pre.plan(PlanRequest(7, 0, mapper, src[:2], DST[:2], dest="d")) is None
    assert pre.room_tables()["staging_offers"] == 0 and not wakes
    relay(to_d, dec, "ep-p")  # decode replaces the offer ...
    relay(to_p, pre, "ep-d")  # ... and its grant is the answer
    assert wakes and dec.ring.ring.live == 1
    plan = pre.plan(PlanRequest(7, 0, mapper, src[:2], DST[:2], dest="d"))
    assert plan is not None
    write_and_place(pre, dec, plan, 0)
    check_heads(dlay, darr, DST[:2], 0)
    # a matching ask that went out before the offer came: the offer answers it
    pre2, dec2, mapper2, play2, parr2, dlay2, darr2, to_d2, to_p2, wakes2 = linked_pair()
    fill_pages(play2, parr2, src, 0)
    pre2.on_queued(queued(mapper2, 0, DST.size))
    dec2.on_requested(7, DST.size, ["p"])
    relay(to_p2, pre2, "ep-d")
    assert wakes2
    plan = pre2.plan(PlanRequest(7, 0, mapper2, src, DST, dest="d"))
    assert plan is not None
    relay(to_d2, dec2, "ep-p")  # the ask, late: the same space, nothing new
    assert dec2.ring.ring.live == 1
    write_and_place(pre2, dec2, plan, 0)
    check_heads(dlay2, darr2, DST, 0)
    assert dec2.ring.ring.live == 0


def test_views_of_a_gpu_buffer_without_cuda_are_refused_clearly() -> None:
    """A layout that says its buffers are on a GPU, on a machine where torch cannot view
    that memory (no CUDA here): bulk staging refuses at setup, naming the buffer and the way
    out (pass the tensors), rather than failing later."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the view would succeed")
    layout, arrays = make_pool(MODEL, RankPosition(), 4)
    gpu = layout.model_copy(
        update={
            "buffers": tuple(b.model_copy(update={"kind": MemKind.VRAM}) for b in layout.buffers)
        }
    )
    with pytest.raises(ConfigError, match=r"(?s)cannot view GPU buffer .*kv_tensors="):
        BulkStaging(BulkOptions(**OPTS)).setup(
            StagingContext(gpu, lambda r: None, lambda r: None, role="decode", num_workers=1)
        )
    assert arrays  # the pool's memory stays alive while the layout is in use
