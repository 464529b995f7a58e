"""A bounded soak with faults (issue 26 item 4; the long run: docs/integrity.md).

Two prefill instances (TP 2) and two decode instances (TP 1), default control settings with
``kv_checksum`` on and kvwire's default agent names, 240 random requests with every element
verified, in batches; every other batch carries a fault, in turn: SIGKILL of a decode rank
and of a prefill rank mid-transfer (each restarted after its batch), a decode rank
restarted flipping one bit of each chunk's landed rows before its checksum check, and a
decode rank frozen (SIGSTOP) past the liveness bound. Prefill's backend refuses the aux
write of a share of the rooms throughout. The ledger must show:

* 0 unexpected failures and 0 corrupt requests (a failure counts as expected only in a
  fault's batch, on an instance it hit, with every failing rank naming a cause the fault
  explains; or within the recovery window after it; or for a refused room, naming the
  refusal);
* every fault hit requests (it was live), the flipped bit caught by the checksum, refused
  rooms refused, requests succeeding before and after every fault;
* fds and threads of every rank flat after the warm-up batch (RSS within bounds), and no
  per-request state left behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvwire.session.poll import KVPoll
from kvwire.testing.cluster import Cluster, RankProc
from kvwire.testing.cluster_suite import assert_all_ok
from kvwire.testing.netns_suite import collect_reports
from kvwire.testing.soak import SoakSpec, run_soak, soak_cluster_spec
from kvwire.testing.soak_ledger import Entry, FaultEvent


def test_soak_with_faults() -> None:
    spec = SoakSpec(
        requests=240,
        batch=24,
        fault_every=2,
        faults=("kill_decode", "kill_prefill", "flip", "freeze"),
        victim_fraction=0.05,
        # frozen 6.5 s against the 3 s liveness bound: a peer forgives its own starvation
        # (up to 1.4 s on a loaded CI host), which could push the eviction past 4.5 s
        silence_s=6.5,
        seed=26,
    )
    report = run_soak(spec, stop_on_unexpected=True)
    counts = report.counts
    assert not report.unexpected(), report.summary()
    assert counts["corrupt"] == 0 and len(report.entries) == spec.requests, report.summary()
    kinds = {f.kind: f for f in report.faults}
    assert set(kinds) == set(spec.faults), report.summary()
    hit: list[FaultEvent] = [f for f in report.faults if f.failed]
    assert hit == report.faults, f"a fault failed no request: {report.summary()}"
    # no fault outlives its end: kills and the flipped bit the restart, a freeze the resume
    # (the resumed rank is told it was evicted, and handshakes again)
    assert all(f.failed_after == 0 for f in report.faults), report.summary()
    errors = [e for entry in report.entries for e in entry.errors]
    assert any("KV checksum mismatch" in e for e in errors), report.summary()
    assert any("refused" in e for e in errors), report.summary()
    assert counts["ok"] >= spec.requests // 2, report.summary()
    # every batch after a fault's recovery served requests again
    last = max(f.batch for f in report.faults)
    assert any(e.outcome == "ok" and e.batch > last for e in report.entries), report.summary()
    assert not report.not_flat(fds=4, threads=2), report.summary()
    assert len(report.growth()) >= 6, report.growth()  # the ranks never restarted, at least
    assert not report.leftover_tables, report.summary()


def test_soak_dead_backend_fails_over_and_loses_nothing() -> None:
    """Every rank runs ``flaky,tcp``; twice, every rank of one prefill instance has its
    ``flaky`` broken while requests to it are half sent (:mod:`kvwire.testing.flaky`, the one
    fake: no engine here breaks an endpoint on command). No request may fail by it: the
    links fail over to ``tcp`` (counted by the ranks' metrics), every element lands, and the
    links move back to ``flaky`` once it heals."""
    spec = SoakSpec(
        requests=120,
        batch=24,
        fault_every=2,
        faults=("dead_backend",),
        victim_fraction=0.05,
        seed=27,
    )
    report = run_soak(spec, stop_on_unexpected=True)
    assert not report.unexpected(), report.summary()
    assert report.counts["corrupt"] == 0 and len(report.entries) == spec.requests
    assert [(f.kind, f.inst) for f in report.faults] == [
        ("dead_backend", 0),
        ("dead_backend", 1),
    ], report.summary()
    for f in report.faults:
        assert f.failovers > 0, f"the broken backend was never hit: {report.summary()}"
        assert f.failed == 0 and f.failed_after == 0, report.summary()
        assert f.recovered and f.recoveries > 0, f"links not back on flaky: {report.summary()}"
        served = [
            e for e in report.entries if e.batch == f.batch and e.prefill == f.inst
        ]  # fmt: skip
        assert served and all(e.outcome in ("ok", "expected") for e in served)
        assert sum(e.outcome == "ok" for e in served) >= len(served) // 2, report.summary()
    # the only failures are the refused rooms, each naming the refusal
    failed = [e for e in report.entries if e.outcome != "ok"]
    assert failed and all("refused" in err for e in failed for err in e.errors), report.summary()
    assert not report.not_flat(fds=4, threads=2), report.summary()
    assert not report.leftover_tables, report.summary()


def test_soak_partition_cuts_one_decode_instance_the_other_serves_on() -> None:
    """Prefill's ranks in one network namespace and each decode instance in its own (root);
    twice, one decode instance's namespace is cut off for 6.5 s while requests to it are half
    sent. Requests through it fail naming the silence, none after it healed, and every
    request of the same batches through the other decode instance succeeds."""
    from kvwire.testing.netns import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces: {reason}")
    spec = SoakSpec(
        requests=120,
        batch=24,
        fault_every=2,
        faults=("partition",),
        netns=True,
        silence_s=6.5,  # past the 3 s bound by more than a starved peer forgives (1.4 s)
        seed=28,
    )
    report = run_soak(spec, stop_on_unexpected=True)
    assert not report.unexpected(), report.summary()
    assert [(f.kind, f.inst) for f in report.faults] == [("partition", 0), ("partition", 1)]
    for f in report.faults:
        assert f.failed > 0 and f.failed_after == 0, report.summary()
        others = [e for e in report.entries if e.batch == f.batch and e.decode != f.inst]
        assert others and all(e.outcome == "ok" or _refused(e) for e in others), [
            e for e in others if e.outcome != "ok"
        ]
    assert not report.not_flat(fds=4, threads=2), report.summary()
    assert not report.leftover_tables, report.summary()


def _refused(entry: Entry) -> bool:
    """A request whose aux write the backend refused (and that failed naming it)."""
    return bool(entry.errors) and all("refused" in e for e in entry.errors)


def _peers(p: RankProc, timeout_s: float = 30.0) -> int:
    """How many peers one (live, running) rank tracks now."""
    p.conn.send(("stats",))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p.conn.poll(0.05):
            msg = p.conn.recv()
            if msg[0] == "stats":
                return int(msg[1]["peers"])
    raise AssertionError(f"{p.name}: no stats within {timeout_s}s")


def test_requests_right_after_a_frozen_decode_resumes() -> None:
    """A decode rank frozen (SIGSTOP) until prefill has evicted it, then resumed: the next
    requests between them succeed. Found by the soak's freeze fault (an eviction was
    one-sided: prefill dropped the resumed rank's requests as from an unknown session). Now
    prefill answers (protocol 1.9, docs/integrity.md) whichever comes first after the resume:
    decode's heartbeat (told ``evicted``: it drops the link, the next request handshakes
    again) or a request asked through the old link (answered ``unheard``: repeated after a new
    handshake). Either way the requests succeed, whatever the timing of the resume; decode does
    not count its own freeze as prefill's silence. The in-process tests in
    core/tests/test_evicted_peer.py take each path alone."""
    shape = SoakSpec(prefill_instances=1, decode_instances=1, prefill_tp=1, faults=())
    with Cluster(soak_cluster_spec(shape)) as c:
        assert_all_ok(c.run(c.plans(4), concurrency=4, timeout_s=60))
        prefill, decode = c.rank("prefill"), c.rank("decode")
        os.kill(decode.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while _peers(prefill):  # evicted for silence (1 s x 3 misses by default)
                assert time.monotonic() < deadline, "prefill never evicted the frozen decode"
                time.sleep(0.02)
        finally:
            os.kill(decode.proc.pid, signal.SIGCONT)
        plans = c.plans(4, seed=1)
        for plan in plans:
            for p in c.ranks_of(plan):
                p.conn.send(("start", plan.model_dump()))
        reports = collect_reports(c, {p.room for p in plans}, timeout_s=60, role="decode")
        failed = [r for r in reports.values() if r.status != int(KVPoll.Success)]
        assert not failed, failed
