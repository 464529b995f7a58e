"""The owner-loop helper: commands run on the owner thread in order, a failing command or
step does not end it, a poller wakes on a post, and stop ends the thread and closes the pipe."""

from __future__ import annotations

import os
import select
import threading
import time

from kvwire.owner_loop import OwnerLoop


def test_commands_run_on_the_owner_thread_in_order_and_survive_errors() -> None:
    seen: list[tuple[int, str]] = []
    steps = threading.Semaphore(0)
    failed_steps = [0]

    def step() -> None:
        if failed_steps[0] < 2:
            failed_steps[0] += 1
            raise RuntimeError("a step that fails")
        select.select([loop.wake_fd], [], [], 0.05)
        steps.release()

    loop = OwnerLoop("test-owner", step)
    loop.start()
    done = threading.Event()
    for i in range(50):
        loop.post(lambda i=i: seen.append((i, threading.current_thread().name)))
    loop.post(lambda: 1 / 0)  # a failing command: logged, the next one still runs
    loop.post(done.set)
    assert done.wait(30)
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"test-owner"}
    assert steps.acquire(timeout=30), "the loop kept stepping after failing steps"
    fd = loop.wake_fd
    assert loop.stop(10)
    assert not loop.on_owner_thread()
    try:
        os.fstat(fd)
    except OSError:
        pass
    else:
        raise AssertionError("the wake pipe stayed open after stop")
    loop.post(lambda: None)  # after stop: queued, never written to a closed descriptor


def test_a_post_wakes_a_poller_at_once() -> None:
    woke, waiting = threading.Event(), threading.Event()

    def step() -> None:
        waiting.set()  # the commands of this round ran: a post from now on must wake select
        if select.select([loop.wake_fd], [], [], 30)[0]:
            woke.set()

    loop = OwnerLoop("test-wake", step)
    loop.start()
    assert waiting.wait(30)
    loop.post(lambda: None)
    assert woke.wait(30)
    assert loop.stop(35)


def test_a_step_that_drains_the_pipe_loses_no_wake_up_and_does_not_spin() -> None:
    """A step that waits on the wake descriptor and drains it itself (as the tcp backend's
    I/O loop does): commands posted from four threads at once all run, each promptly (a lost
    wake-up would leave one waiting for the 30 s select timeout), and once they ran the loop
    waits instead of spinning on a stale byte."""
    turns = [0]

    def step() -> None:
        turns[0] += 1
        if select.select([loop.wake_fd], [], [], 30)[0]:
            loop.drain_wake()

    loop = OwnerLoop("test-drain", step)
    loop.start()
    ran: list[int] = []
    per_thread = 500

    def poster() -> None:
        for _ in range(per_thread):
            loop.post(lambda: ran.append(1))

    posters = [threading.Thread(target=poster) for _ in range(4)]
    for t in posters:
        t.start()
    for t in posters:
        t.join()
    deadline = time.monotonic() + 20  # below select's 30 s: a lost wake-up fails here
    while len(ran) < 4 * per_thread and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ran) == 4 * per_thread
    idle_from = turns[0]
    time.sleep(0.3)
    assert turns[0] - idle_from <= 1, "the loop spins on a drained pipe"
    assert loop.stop(35)


def test_a_loop_without_a_pipe_runs_commands_woken_by_its_own_event() -> None:
    """``pipe=False`` (the session's progress thread): the step waits on an event the poster
    sets; commands still run on the owner thread in order, and
    asking for the wake descriptor is a clear error."""
    wake = threading.Event()
    seen: list[tuple[int, str]] = []

    def step() -> None:
        wake.wait(30)
        wake.clear()

    loop = OwnerLoop("test-nopipe", step, pipe=False)
    loop.start()
    done = threading.Event()
    for i in range(20):
        loop.post(lambda i=i: seen.append((i, threading.current_thread().name)))
    loop.post(done.set)
    wake.set()
    assert done.wait(30)
    assert [i for i, _ in seen] == list(range(20))
    assert {name for _, name in seen} == {"test-nopipe"}
    try:
        _ = loop.wake_fd
    except RuntimeError as exc:
        assert "without a wake pipe" in str(exc)
    else:
        raise AssertionError("a loop without a pipe handed out a descriptor")
    ended = threading.Thread(target=lambda: loop.stop(10))
    ended.start()
    wake.set()  # the step's wait ends; stop() then joins the thread
    ended.join(30)
    assert not loop.is_alive()


def test_wake_is_taken_by_one_wait_and_never_lost() -> None:
    from kvwire.owner_loop import Wake

    w = Wake()
    assert not w.is_set()
    assert not w.wait(0.001)  # nothing set: the timeout passes
    w.set()
    w.set()  # setting twice is setting once
    assert w.is_set()
    assert w.wait(30)  # set before the wait: returns at once and takes it
    assert not w.wait(0.001)
    w.set()
    w.clear()  # dropped before any wait
    assert not w.wait(0.001)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(w.wait(30)))
    waiter.start()
    time.sleep(0.01)
    w.set()  # from another thread: wakes the waiter
    waiter.join(30)
    assert got == [True]
