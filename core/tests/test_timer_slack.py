"""kvwire's own threads ask for a short timer slack; the engine's threads keep theirs."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from kvwire.backends.tcp.backend import TcpBackend
from kvwire.testing.pair import config, pair
from kvwire.timer_slack import get_thread_slack_ns, set_thread_slack

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="timer slack is a Linux thread attribute"
)


def slack_of(thread: threading.Thread) -> int:
    """A thread's timer slack in ns, read from /proc (the attribute is per thread)."""
    path = Path(f"/proc/{thread.native_id}/timerslack_ns")  # (not in /proc/PID/task/TID/)
    return int(path.read_text())


#: kvwire's long-lived threads that wait on a request's path (names as kvwire gives them).
WANTED = ("kvwire-liveness-", "kvwire-progress-", "-w0")


def kvwire_threads(agents: tuple[str, ...]) -> dict[str, threading.Thread]:
    """The wanted threads of these managers (by agent name: not an earlier test's)."""
    return {
        t.name: t
        for t in threading.enumerate()
        if any(w in t.name for w in WANTED) and any(a in t.name for a in agents)
    }


def test_set_and_get_on_the_calling_thread_only() -> None:
    seen: dict[str, int | None] = {}

    def body() -> None:
        seen["before"] = get_thread_slack_ns()
        assert set_thread_slack(3.0)
        seen["after"] = get_thread_slack_ns()
        assert not set_thread_slack(None)  # None leaves it
        seen["kept"] = get_thread_slack_ns()

    main_before = get_thread_slack_ns()
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["before"] == main_before  # a new thread starts with its creator's value
    assert seen["after"] == seen["kept"] == 3000
    assert get_thread_slack_ns() == main_before  # the caller's thread is not touched


@pytest.mark.parametrize(
    ("slack_us", "pushes"),
    [(1.0, False), (7.5, False), (None, False), (1.0, True)],
    ids=["1us-polled", "7.5us-polled", "none-polled", "1us-events"],
)
def test_liveness_progress_and_workers_take_the_option(
    slack_us: float | None, pushes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a rank whose backend is polled (here tcp told it pushes no events: its progress
    thread then polls it, as NIXL's) the threads take the option; where the backend pushes
    events they keep the default, as the engine's thread does."""
    monkeypatch.setattr(TcpBackend, "pushes_events", pushes)
    engine = get_thread_slack_ns()
    assert engine is not None and engine > 7500  # the default (50 us) on every Linux seen
    with pair(config(timer_slack_us=slack_us)) as p:
        p.transfer(1)  # the progress thread has run its first chore, the worker its setup
        threads = kvwire_threads((p.prefill.agent_name, p.decode.agent_name))
        names = sorted(threads)
        for part in WANTED:
            assert any(part in n for n in names), (part, names)
        assert sum("liveness" in n for n in names) == 2  # prefill's and decode's
        expected = engine if slack_us is None or pushes else round(slack_us * 1000)
        for name, t in threads.items():
            assert slack_of(t) == expected, name
        assert get_thread_slack_ns() == engine  # the engine's (test's) thread keeps its own
