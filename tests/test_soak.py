"""A bounded soak with faults (issue 26 item 4; the long run: docs/integrity.md).

Two prefill instances (TP 2) and two decode instances (TP 1), default control settings with
``kv_checksum`` on and kvwire's default agent names, 240 random requests with every element
verified, in batches; every other batch carries a fault, in turn: SIGKILL of a decode rank
and of a prefill rank mid-transfer (each restarted after its batch), a prefill rank
restarted flipping one bit per chunk after the checksum is taken, and a decode rank frozen
(SIGSTOP) past the liveness bound. Prefill's backend refuses the aux write of a share of the
rooms throughout. The ledger must show:

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

from kvwire.testing.soak import SoakSpec, run_soak
from kvwire.testing.soak_ledger import FaultEvent


def test_soak_with_faults() -> None:
    spec = SoakSpec(
        requests=240,
        batch=24,
        fault_every=2,
        faults=("kill_decode", "kill_prefill", "flip", "freeze"),
        victim_fraction=0.05,
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
    # kills and the flipped bit do not outlive the restart
    assert all(f.failed_after == 0 for f in report.faults if f.kind != "freeze"), report.summary()
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
