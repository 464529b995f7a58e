"""A prefill worker polls a write whose backend announces its end only once the announcement
came (:class:`kvwire.session.prefill.posted.Waker`), and every write at the deadline sweeps
(:meth:`kvwire.session.prefill.pipeline.Pipeline.progress`); before, every wake-up polled every
write in flight. The pipeline runs here with a stand-in context and handles (no backend), so
what is counted is exactly which transfers each progress call polls; a real tcp round trip
checks the wake-up path end to end."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvwire.backend import TransferHandle, XferOp, XferState
from kvwire.session import KVPoll
from kvwire.session.prefill.pipeline import EVENT_IDLE_S, Pipeline
from kvwire.session.prefill.posted import Posted, Waker
from kvwire.testing.kvfill import count_mismatches, fill_pages
from kvwire.testing.pair import config, pair, wait_for


def _pipeline(polled: list[int], done: set[int]) -> Pipeline:
    ctx = SimpleNamespace(
        options=SimpleNamespace(max_inflight_chunks=16, transfer_timeout_s=30.0),
        backend=SimpleNamespace(pushes_events=True),
    )
    pipe = Pipeline(ctx, side=None)  # type: ignore[arg-type]

    def state(p: Posted) -> XferState:
        polled.append(p.handle.id)
        return XferState.DONE if p.handle.id in done else XferState.PENDING

    pipe._state = state  # type: ignore[method-assign]
    pipe._complete = lambda p, s: None  # type: ignore[method-assign]
    return pipe


def _posted(pipe: Pipeline, i: int, pushes: bool) -> Posted:
    h = TransferHandle(i, "peer", XferOp.WRITE, 1, 1, pushes=pushes)
    p = Posted(h, (i, "s"), None, None, 0.0, 0.0, None, time.monotonic() + 30, "kv")  # type: ignore[arg-type]
    p.waker = Waker(pipe.wake) if pushes else None
    pipe.posted.append(p)
    return p


def test_only_announced_writes_are_polled_between_sweeps() -> None:
    polled: list[int] = []
    done: set[int] = set()
    pipe = _pipeline(polled, done)
    writes = [_posted(pipe, i, pushes=True) for i in range(6)]
    quiet = _posted(pipe, 99, pushes=False)  # announces nothing: polled every time
    pipe.progress()  # the first call is a sweep: every write polled once
    assert sorted(polled) == [0, 1, 2, 3, 4, 5, 99]
    for i in (1, 4):  # two writes end and their backend says so
        done.add(i)
        assert writes[i].waker is not None
        writes[i].waker()
    assert pipe.wake.is_set()
    polled.clear()
    pipe.progress()
    assert sorted(polled) == [1, 4, 99]  # not the four still running
    assert [p.handle.id for p in pipe.posted] == [0, 2, 3, 5, 99]
    polled.clear()
    pipe.progress()
    assert polled == [99]
    pipe._sweep_at = time.monotonic()  # the next deadline sweep is due
    polled.clear()
    pipe.progress()
    assert sorted(polled) == [0, 2, 3, 5, 99]
    assert quiet in pipe.posted


def test_a_write_moved_to_a_member_that_announces_nothing_is_polled_again() -> None:
    """A backend list's failover may move a write to a member without events (``pushes``
    cleared): its waker will never fire, so it is polled every time again."""
    polled: list[int] = []
    pipe = _pipeline(polled, set())
    p = _posted(pipe, 3, pushes=True)
    pipe.progress()
    polled.clear()
    pipe.progress()
    assert polled == []
    p.handle.pushes = False
    pipe.progress()
    assert polled == [3]
    assert EVENT_IDLE_S > 0


def test_requests_over_tcp_complete_with_announced_polls() -> None:
    """16 requests in flight over the real tcp backend (which announces ends), so the
    pipeline's wakers are the backend's wake-ups: every request completes on both sides with
    every element right, each write's end seen by a poll."""
    with pair(config(), slots=512) as p:
        backend: Any = p.prefill.ctx.backend
        polls: dict[int, int] = {}
        lock = threading.Lock()
        orig = backend.poll

        def poll(h: TransferHandle) -> XferState:
            with lock:
                polls[h.id] = polls.get(h.id, 0) + 1
            return orig(h)  # type: ignore[no-any-return]

        backend.poll = poll
        rs = []
        for i in range(16):
            r = p.decode.receiver(100 + i, p.addr)
            r.init()
            dst = np.arange(8) + 8 * i + 100
            r.send_metadata(dst, aux_index=1 + i)
            s = p.prefill.sender(100 + i)
            src = np.arange(8) + 8 * i
            fill_pages(p.play, p.parr, src, 0)
            rs.append((s, r, dst))
        for s, _, _ in rs:
            wait_for(lambda s=s: s.poll() >= KVPoll.WaitingForInput)
            s.init(8, aux_index=1)
        for i, (s, _, _) in enumerate(rs):
            s.send(np.arange(8) + 8 * i, last=True)
        for s, r, dst in rs:
            wait_for(lambda s=s, r=r: r.poll() is KVPoll.Success and s.poll() is KVPoll.Success)
            assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
            s.clear()
            r.clear()
        assert len(polls) == 16 and all(n >= 1 for n in polls.values())
