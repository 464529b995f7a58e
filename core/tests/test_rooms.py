"""The session layer's owners below the façade: the room table (rooms, status, the room lock)
and the rank context's ``later`` verb (chores on the progress thread)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvwire.errors import ConfigError
from kvwire.session.metrics import RequestMetrics
from kvwire.session.poll import KVPoll
from kvwire.session.rooms import RoomTable
from kvwire.testing.pair import config, pair, wait_for


@dataclass
class _Room:
    room: int
    pages: Any = None
    pool: str = "kv"
    t0: float = field(default_factory=time.perf_counter)
    error: BaseException | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    failed_at: float = 0.0

    def pages_in(self, pool: str) -> Any:
        return self.pages if pool == self.pool else None


def _table() -> RoomTable[_Room]:
    return RoomTable({"role": "test", "agent": "rooms-test"})


def test_a_room_is_created_once_and_forgotten_once() -> None:
    t = _table()
    with t.lock:
        room = t.create(_Room(7))
        assert t.status.get(7, KVPoll.Failed) is KVPoll.Bootstrapping
        assert t.get(7) is room and 7 in t and len(t) == 1
        with pytest.raises(ConfigError, match="already has a request object"):
            t.create(_Room(7))
        with pytest.raises(ConfigError, match="unsigned 64-bit"):
            t.create(_Room(-1))
        assert t.forget(room)
        assert not t.forget(room)  # a second clear finds nothing
        assert t.get(7) is None and len(t.status) == 0


def test_failure_is_recorded_once_and_never_after_success() -> None:
    t = _table()
    with t.lock:
        a, b = t.create(_Room(1)), t.create(_Room(2))
        t.advance(a, KVPoll.Transferring)
        first, second = RuntimeError("first"), RuntimeError("second")
        assert t.fail(a, first)
        assert not t.fail(a, second)  # the first failure is the one kept
        assert a.error is first and t.terminal(a)
        assert t.status.get(1, KVPoll.Success) is KVPoll.Failed
        t.succeed(b)
        assert not t.fail(b, first)  # a succeeded request does not fail afterwards
        assert b.error is None and t.terminal(b) and b.metrics.total_s > 0
        assert t.status.get(2, KVPoll.Failed) is KVPoll.Success


def test_pages_are_given_only_for_a_live_room_of_that_pool() -> None:
    t = _table()
    pages = np.arange(4)
    with t.lock:
        room = t.create(_Room(3, pages=pages, pool="host"))
    assert t.pages(3, "host") is pages
    assert t.pages(3, "kv") is None
    assert t.pages(4, "host") is None
    with t.lock:
        t.fail(room, RuntimeError("x"))
    assert t.pages(3, "host") is None  # a failed room's pages are no strategy's business


def test_later_runs_chores_on_the_progress_thread_in_order() -> None:
    with pair(config()) as p:
        ctx = p.prefill.ctx
        ran: list[tuple[int, str]] = []
        done = threading.Event()
        for i in range(3):
            ctx.later(lambda i=i: ran.append((i, threading.current_thread().name)))
        ctx.later(done.set)
        wait_for(done.is_set)
        assert [i for i, _ in ran] == [0, 1, 2]
        assert {name for _, name in ran} == {f"kvwire-progress-{ctx.agent_name}"}
