"""Transfer workers: a key's jobs run on one worker in order; sticky keys (a staged link's
destinations) are spread over the workers instead of hashed, and a forgotten key's worker
is free again."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from kvwire.session.prefill.workers import TransferWorkers


class _Record:
    """A stage that takes each job at once and records which worker thread took it."""

    def __init__(self, log: list[tuple[str, str, int]], lock: threading.Lock) -> None:
        self.log, self.lock = log, lock

    @property
    def busy(self) -> bool:
        return False

    @property
    def full(self) -> bool:
        return False

    def accept(self, job: tuple[str, int]) -> None:
        with self.lock:
            self.log.append((job[0], threading.current_thread().name, job[1]))

    def progress(self) -> int:
        return 0

    def turn(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def idle(self, sleep_s: float) -> None:
        return None

    def notify(self) -> None:
        return None

    def drain(self, poll_sleep_s: float) -> None:
        return None


def _run(submits: list[tuple[str, bool]], forget: str = "") -> list[tuple[str, str, int]]:
    log: list[tuple[str, str, int]] = []
    lock = threading.Lock()
    w: TransferWorkers[tuple[str, int]] = TransferWorkers(4, "tw", lambda i: _Record(log, lock))
    try:
        for n, (key, sticky) in enumerate(submits):
            if forget and key == "after-forget":
                w.forget(forget)
            w.submit(key, (key, n), sticky=sticky)
    finally:
        w.stop(30)
    return log


def test_sticky_keys_take_distinct_workers_and_keep_them_in_order() -> None:
    keys = ["dest-a", "dest-b", "dest-c", "dest-d"]
    log = _run([(k, True) for _ in range(5) for k in keys])
    worker = {}
    for key, thread, _ in log:
        assert worker.setdefault(key, thread) == thread, f"{key} moved between workers"
    assert len(set(worker.values())) == 4, f"sticky keys shared workers: {worker}"
    for key in keys:  # each key's jobs in submit order
        seq = [n for k, _, n in log if k == key]
        assert seq == sorted(seq)


def test_a_forgotten_key_frees_its_worker() -> None:
    keys = ["dest-a", "dest-b", "dest-c", "dest-d"]
    log = _run([(k, True) for k in keys] + [("after-forget", True)], forget="dest-b")
    worker = {key: thread for key, thread, _ in log}
    assert worker["after-forget"] == worker["dest-b"]


class _Stuck(_Record):
    """A stage whose accept blocks until released (a worker that cannot stop)."""

    def __init__(self, release: threading.Event, taken: threading.Event) -> None:
        super().__init__([], threading.Lock())
        self.release, self.taken = release, taken

    def accept(self, job: tuple[str, int]) -> None:
        self.taken.set()
        self.release.wait(30)


def test_a_worker_that_does_not_stop_is_logged_with_where_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``stop`` names a worker still running after its timeout and logs the lines of its
    stack where it is stuck, so a slow close can be traced from the log alone."""
    release, taken = threading.Event(), threading.Event()
    w: TransferWorkers[tuple[str, int]] = TransferWorkers(1, "tw", lambda i: _Stuck(release, taken))
    w.submit("k", ("k", 0))
    assert taken.wait(10)
    try:
        with caplog.at_level("WARNING", logger="kvwire.session.prefill.workers"):
            w.stop(0.2)
    finally:
        release.set()
    (rec,) = [r for r in caplog.records if "did not stop" in r.getMessage()]
    assert "tw-w0" in rec.getMessage() and "in accept" in rec.getMessage(), rec.getMessage()


class _Turns(_Record):
    """A stage that logs its turns: what was accepted and polled inside each. Its first
    accept waits until the test has queued every job (so they are in the queue together)."""

    def __init__(self, queued: threading.Event) -> None:
        super().__init__([], threading.Lock())
        self.queued = queued
        self.events: list[str] = []

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        self.events.append("enter")
        yield
        self.events.append("exit")

    def turn(self) -> contextlib.AbstractContextManager[None]:
        return self._turn()

    def accept(self, job: tuple[str, int]) -> None:
        self.queued.wait(10)
        self.events.append(f"accept {job[1]}")

    def progress(self) -> int:
        self.events.append("progress")
        return 0


def test_a_turn_takes_every_queued_job_then_polls_inside_one_block() -> None:
    """The jobs waiting in the queue are accepted and polled inside one ``turn`` block (a
    backend may post them together when it ends: ``TransferBackend.post_batch``); the wait
    for the next job is outside any block (nothing is held while the worker sleeps)."""
    queued = threading.Event()
    stages: list[_Turns] = []

    def make(i: int) -> _Turns:
        stages.append(_Turns(queued))
        return stages[-1]

    w: TransferWorkers[tuple[str, int]] = TransferWorkers(1, "tw", make)
    try:
        for n in range(3):
            w.submit("k", ("k", n))
        queued.set()
        deadline = time.monotonic() + 30
        while stages[0].events.count("exit") < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        w.stop(30)
    ev = stages[0].events
    first = ev[: ev.index("exit") + 1]
    assert first[0] == "enter" and first[-2:] == ["progress", "exit"], ev
    accepted = [e for e in first if e.startswith("accept")]
    # the first job is taken by the blocking get; the others were queued by then
    assert accepted == ["accept 0", "accept 1", "accept 2"], ev
