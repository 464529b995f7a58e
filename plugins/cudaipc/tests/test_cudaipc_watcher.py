"""The ``cudaipc`` kernel watcher's event reuse (:mod:`kvwire_cudaipc.watcher`), with
stand-in events (no GPU): an event is reused only after the watcher passed every transfer
waiting for it, each such transfer is marked ``ended`` before its event can be reused, and
an event whose wait failed is never reused."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvwire_cudaipc.watcher import KernelWatcher


class _Ev:
    """A stand-in CUDA event: ``synchronize`` blocks until ``gate`` opens (a kernel still
    running), or raises when ``broken`` (a sticky CUDA error)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.records: list[Any] = []
        self.broken = False

    def record(self, stream: Any) -> None:
        self.records.append(stream)

    def synchronize(self) -> None:
        assert self.gate.wait(30), "stand-in kernel never finished"
        if self.broken:
            raise RuntimeError("an illegal memory access was encountered")


@dataclass(eq=False)
class _X:
    event: Any = None
    ended: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


@pytest.fixture
def watcher() -> Any:
    made: list[_Ev] = []
    hold = threading.Event()
    hold.set()

    def done(x: _X, error: str | None) -> None:
        assert hold.wait(30)
        x.error = error
        x.done.set()

    def make() -> _Ev:
        made.append(_Ev())
        return made[-1]

    w = KernelWatcher("test", done, make)
    w.made, w.hold = made, hold  # type: ignore[attr-defined]
    yield w
    hold.set()
    for e in made:
        e.gate.set()
    w.stop()


def test_an_event_is_reused_once_its_transfer_ended(watcher: Any) -> None:
    """One launch: its event is recorded on the launch's stream; once the watcher passed the
    transfer (ended), the next launch records the same event instead of a fresh one."""
    x = _X()
    x.event = watcher.record("s1")
    assert watcher.made == [x.event] and x.event.records == ["s1"]
    watcher.watch(x)
    y_event = watcher.record("s2")  # x still running: a second event is made
    assert len(watcher.made) == 2 and y_event is not x.event
    x.event.gate.set()
    assert x.done.wait(30) and x.error is None
    for _ in range(3000):  # ended and freed right after done returns
        if x.ended and watcher._free:
            break
        threading.Event().wait(0.001)
    assert x.ended
    z_event = watcher.record("s3")
    assert z_event is x.event and x.event.records == ["s1", "s3"]
    assert len(watcher.made) == 2


def test_a_batch_event_waits_for_its_last_transfer(watcher: Any) -> None:
    """Transfers of one batch share an event: it is not reused while a later one of them
    has not been passed (the watcher still has to wait on it), and is once the last has."""
    a, b = _X(), _X()
    ev = watcher.record("s")
    a.event = b.event = ev
    watcher.hold.clear()  # the watcher stops inside done() of the first transfer
    watcher.watch(a, False)
    watcher.watch(b, True)
    ev.gate.set()
    assert not a.done.wait(0.2)  # held in done(a)
    assert watcher.record("t") is not ev  # nothing free yet: a fresh event
    watcher.hold.set()
    assert a.done.wait(30) and b.done.wait(30)
    for _ in range(3000):
        if b.ended:
            break
        threading.Event().wait(0.001)
    assert a.ended and b.ended
    for _ in range(3000):
        if watcher._free:
            break
        threading.Event().wait(0.001)
    assert list(watcher._free) == [ev]  # once, for the batch's last transfer


def test_a_failed_event_is_never_reused(watcher: Any) -> None:
    """A wait that failed (a sticky CUDA error) fails the transfer and drops its event."""
    x = _X()
    x.event = watcher.record("s")
    x.event.broken = True
    watcher.watch(x)
    x.event.gate.set()
    assert x.done.wait(30)
    assert x.error is not None and "illegal memory access" in x.error
    for _ in range(3000):
        if x.ended:
            break
        threading.Event().wait(0.001)
    assert x.ended and not watcher._free
    assert watcher.record("t") is not x.event
