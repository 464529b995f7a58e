"""When a transfer worker first polls a write no event announces
(:mod:`kvwire.session.prefill.pace`): the rule on its own, and the pace a prefill rank learns
from real NIXL writes (host memory over UCX) while every byte still arrives."""

from __future__ import annotations

import pytest

from kvwire.session.prefill.pace import LEAD, MAX_AHEAD_S, MIN_BYTES, PollPace

MiB = 1 << 20


def test_nothing_learnt_polls_at_once() -> None:
    pace = PollPace()
    assert pace.ahead([(0.0, 64 * MiB)], now=0.0) == 0.0
    pace.ended(MIN_BYTES - 1, 1.0)  # a small write teaches nothing: its time is the calls'
    pace.ended(8 * MiB, 0.0)
    assert pace.s_per_byte is None


def test_the_fastest_write_sets_the_pace_and_a_slower_one_drifts_it() -> None:
    pace = PollPace()
    pace.ended(128 * MiB, 1e-3)  # 134 GB/s: the first, slow write (lazy setup)
    pace.ended(128 * MiB, 0.4e-3)  # then the link: the fastest seen wins at once
    assert pace.s_per_byte == pytest.approx(0.4e-3 / (128 * MiB))
    pace.ended(128 * MiB, 4e-3)  # one slow write moves it 5% only
    assert pace.s_per_byte == pytest.approx(1.05 * 0.4e-3 / (128 * MiB))


def test_the_first_poll_waits_for_the_earliest_write() -> None:
    pace = PollPace()
    pace.ended(128 * MiB, 0.5e-3)
    per = 0.5e-3 / (128 * MiB)
    writes = [(1.0, 128 * MiB), (1.0001, 64 * MiB), (0.9, 1024)]  # the small one is ignored
    got = pace.ahead(writes, now=1.0001)
    assert got == pytest.approx(1.0001 + LEAD * 64 * MiB * per - 1.0001)
    assert pace.ahead(writes, now=1.01) == 0.0  # past due: poll now, as without a pace
    assert pace.ahead([(0.0, 1 << 40)], now=0.0) == MAX_AHEAD_S  # never longer than this


def test_a_prefill_rank_learns_the_pace_of_its_nixl_writes() -> None:
    """Real NIXL over UCX on host memory (it pushes no events, so its writes are polled):
    verified requests of 2 MiB chunks; the worker that posted them has learnt a time per
    byte from them (the pipeline's pace is fed), and every byte arrived."""
    pytest.importorskip("kvwire_nixl")
    from kvwire.config import ControlOptions, KVWireConfig
    from kvwire.layout import ModelSpec
    from kvwire.testing.pair import Pair

    model = ModelSpec(num_layers=4, total_kv_heads=8, head_dim=64, dtype="int32",
                      page_size=16)  # fmt: skip  # a page is 256 KiB, a chunk of 8 is 2 MiB
    cfg = KVWireConfig(
        transfer_backend="nixl",
        control=ControlOptions(heartbeat_interval_s=0.5, handshake_timeout_s=10.0),
    )
    p = Pair(cfg, model=model, slots=48)
    try:
        assert not p.prefill.backend.pushes_events
        for room in range(1, 5):
            p.transfer(room, pages=16, chunks=(8, 8))  # verifies every element
        paces = [st.pace.s_per_byte for st in p.prefill.side.workers._stages]
        learnt = [s for s in paces if s is not None]
        assert learnt, paces
        assert all(0 < s < 1e-6 for s in learnt), learnt  # faster than 1 MB/s, a real time
    finally:
        p.close()
