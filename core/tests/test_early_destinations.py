"""A prefill rank feeding several decode ranks (TP 1 -> 2) sends a decode rank its KV as soon as
that rank asked, not once every decode rank has: the engine may have sent the request's chunks
before any decode rank asked (vLLM's prefill computes first), and a slow decode rank must not
hold back the others. In one process: one prefill and two decode managers over the real tcp
backend, bootstrap service and ZeroMQ channels, verification pools."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvwire.errors import TransferError
from kvwire.layout import RankPosition
from kvwire.session import KVManager, KVPoll, Role, reduce_polls
from kvwire.testing.kvfill import count_mismatches, fill_pages, make_pool
from kvwire.testing.pair import MODEL, config, no_rooms, wait_for


@pytest.fixture
def tp12() -> Iterator[dict[str, Any]]:
    """A prefill manager (TP 1) and two decode managers (TP 2 ranks 0 and 1)."""
    play, parr = make_pool(MODEL, RankPosition(), 32)
    pools = [make_pool(MODEL, RankPosition(tp_size=2, tp_rank=r), 32) for r in range(2)]
    prefill = KVManager(config(), Role.PREFILL, play)
    decodes: list[KVManager] = []
    try:
        for lay, _ in pools:
            decodes.append(KVManager(config(), Role.DECODE, lay))
        yield {"prefill": prefill, "play": play, "parr": parr, "decodes": decodes, "pools": pools}
    finally:
        for d in decodes:
            d.close()
        prefill.close()


def _sender(tp12: dict[str, Any], room: int, pages: int) -> tuple[Any, Any, str]:
    """Prefill's sender of a request of ``pages`` filled pages, past ``init`` (the engine has
    computed it), with its pages and the bootstrap address decode asks at."""
    prefill: KVManager = tp12["prefill"]
    addr = prefill.bootstrap_addr
    assert addr
    s = prefill.sender(room)
    src = np.arange(pages)
    fill_pages(tp12["play"], tp12["parr"], src, 0)
    s.init(pages, aux_index=2)
    return s, src, addr


def _tables_drain(tp12: dict[str, Any]) -> None:
    """Every manager's tables empty: a cleared room leaves once no write can still land (a
    failed one after WritesDone)."""
    mgrs = [tp12["prefill"], *tp12["decodes"]]
    wait_for(lambda: all(no_rooms(m) for m in mgrs))


def _ask(tp12: dict[str, Any], rank: int, room: int, addr: str, dst: Any) -> Any:
    """Decode rank ``rank`` asks for ``room`` into pages ``dst``; its receiver."""
    r = tp12["decodes"][rank].receiver(room, addr)
    r.init()
    r.send_metadata(dst, aux_index=1)
    return r


def test_a_decode_rank_that_asked_is_served_before_the_other_asks(tp12: dict[str, Any]) -> None:
    """The engine sends both chunks before any decode rank asked; decode rank 0 asks and gets
    its whole request (Success, every element right) while rank 1 has not asked, and the
    prefill side stays short of Success; rank 1 then asks and gets the same chunks."""
    s, src, addr = _sender(tp12, 7, 4)
    s.send(src[:2], last=False)
    s.send(src[2:], last=True)
    dst = [np.array([10, 12, 14, 16]), np.array([5, 3, 1, 20])]
    r0 = _ask(tp12, 0, 7, addr, dst[0])
    wait_for(lambda: r0.poll() is KVPoll.Success)
    lay0, arr0 = tp12["pools"][0]
    assert count_mismatches(lay0, arr0, dst[0], 0) == 0
    assert s.poll() is KVPoll.Bootstrapping  # rank 1 has not asked: not every rank is served
    lay1, arr1 = tp12["pools"][1]
    assert count_mismatches(lay1, arr1, dst[1], 0) > 0  # nothing written there yet
    r1 = _ask(tp12, 1, 7, addr, dst[1])
    wait_for(lambda: r1.poll() is KVPoll.Success and s.poll() is KVPoll.Success)
    assert count_mismatches(lay1, arr1, dst[1], 0) == 0
    for x in (s, r0, r1):
        x.clear()
    _tables_drain(tp12)


def test_chunks_sent_between_the_two_asks_reach_both_ranks_in_order(
    tp12: dict[str, Any],
) -> None:
    """A chunk before any ask, one after rank 0 asked, one after both: each rank gets all three
    in request order (rank 0 the first one at its ask, rank 1 the first two at its)."""
    s, src, addr = _sender(tp12, 8, 6)
    s.send(src[:2], last=False)
    dst = [np.arange(6) + 20, np.arange(6)[::-1] + 8]
    rs = [_ask(tp12, 0, 8, addr, dst[0])]
    wait_for(lambda: rs[0].poll() is KVPoll.Transferring)  # asked; its first chunk lands
    assert s.poll() is KVPoll.Bootstrapping
    s.send(src[2:4], last=False)
    rs.append(_ask(tp12, 1, 8, addr, dst[1]))
    wait_for(lambda: s.poll() is KVPoll.Transferring)  # both asked, chunks already sent
    s.send(src[4:], last=True)
    wait_for(lambda: all(r.poll() is KVPoll.Success for r in rs) and s.poll() is KVPoll.Success)
    for r, (lay, arr) in enumerate(tp12["pools"]):
        assert count_mismatches(lay, arr, dst[r], 0) == 0, r
    for x in (s, *rs):
        x.clear()


@pytest.mark.parametrize("tp", [(1, 2), (2, 1)], ids=["tp1to2", "tp2to1"])
def test_an_engine_that_sends_first_across_real_processes(tp: tuple[int, int]) -> None:
    """Rank processes over tcp: prefill inits and sends every request as soon as it exists,
    without waiting for decode's asks (``RoomPlan.send_first``), 24 requests, 8 in flight,
    chunked and layer-wise ones among them: every element and aux row right on every decode
    rank, nothing left in any table."""
    from kvwire.testing.cluster import RELAXED_HEARTBEAT_S, Cluster, ClusterSpec
    from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty

    cfg = config(heartbeat_interval_s=RELAXED_HEARTBEAT_S, handshake_timeout_s=10.0)
    spec = ClusterSpec(model=MODEL, prefill_tp=tp[0], decode_tp=tp[1], slots=96, config=cfg)
    with Cluster(spec) as c:
        plans = c.plans(24, pages=(1, 6), layerwise_fraction=0.2)
        plans = [p.model_copy(update={"send_first": True}) for p in plans]
        results = c.run(plans, concurrency=8, timeout_s=120)
        assert_all_ok(results)
        assert_tables_empty(c)


def test_a_late_rank_asking_for_more_pages_fails_the_request_on_every_side(
    tp12: dict[str, Any],
) -> None:
    """Rank 0 asked and was served; rank 1 then asks for more pages than the request has (a
    rank asking for fewer has them cached): the request fails at once on prefill and on rank 1
    with an error naming both counts and nothing is written to rank 1. Rank 0 keeps its
    Success (it has every byte of its share), so the decode engine's combined poll of its
    ranks (``reduce_polls``, as engines combine TP ranks) says Failed."""
    s, src, addr = _sender(tp12, 9, 4)
    s.send(src, last=True)
    r0 = _ask(tp12, 0, 9, addr, np.arange(4) + 10)
    wait_for(lambda: r0.poll() is KVPoll.Success)
    r1 = _ask(tp12, 1, 9, addr, np.arange(5) + 10)
    wait_for(lambda: r1.poll() is KVPoll.Failed and s.poll() is KVPoll.Failed)
    for x in (s, r1):
        with pytest.raises(TransferError, match="asked for 5 pages but the request has 4"):
            x.failure_exception()
    assert reduce_polls([r0.poll(), r1.poll()]) is KVPoll.Failed
    _, arr1 = tp12["pools"][1]
    assert not any(a[10:15].any() for a in arr1), "rank 1's pages were written"
    for x in (s, r0, r1):
        x.clear()
    _tables_drain(tp12)


def test_a_repeated_ask_of_a_served_rank_is_ignored(
    tp12: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The same decode session asking again before every rank asked (its request repeated)
    does not replace its destination: its chunks went out already and are not sent twice,
    into other pages. Driven through the prefill side's own entry point for a rank's ask."""
    import dataclasses

    s, src, addr = _sender(tp12, 11, 4)
    s.send(src, last=True)
    r0 = _ask(tp12, 0, 11, addr, np.arange(4) + 10)
    wait_for(lambda: r0.poll() is KVPoll.Success)
    side = tp12["prefill"].side
    with side.rooms.lock:
        room = side.rooms.get(11)
        (dest,) = room.dests.values()
        again = dataclasses.replace(dest, dst_pages=np.arange(4) + 20, next_chunk=0, done=False)
        with caplog.at_level("WARNING"):
            side._add_dest(room, again)
        assert room.dests[dest.session] is dest
        assert again.next_chunk == 0, "chunks were dispatched to the repeated ask"
    assert "a repeated request from decode session" in caplog.text
    r1 = _ask(tp12, 1, 11, addr, np.arange(4) + 10)
    wait_for(lambda: r1.poll() is KVPoll.Success and s.poll() is KVPoll.Success)
    for x in (s, r0, r1):
        x.clear()
    _tables_drain(tp12)
