"""Partial-failure reports (issue 26 item 2): a request that fails part-way says which of its
decode pages landed whole and which must be recomputed, and why it failed.

In-process pairs over tcp; every case checks the report against the bytes that truly
landed: the good pages hold exactly prefill's KV, and (where prefill's data never left) the
missing ones do not. ``tests/test_failure_report_cluster.py`` SIGKILLs a prefill rank of a
heterogeneous-TP cluster mid-request.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvwire.session import FailureReport, KVPoll
from kvwire.session.checksums import LandedSums
from kvwire.session.report import LandedChunks, SourceState, good_page_mask, intersect, merge
from kvwire.testing.faults import landed_flipper
from kvwire.testing.kvfill import count_mismatches, fill_pages
from kvwire.testing.pair import MODEL, Pair, config, pair, wait_for

# ----------------------------------------------------------------------------- pure rules


def test_ranges_merge_and_intersect() -> None:
    assert merge([(4, 6), (0, 2), (2, 3), (8, 8), (5, 7)]) == [(0, 3), (4, 7)]
    assert intersect([(0, 4), (6, 10)], [(2, 8)]) == [(2, 4), (6, 8)]
    assert intersect([(0, 4)], []) == []


def _src(sid: int, complete: bool = False, dummy: bool = False) -> SourceState:
    return SourceState(sid, dummy, complete, True)


def test_a_page_is_good_only_when_every_writing_source_covered_all_its_tokens() -> None:
    landed = LandedChunks()
    # prefill pages of 2 tokens, 8 pages (16 tokens); decode pages of 4 tokens, 4 of them
    landed.add(0, (0, 4), 8, 2)  # sender 0: tokens [0, 8)
    landed.add(0, (6, 8), 8, 2)  # and [12, 16)
    landed.add(1, (0, 3), 8, 2)  # sender 1: tokens [0, 6)
    landed.add(1, (3, 8), 8, 2)  # and [6, 16)
    mask, first, covered = good_page_mask(landed, [_src(0), _src(1)], 4, 4, 0)
    assert first == 0 and covered == [(0, 8), (12, 16)]
    assert mask.tolist() == [True, True, False, True]
    # sender 1 holds only [0, 6): page 1 (tokens 4-8) is half missing
    one = LandedChunks()
    one.add(0, (0, 8), 8, 2)
    one.add(1, (0, 3), 8, 2)
    assert good_page_mask(one, [_src(0), _src(1)], 4, 4, 0)[0].tolist() == [True] + [False] * 3
    # a complete sender covers everything; a dummy one writes nothing here and does not count
    assert good_page_mask(one, [_src(0), _src(1, complete=True)], 4, 4, 0)[0].all()
    assert good_page_mask(one, [_src(0), _src(1, dummy=True)], 4, 4, 0)[0].all()
    # no note said where its chunk goes (an older prefill): nothing is proven
    assert not good_page_mask(LandedChunks(), [_src(0)], 4, 4, 0)[0].any()
    # a cached prefix (same page sizes, no cached_tokens): the last 2 of 4 pages were asked
    tail = LandedChunks()
    tail.add(0, (2, 3), 4, 4)
    mask, first, _ = good_page_mask(tail, [_src(0)], 2, 4, None)
    assert first == 8 and mask.tolist() == [True, False]
    # the last page is short (the request's bound cuts it): good once its tokens landed
    short = LandedChunks()
    short.add(0, (0, 3), 3, 2)  # 3 prefill pages of 2: 6 tokens, decode pages of 4
    assert good_page_mask(short, [_src(0)], 2, 4, 0)[0].tolist() == [True, True]


# ----------------------------------------------------------------------------- in-process


def _start(p: Pair, room: int, n: int, m: int | None = None) -> tuple[Any, Any, Any, Any]:
    """A request of ``n`` prefill pages (decode asked for ``m`` pages, cached_tokens 0)."""
    r = p.decode.receiver(room, p.addr)
    r.init()
    dst = np.arange(m if m is not None else n) + 10
    r.send_metadata(dst, aux_index=1, cached_tokens=0)
    s = p.prefill.sender(room)
    src = np.arange(n)
    fill_pages(p.play, p.parr, src, 0)
    wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
    s.init(n, aux_index=2)
    return s, r, src, dst


def _chunks_landed(r: Any, count: int) -> bool:
    return sum(r._state.received.values()) >= count


def _report(r: Any) -> FailureReport:
    wait_for(lambda: r.poll() == KVPoll.Failed, 20.0)
    wait_for(r.writes_quiesced, 20.0)
    rep = r.failure_report()
    assert rep is not None
    return rep


def _assert_matches_pool(p: Pair, rep: FailureReport, dst: Any, missing_untouched: bool) -> None:
    """Good pages hold prefill's bytes; missing ones (when nothing was sent) do not."""
    ps = p.dlay.model.page_size
    for j in rep.good_pages.tolist():
        assert count_mismatches(p.dlay, p.darr, dst[j : j + 1], j * ps) == 0, f"page {j}"
    if missing_untouched:
        for j in rep.missing_pages.tolist():
            assert count_mismatches(p.dlay, p.darr, dst[j : j + 1], j * ps) > 0, f"page {j}"


