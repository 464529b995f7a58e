"""The progress thread of a rank with no request ticks slowly (``IDLE_TICK_S``), and the first
new room wakes it at once: an idle manager no longer spends a turn every millisecond
(1.5% of a core on the development VM), and a request's first turn does not wait for the
idle tick. Every request-path test runs through the woken loop too."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvwire.layout import RankPosition
from kvwire.session import KVManager, Role
from kvwire.session import manager as manager_mod
from kvwire.testing.kvfill import make_pool
from kvwire.testing.pair import MODEL, config


@pytest.fixture(params=[Role.PREFILL, Role.DECODE], ids=["prefill", "decode"])
def prefill(request: pytest.FixtureRequest) -> Iterator[tuple[KVManager, list[float]]]:
    """A manager of either role (tcp, default settings) whose progress turns are counted
    (each turn drives the backend once)."""
    lay, _ = make_pool(MODEL, RankPosition(), 8)
    mgr = KVManager(config(), request.param, lay)
    turns: list[float] = []
    drive = mgr.ctx.backend.progress

    def counted() -> None:
        turns.append(time.monotonic())
        drive()

    mgr.ctx.backend.progress = counted  # type: ignore[method-assign]
    try:
        yield mgr, turns
    finally:
        mgr.close()


def test_an_idle_rank_ticks_slowly(prefill: tuple[KVManager, list[float]]) -> None:
    """No room: at most one turn per IDLE_TICK_S (plus wake-ups), where 1 ms ticks gave
    hundreds in the same time (a loaded host only makes turns rarer)."""
    _mgr, turns = prefill
    time.sleep(0.1)
    start = len(turns)
    time.sleep(0.6)
    idle = len(turns) - start
    assert idle <= 0.6 / manager_mod.IDLE_TICK_S + 10, f"{idle} turns in 0.6 s with no room"


def test_the_first_room_wakes_the_progress_thread(
    prefill: tuple[KVManager, list[float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the idle tick made an hour long, a new room still gets a turn: its creation woke
    the loop (without the wake-up the next turn would be an hour away), and while the room
    lives the loop ticks at CONTROL_TICK_S again."""
    mgr, turns = prefill
    monkeypatch.setattr(manager_mod, "IDLE_TICK_S", 3600.0)
    mgr.ctx.wake.set()  # let the loop take one turn and begin a wait of the new length
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        n = len(turns)
        time.sleep(0.05)
        if len(turns) == n:
            break  # the loop sleeps in its hour-long idle wait
    settled = len(turns)
    time.sleep(0.2)
    assert len(turns) == settled, "an idle loop turned without a wake-up"
    if mgr.role is Role.PREFILL:
        mgr.sender(7)
    else:  # the side's room creation, as a receiver makes it (no prefill to bootstrap from)
        mgr.side.create_room(7, "127.0.0.1:1")  # type: ignore[call-arg]
    deadline = time.monotonic() + 30
    while len(turns) < settled + 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(turns) >= settled + 5, "the new room did not wake the progress thread"
