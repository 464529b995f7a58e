"""The SGLang cluster harness's waits for its rank processes (``sgl_harness.reply`` and
``OutOfStep``): a dead rank fails the wait at once, a rank's error is raised only after every
rank replied (the pipes stay in step), and after a failed wait the cluster refuses further
requests naming it instead of reading another request's replies."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from typing import Any

import pytest
from sgl_harness import OutOfStep, reply


def _echo(conn: Any) -> None:
    """A stand-in rank: answers each message with ("ok", msg), or ("error", ...) for "bad";
    exits without answering on "die"."""
    while (msg := conn.recv()) is not None:
        if msg == "die":
            return
        conn.send(("error", "Traceback: bad request") if msg == "bad" else ("ok", msg))


@pytest.fixture
def ranks() -> Any:
    ctx = mp.get_context("spawn")
    out = []
    for _ in range(2):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_echo, args=(child,), daemon=True)
        p.start()
        out.append((parent, p))
    yield out
    for c, p in out:
        with contextlib.suppress(OSError):  # a rank that exited closed its end
            c.send(None)
        p.join(10)


def test_a_rank_that_dies_fails_the_wait_at_once(ranks: Any) -> None:
    (c, p), _ = ranks
    c.send("die")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited"):
        reply(c, p, timeout=120)
    assert time.monotonic() - t0 < 30  # noticed by the process's exit, not the 120 s bound


def test_a_live_rank_that_never_answers_times_out(ranks: Any) -> None:
    (c, p), _ = ranks  # sent nothing: it waits for a message and answers none
    with pytest.raises(TimeoutError, match="did not answer"):
        reply(c, p, timeout=1.5)


def _first_replies(ranks: Any, first: str, second: str, error: str) -> OutOfStep:
    """Send ``first`` to rank 0 and ``second`` to rank 1; their replies must raise ``error``."""
    pipes = OutOfStep()
    (c0, _), (c1, _) = ranks
    c0.send(first)
    c1.send(second)
    with pytest.raises(RuntimeError, match=error):
        pipes.replies(ranks)
    return pipes


def test_errors_are_raised_after_every_reply_and_the_pipes_stay_in_step(ranks: Any) -> None:
    pipes = _first_replies(ranks, "bad", "first", "bad request")
    pipes.check()  # a rank's own error leaves the cluster usable
    for c, _ in ranks:
        c.send("second")
    assert pipes.replies(ranks) == ["second", "second"]


def test_after_a_failed_wait_later_requests_are_refused_naming_it(ranks: Any) -> None:
    pipes = _first_replies(ranks, "die", "late", "exited")
    with pytest.raises(RuntimeError, match=r"an earlier request on this cluster failed: .*exited"):
        pipes.check()
