"""One thread owns some state; other threads hand it commands.

Several parts of kvwire keep sockets or tables that only one thread touches (the tcp backend's
I/O thread, Mooncake's notification channel, the manager's chores): any other thread that
wants something done posts a command (a callable) and wakes the owner. :class:`OwnerLoop` is
that pattern once: a command queue, a self-pipe whose read end a ``zmq.Poller`` (or
``select``) can wait on beside the owner's sockets, and the thread that runs the owner's step
function until stopped, logging (never dying of) an exception.

Contract: :meth:`OwnerLoop.post` may be called from any thread, also from the owner (the
command then runs on the next step). A step that waits on :attr:`OwnerLoop.wake_fd` itself
calls :meth:`OwnerLoop.drain_wake` when its wait reports it readable; the loop then stops
reading the pipe on every turn (a system call, which releases the GIL, on turns that socket
traffic woke: the tcp backend's latency path measured it). Commands and the step run on the
owner thread only, in the order posted; state they touch needs no lock as long as nothing else
touches it. An owner whose step waits on something else (the session's progress thread waits
on an event its posters set) builds the loop with ``pipe=False``: no pipe, so a post is a
queue put and a turn reads no descriptor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["OwnerLoop", "Wake"]


class Wake:
    """A wake-up for one waiting thread: :meth:`set` from any thread; the waiter's
    :meth:`wait` returns at once if it was set since the last wait (and takes that wake-up),
    else when it is set or the timeout passes.

    The session's progress thread waits on one between turns, hundreds of times a second
    while data is awaited. A ``threading.Event`` wait is Python code (a new lock, a waiter
    list, a condition); this is one lock held while not set, so a wait is one C-level
    acquire with a timeout and a set one release (any thread may release a plain lock).
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        """Wake the waiter (or its next wait). Any thread; setting twice is setting once."""
        with contextlib.suppress(RuntimeError):  # released already: set already
            self._lock.release()

    def wait(self, timeout: float) -> bool:
        """Owner thread: wait at most ``timeout`` seconds for a wake-up; True if one came
        (it is taken: the next wait waits again)."""
        return self._lock.acquire(timeout=timeout)

    def clear(self) -> None:
        """Drop a wake-up that came and was not waited for."""
        self._lock.acquire(blocking=False)

    def is_set(self) -> bool:
        """Whether a wake-up waits to be taken (racy by nature: for tests and logs)."""
        return not self._lock.locked()


class OwnerLoop:
    """A thread that runs ``step`` (which should wait at most a short while, e.g. polling
    :attr:`wake_fd` and its sockets) after running the commands posted to it.

    Built by the owner of the state (the backend or channel) in its constructor;
    :meth:`start` starts the thread, :meth:`stop` ends it (from any other thread).
    """

    def __init__(self, name: str, step: Callable[[], None], *, pipe: bool = True) -> None:
        self.name = name
        self._step = step
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._pipe = pipe
        self._wake_r, self._wake_w = os.pipe() if pipe else (-1, -1)
        if pipe:
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
        self._stopped = False
        # without a pipe there is nothing to write to or read from
        self._closed = not pipe
        #: Set by the first drain_wake(): the step reads the pipe when its wait saw it readable.
        self._step_drains = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def wake_fd(self) -> int:
        """File descriptor that becomes readable when a command is posted; register it with
        the owner's poller (reading it is this class's business, in :meth:`run_commands`).
        Only for a loop built with a pipe."""
        if not self._pipe:
            raise RuntimeError(f"{self.name}: built without a wake pipe")
        return self._wake_r

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was asked for (the step may check it to return early)."""
        return self._stopped

    def start(self) -> None:
        """Start the owner thread; called once by the owner after its state is built."""
        self._thread.start()

    def is_alive(self) -> bool:
        """Whether the owner thread is running (started and not ended). Any thread."""
        return self._thread.is_alive()

    def on_owner_thread(self) -> bool:
        """Whether the caller is the owner thread."""
        return threading.current_thread() is self._thread

    def post(self, command: Callable[[], None]) -> None:
        """Queue ``command`` for the owner thread and wake it. Any thread."""
        self._commands.put(command)
        if self._closed:  # the descriptors are gone (their numbers may be reused)
            return
        with contextlib.suppress(OSError):  # a full pipe is already a wake-up
            os.write(self._wake_w, b"x")

    def drain_wake(self) -> None:
        """Owner thread, in a step that waits on :attr:`wake_fd`: read the wake-up bytes, once
        the wait reported the descriptor readable. After the first call :meth:`run_commands`
        no longer reads the pipe itself (a byte written after a turn's commands ran keeps the
        descriptor readable, so the next wait returns and this drains it: no wake-up is lost,
        and the wait never spins on a stale byte)."""
        self._step_drains = True
        if not self._closed:
            with contextlib.suppress(OSError):
                while os.read(self._wake_r, 4096):
                    pass

    def run_commands(self) -> int:
        """Run every command posted so far; called by the loop before each step (owner
        thread). Returns how many ran. A command that raises is logged and the next one runs."""
        if not self._closed and not self._step_drains:
            with contextlib.suppress(OSError):
                while os.read(self._wake_r, 4096):
                    pass
        ran = 0
        commands = self._commands
        # the owner is the only consumer: a queue that is not empty has a command to get (an
        # empty check costs less than the exception an empty get raises, on every turn)
        while not commands.empty():
            command = commands.get_nowait()
            ran += 1
            try:
                command()
            except Exception:  # a command must not take the owner thread down
                logger.exception("%s: command failed", self.name)
        return ran

    def stop(self, timeout: float = 2.0) -> bool:
        """Ask the owner thread to end after its current step and wait up to ``timeout``
        seconds for it. Any thread but the owner. Returns whether it ended; the pipe is closed
        once it did (a thread still stuck in its step keeps it open)."""
        self._stopped = True
        self.post(lambda: None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        ended = not self._thread.is_alive()
        if ended and not self._closed and self._pipe:
            self._closed = True
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
        return ended

    def _run(self) -> None:
        while not self._stopped:
            try:
                self.run_commands()
                if self.stopped:  # asked while the commands ran
                    break
                self._step()
            except Exception:  # the owner thread must never die
                logger.exception("%s: loop error", self.name)
        self.run_commands()  # commands posted before stop still run, on this thread
        logger.debug("%s: stopped", self.name)
