"""One prefill rank of a TP group dies: the other prefill ranks of every request it served are
told at once by decode, with the cause, and free their rooms (issue 26, soak follow-up).

Real rank processes (tcp backend): one prefill instance of TP 2, one decode instance of TP 1
(decode gathers head slices from both prefill ranks), default heartbeats, and the bootstrap
and handshake timeouts raised to 120 s and 60 s so that no pass can come from a timeout.
Prefill TP rank 1 is SIGKILLed:

* with requests in flight (both prefill ranks asked, chunk 0 moved, the last chunk stalled):
  decode sees the closed control connection, fails them, and tells prefill TP rank 0, which
  fails its share within :data:`TOLD_S` of the kill, naming the dead rank;
* then new requests on the same instance (bootstrap still lists the dead rank, not yet
  restarted): decode's handshake with the rank it knows is gone fails at once (it used to
  wait for the handshake timeout), and prefill TP rank 0, which the lookup listed, is told
  within :data:`TOLD_S` of the start, naming the dead rank;
* afterwards prefill TP rank 0 holds no room (its shares ended, its tables are empty).
"""

from __future__ import annotations

import time

import pytest

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.session.poll import KVPoll
from kvwire.testing.cluster import Cluster, ClusterSpec, RankProc, RankReport, RoomPlan
from kvwire.testing.cluster_suite import assert_all_ok
from kvwire.testing.netns_suite import start_stalled

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=16, dtype="int32", page_size=4)
#: Longest a surviving rank may take to report the failure: the 0.3 s grace before a closed
#: connection counts as a dead peer, and a loaded host's scheduling; far below the timeouts.
TOLD_S = 8.0
BOOTSTRAP_TIMEOUT_S = 120.0
HANDSHAKE_TIMEOUT_S = 60.0


def _reports(
    procs: list[RankProc], rooms: set[int], timeout_s: float
) -> dict[tuple[str, int], RankReport]:
    """The report of every rank in ``procs`` for every room in ``rooms``."""
    want = {(p.name, room) for p in procs for room in rooms}
    got: dict[tuple[str, int], RankReport] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(want):
        assert time.monotonic() < deadline, f"no report for {sorted(want - set(got))}"
        for p in procs:
            while p.conn.poll(0):
                msg = p.conn.recv()
                if msg[0] == "done" and (p.name, msg[2]) in want:
                    got[(p.name, msg[2])] = msg[1]
        time.sleep(0.005)
    return got


def _print_delays(what: str, got: dict[tuple[str, int], RankReport], t0: float) -> None:
    for name in sorted({n for n, _ in got}):
        d = [rep.t_done - t0 for (n, _), rep in got.items() if n == name]
        print(f"{what}: {name} reported Failed {min(d):.3f}-{max(d):.3f}s ({len(d)} requests)")


@pytest.mark.timeout(240)
def test_surviving_prefill_ranks_are_told_when_one_dies() -> None:
    config = KVWireConfig(
        transfer_backend="tcp",
        control=ControlOptions(
            bootstrap_timeout_s=BOOTSTRAP_TIMEOUT_S, handshake_timeout_s=HANDSHAKE_TIMEOUT_S
        ),
    )
    spec = ClusterSpec(
        model=MODEL, slots=256, aux_slots=64, config=config, default_names=True, prefill_tp=2
    )
    with Cluster(spec) as c:
        assert_all_ok(c.run(c.plans(4), concurrency=4, timeout_s=60))  # every link made
        survivor, decode = c.rank("prefill", 0, 0), c.rank("decode")
        victim = c.rank("prefill", 0, 1)
        in_flight = set(range(100, 106))
        start_stalled(c, in_flight)
        t_kill = c.kill("prefill", 0, 1)
        got = _reports([survivor, decode], in_flight, timeout_s=BOOTSTRAP_TIMEOUT_S)
        for (name, room), rep in sorted(got.items()):
            assert rep.status == int(KVPoll.Failed), (name, room, rep)
            assert victim.agent in (rep.error or ""), (name, room, rep.error)
            assert rep.t_done - t_kill <= TOLD_S, (name, room, rep.t_done - t_kill)
        _print_delays("in flight, after the kill", got, t_kill)

        # decode has lost the rank (its rooms failed); bootstrap still lists it
        after = set(range(200, 204))
        t_start = time.monotonic()
        for room in sorted(after):
            plan = RoomPlan(room=room, num_pages=4, chunks=[2, 2])
            for p in (survivor, decode):
                p.conn.send(("start", plan.model_dump()))
        got = _reports([survivor, decode], after, timeout_s=BOOTSTRAP_TIMEOUT_S)
        for (name, room), rep in sorted(got.items()):
            assert rep.status == int(KVPoll.Failed), (name, room, rep)
            assert victim.agent in (rep.error or ""), (name, room, rep.error)
            assert "gone" in (rep.error or ""), (name, room, rep.error)
            assert rep.t_done - t_start <= TOLD_S, (name, room, rep.t_done - t_start)
        _print_delays("started after it, after their start", got, t_start)

        # every share ended: nothing per request is left on the survivor (only room tables:
        # the dropped_* counters are the channel's)
        deadline = time.monotonic() + 30
        while True:
            tables = c.room_tables()[survivor.proc.name]
            left = {k: v for k, v in tables.items() if v and not k.startswith("dropped_")}
            if not left:
                break
            assert time.monotonic() < deadline, f"the surviving prefill rank kept {left}"
            time.sleep(0.2)
