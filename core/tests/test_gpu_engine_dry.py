"""The GPU benchmarks' engine phase (:mod:`kvwire.bench.gpu_engine`) as a dry run on host
memory over ``tcp``: every verified element right, the stage table of the timed requests, and
where the aux row travels for the two shapes of a request's sends."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvwire.bench.gpu_engine import STAGES, cpu_seconds, engine


def _args(**kw: Any) -> SimpleNamespace:
    base = dict(
        device="cpu", gpus=None, sizes=[1], concurrency=[1], requests=8, verify_requests=2,
        engine_step=0.0002, timeout=120.0, backend="tcp", prefill_tp=1, decode_tp=1,
    )  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_timed_requests_report_their_stages_and_carry_the_aux_row_in_the_note() -> None:
    """One last send with every page: the aux row rides in the last KV note (no bytes of its
    own); an empty last send after the pages: it moves as a transfer of its own (two aux rows,
    kvwire's stamp and the engine's, 64 bytes each), which is what the GPU benches timed
    before session 13."""
    one = engine(_args(settle_s=0.2))  # settling between warm-up and timed cells
    empty = engine(_args(empty_last=True))
    for rep in (one, empty):
        assert all(v["mismatches"] == 0 for v in rep["verified"])
        (cell,) = rep["cells"]
        assert cell["failed"] == 0 and cell["requests"] == 8
        # each rank's GIL switch interval and lowerings, read after the cell
        gil = cell["gil"]
        assert len(gil["interval_us"]) == len(gil["lowerings"]) == 2
        assert all(0 < us <= 5000 for us in gil["interval_us"]), gil
        # the driver's and every rank's share of a core over the cell
        cpu = cell["cpu_share"]
        assert set(cpu) == {"driver", "kvwire-prefill0-pp0-tp0", "kvwire-decode0-pp0-tp0"}, cpu
        assert all(v >= 0 for v in cpu.values()) and cpu["driver"] > 0, cpu
        stages = cell["stages_ms"]
        assert stages["total"] > 0
        for name, *_ in STAGES:
            if name in stages and name not in ("total", "prefill_complete"):
                # each stage lies inside decode's created -> seen, request by request (prefill's
                # own completion may come after decode saw Success)
                assert 0 <= stages[name] <= stages["total"], (name, stages)
    kv_bytes = one["cells"][0]["bytes_per_request"]
    assert kv_bytes % 4096 == 0  # whole pages of the dry-run model, nothing else
    assert {"plan", "post", "land"} <= set(one["cells"][0]["stages_ms"])
    assert empty["cells"][0]["bytes_per_request"] == kv_bytes + 128
    # GB/s is of the KV a request carried: on this direct path the KV is what its KV writes
    # moved; the empty last send's aux rows are written bytes, not KV
    for rep in (one, empty):
        c = rep["cells"][0]
        assert c["kv_bytes_per_request"] == kv_bytes
        assert c["gbps"] * c["bytes_per_request"] == pytest.approx(c["wire_gbps"] * kv_bytes)


def test_cpu_seconds_read_each_live_rank_and_leave_out_the_unreadable() -> None:
    """This process stands in for a rank: the CPU of a thread other than its main one
    counts (a rank's transfer worker, not only its engine loop: /proc/PID/schedstat, read
    before, is the main thread's alone); a rank whose /proc entry is gone (it exited) is
    left out, not an error."""
    me = SimpleNamespace(proc=SimpleNamespace(pid=os.getpid(), name="kvwire-prefill0-pp0-tp0"))
    gone = SimpleNamespace(proc=SimpleNamespace(pid=2**22 + 7, name="kvwire-decode0-pp0-tp0"))
    for p in (me, gone):
        p.name = p.proc.name
    c = SimpleNamespace(procs=[me, gone])
    before = cpu_seconds(c)
    spent = threading.Thread(target=_spin, args=(0.3,))  # 0.3 s of CPU off the main thread
    spent.start()
    spent.join()
    after = cpu_seconds(c)
    assert set(after) == {"driver", "kvwire-prefill0-pp0-tp0"}
    assert after["driver"] > before["driver"]
    # clock ticks of 10 ms: most of the thread's 0.3 s shows (the main thread used ~none)
    assert after["kvwire-prefill0-pp0-tp0"] - before["kvwire-prefill0-pp0-tp0"] >= 0.2


def _spin(cpu_s: float) -> None:
    """Use ``cpu_s`` seconds of this thread's CPU (however long that takes on a loaded host)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_spreads_span_the_ranks_of_one_role_and_skip_single_ranks() -> None:
    """TP 1 -> 2's request: decode rank 1 asked 0.8 ms after rank 0 and saw its Success 0.3 ms
    later; the one prefill rank gives no spread; a request of one decode rank counts for none."""
    from kvwire.bench.gpu_engine import spread_medians

    def rep(role: str, **marks: float) -> SimpleNamespace:
        return SimpleNamespace(role=role, marks=marks)

    two = [
        SimpleNamespace(
            reports=[
                rep("prefill", asked=1.0, done=2.0),
                rep("decode", requested=0.5, seen=3.0),
                rep("decode", requested=0.5 + d, seen=3.0 + 0.0003),
            ]
        )
        for d in (0.0008, 0.0007, 0.0009)
    ]
    one = SimpleNamespace(reports=[rep("decode", requested=0.0, seen=9.0)])
    out = spread_medians([*two, one])
    assert out == {"decode.requested": 0.8, "decode.seen": 0.3}