def test_prefill_gone_after_one_chunk_reports_it_landed_and_the_rest_missing() -> None:
    with pair(config()) as p:
        s, r, src, dst = _start(p, 21, 6)
        assert r.failure_report() is None  # not failed
        s.send(src[:2], last=False)
        wait_for(lambda: _chunks_landed(r, 1))
        p.prefill.close()  # goodbye, then the live request fails
        rep = _report(r)
        assert rep.cause in ("sender_lost", "prefill_failed"), rep
        assert rep.good_pages.tolist() == [0, 1]
        assert rep.missing_slots.tolist() == dst[2:].tolist()
        assert rep.good_prefix_pages == 2 and rep.good_prefix_tokens == 2 * MODEL.page_size
        assert rep.good_tokens == ((0, 2 * MODEL.page_size),)
        assert not rep.aux_landed and rep.groups_landed
        _assert_matches_pool(p, rep, dst, missing_untouched=True)
        assert "2 of 6 pages landed" in rep.summary()
        r.clear()
        after = r.failure_report()  # still readable after clear()
        assert after is not None and after.good_pages.tolist() == [0, 1]


def test_waiting_timeout_reports_what_landed() -> None:
    with pair(config(), config(waiting_timeout_s=3.0)) as p:  # 1 s: a stall could fire it early
        s, r, src, dst = _start(p, 22, 4)
        s.send(src[:3], last=False)  # the last page never comes
        rep = _report(r)
        assert rep.cause == "timeout"
        assert rep.good_pages.tolist() == [0, 1, 2] and rep.missing_slots.tolist() == [13]
        _assert_matches_pool(p, rep, dst, missing_untouched=True)
        s.abort()
        r.clear()
        s.clear()


def test_checksum_mismatch_names_the_chunk_and_keeps_the_verified_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunk 1 has a byte flipped on landing (decode, before its check): chunk 0 (verified)
    stays good, chunk 1's pages are reported missing, and the report names chunk, layer and
    peer."""
    with pair(config(), config(kv_checksum=True)) as p:
        flip = landed_flipper(layer=1, offset=5, spans=lambda span: span[0] == 2)
        monkeypatch.setattr(LandedSums, "chunk", flip)  # the second chunk only
        s, r, src, dst = _start(p, 23, 4)
        s.send(src[:2], last=False)
        wait_for(lambda: _chunks_landed(r, 1))
        s.send(src[2:], last=True)
        rep = _report(r)
        assert rep.cause == "checksum_mismatch", rep
        assert rep.chunk is not None
        assert (rep.chunk.chunk_id, rep.chunk.pages, rep.chunk.layers) == (1, (2, 4), "1")
        assert rep.peer == rep.chunk.peer == p.prefill.agent_name
        assert rep.good_pages.tolist() == [0, 1] and rep.missing_slots.tolist() == [12, 13]
        _assert_matches_pool(p, rep, dst, missing_untouched=False)
        # the flipped page landed wrong: the report was right to call it missing
        assert count_mismatches(p.dlay, p.darr, dst[2:3], 2 * MODEL.page_size) > 0
        r.clear()
        s.clear()


def test_different_page_sizes_count_a_straddled_page_missing() -> None:
    """Prefill pages of 2 tokens, decode pages of 4: after prefill pages [0, 3) (tokens 0-6)
    decode page 0 is whole, page 1 (tokens 4-8) only half: missing."""
    dmodel = MODEL.model_copy(update={"page_size": 4})
    with pair(config(), dmodel=dmodel) as p:
        s, r, src, dst = _start(p, 24, 6, m=3)
        s.send(src[:3], last=False)
        wait_for(lambda: _chunks_landed(r, 1))
        r.abort()
        rep = _report(r)
        assert rep.cause == "aborted"
        assert rep.page_size == 4 and rep.first_token == 0
        assert rep.good_tokens == ((0, 6),)
        assert rep.good_pages.tolist() == [0] and rep.missing_slots.tolist() == [11, 12]
        assert count_mismatches(p.dlay, p.darr, dst[:1], 0) == 0
        r.clear()
        s.clear()


def test_a_failure_before_any_request_reports_every_page_missing() -> None:
    with pair(config()) as p:
        r = p.decode.receiver(25, p.addr)
        r.init()
        with pytest.raises(Exception, match="aux_index"):
            r.send_metadata(np.arange(3) + 10, aux_index=10**9)
        rep = _report(r)
        assert rep.cause == "bad_input" and rep.good_pages.size == 0
        r.clear()


def test_a_protocol_violation_proves_nothing() -> None:
    """Pages that landed are still reported missing when a peer broke the protocol."""
    from kvwire.session.report import build_report

    landed = LandedChunks()
    landed.add(0, (0, 4), 4, 2)
    slots = np.arange(4, dtype=np.int64) + 10
    args: dict[str, Any] = {
        "reason": "x",
        "slots": slots,
        "landed": landed,
        "sources": [_src(0)],
        "page_size": 2,
        "cached_tokens": 0,
        "aux_landed": False,
        "judged": True,
    }
    assert build_report(1, "timeout", **args).good_pages.tolist() == [0, 1, 2, 3]
    assert build_report(1, "protocol", **args).good_pages.size == 0
    assert build_report(1, "timeout", **{**args, "judged": False}).good_pages.size == 0
