"""The owner-loop helper: commands run on the owner thread in order, a failing command or
step does not end it, a poller wakes on a post, and stop ends the thread and closes the pipe."""

from __future__ import annotations

import os
import select
import threading

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
