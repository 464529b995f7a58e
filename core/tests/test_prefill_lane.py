"""Two edges of prefill's lean lane (:mod:`kvwire.session.prefill.lane`) that no timing of
a real pair makes happen on demand, with the lane's collaborators played by small fakes:
a launch the backend finishes between the worker's two looks at it, and a plan the lane made
for a job the general path then drops (a dead request)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from kvwire.session.prefill.lane import Lane, _Flight, _Taken
from kvwire.session.prefill.posting import Tail
from kvwire.testing.pair import Pair, config


class FlippingLaunch:
    """A launch the lane's thread finishes right after the worker first reads ``done``."""

    def __init__(self) -> None:
        self.reads = 0
        self.poll = None
        self.errors: list[str | None] = [None]
        self.retry = [False]

    @property
    def done(self) -> bool:
        self.reads += 1
        return self.reads > 1


class Side:
    def __init__(self) -> None:
        self.ended: list[Any] = []

    def end_turn(self, writes: Any) -> None:
        self.ended.extend(writes)


def test_a_launch_finished_between_two_looks_is_ended_not_lost() -> None:
    """The worker partitions its launches by one read of ``done`` each: a launch that the
    backend's thread finishes while the worker sorts them is ended at the next poll (two
    reads could put it in neither list, leaving its requests and their writes in flight
    for good)."""
    side = Side()
    ctx = SimpleNamespace(options=SimpleNamespace(transfer_timeout_s=60.0), agent_name="p")
    lane = Lane(ctx, side, None, threading.Event(), lambda job: None)  # type: ignore[arg-type]
    strategy = SimpleNamespace(on_sent=lambda *a: None)
    job = SimpleNamespace(
        room=SimpleNamespace(room=7, metrics=SimpleNamespace(marks={})),
        dest="d",
        target=SimpleNamespace(strategy=strategy),
        t_enqueued=None,
    )
    chunk = SimpleNamespace(nbytes=8, num_rows=1)
    finished = SimpleNamespace(done=True, poll=None, errors=[None], retry=[False])
    for launch in (finished, FlippingLaunch()):  # one ended already, one ending meanwhile
        taken = _Taken(job, None, chunk, None, b"", 0.0)  # type: ignore[arg-type]
        lane._flights.append(_Flight([taken], launch, 0.0, float("inf")))  # type: ignore[arg-type]
    lane.inflight = 2
    polls = 0
    while lane.busy and polls < 3:
        lane.progress()
        polls += 1
    assert not lane.busy and len(side.ended) == 2, (polls, side.ended)
    assert all(w[2] is not None for w in side.ended)  # both accounted as done


def test_a_dropped_job_gives_its_lane_made_plan_back() -> None:
    """A job the lane declined keeps the plan it made (``job.planned``); when the general
    path drops the job (its request died first), the strategy hears that plan ended unsent,
    so a plan holding a buffer never keeps it."""
    p = Pair(config(secret="drop-plan"))
    try:
        pipeline = p.prefill.side.workers._stages[0]  # type: ignore[attr-defined]
        heard: list[tuple[int, object, bool]] = []
        strategy = SimpleNamespace(on_sent=lambda room, plan, ok: heard.append((room, plan, ok)))
        plan = object()
        job = SimpleNamespace(
            planned=plan, target=SimpleNamespace(strategy=strategy), room=SimpleNamespace(room=3)
        )
        tail = Tail(SimpleNamespace(room=3), SimpleNamespace(session="d"), None)  # type: ignore[arg-type]
        tail.queue.append(job)  # type: ignore[arg-type]
        pipeline.tails[(3, "d")] = tail
        pipeline._drop((3, "d"), tail)
        assert heard == [(3, plan, False)] and job.planned is None
        assert (3, "d") not in pipeline.tails
    finally:
        p.close()
