"""Transfer worker threads with queues sharded by destination.

``send()`` on the engine's thread only enqueues; a worker posts, polls and finishes transfers
through its own :class:`~kvwire.session.prefill.pipeline.Pipeline`. All chunks for one
destination go to the same worker (``shard = crc32(destination) % N``, or for a staged link's
destination the least used worker when it is first seen), so a request's chunks to a
destination are posted in order. A worker never dies: failures are recorded per request
by the pipeline; anything that still escapes is logged and the worker goes on.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import traceback
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Generic, Protocol, TypeVar

logger = logging.getLogger(__name__)

#: Longest a worker sleeps between polls while transfers are in flight.
MAX_POLL_SLEEP_S = 0.0002
MIN_POLL_SLEEP_S = 0.00002

#: The queue key of every link whose backend wants one worker (see :func:`shard_for`).
ONE_WORKER = "one-worker"

J = TypeVar("J")
J_contra = TypeVar("J_contra", contravariant=True)


def shard_for(session: str, room: int, staged: bool, one_worker: bool) -> str:
    """The queue key of one request's chunks to decode session ``session``, fixed at its
    first chunk (a destination's chunks must stay on one worker, in order). Order matters
    only within one request to one destination, so other requests to the same rank go to
    other workers; a staged link keeps one queue per destination (its ring space is granted
    in write order); with ``one_worker`` (the link's backend wants one worker and the operator
    set no ``num_workers``: ``cudaipc``, whose submit is a launch that returns, so more
    workers would only take turns on the GIL) every such link's chunks share one queue."""
    if staged:
        return session
    return ONE_WORKER if one_worker else f"{session}/{room}"


class Stage(Protocol[J_contra]):
    """What a worker drives: accepts jobs, then polls what they posted."""

    @property
    def busy(self) -> bool: ...

    @property
    def full(self) -> bool: ...

    def accept(self, job: J_contra) -> None: ...

    def progress(self) -> int: ...

    def turn(self) -> AbstractContextManager[None]:
        """Around one turn of the loop (the jobs taken, then :meth:`progress`)."""
        ...

    def idle(self, sleep_s: float) -> None: ...

    def notify(self) -> None: ...

    def drain(self, poll_sleep_s: float) -> None: ...


class TransferWorkers(Generic[J]):
    """``n`` daemon threads, each with a FIFO queue and its own stage (pipeline).

    ``inline=True`` runs each job to completion on the caller's thread instead: the synchronous
    single-thread mode the benchmark compares against. ``thread_setup`` runs first on each
    worker thread.
    """

    def __init__(
        self,
        n: int,
        name: str,
        make_stage: Callable[[int], Stage[J]],
        *,
        inline: bool = False,
        thread_setup: Callable[[], object] | None = None,
    ) -> None:
        self.inline = inline
        #: Called first on each worker thread (its timer slack).
        self._setup = thread_setup
        #: Jobs submitted and not yet taken by their worker's pipeline.
        self._pending = 0
        self._count_lock = threading.Lock()
        #: Sticky keys' workers (see :meth:`submit`); under ``_count_lock``.
        self._sticky: dict[str, int] = {}
        self._queues: list[queue.SimpleQueue[J | None]] = []
        self._stages: list[Stage[J]] = []
        self._threads: list[threading.Thread] = []
        self._inline_stage = make_stage(0) if inline else None
        self._inline_lock = threading.Lock()
        if inline:
            return
        for i in range(n):
            q: queue.SimpleQueue[J | None] = queue.SimpleQueue()
            stage = make_stage(i)
            t = threading.Thread(
                target=self._loop, args=(q, stage), name=f"{name}-w{i}", daemon=True
            )
            self._queues.append(q)
            self._stages.append(stage)
            self._threads.append(t)
            t.start()

    @property
    def queued(self) -> int:
        """Jobs waiting in the queues (not yet taken by a worker). Any thread."""
        return self._pending

    def _took(self) -> None:
        with self._count_lock:
            self._pending -= 1

    def _loop(self, q: queue.SimpleQueue[J | None], stage: Stage[J]) -> None:
        if self._setup is not None:
            try:
                self._setup()
            except Exception:
                logger.exception("transfer worker: its setup failed; the worker runs anyway")
        sleep = MIN_POLL_SLEEP_S
        stopping = False
        while True:
            try:
                first: J | None = None
                if not stage.busy:
                    if stopping:
                        return
                    first = q.get()  # blocks outside the turn: nothing is held meanwhile
                    if first is None:
                        return
                    self._took()
                    sleep = MIN_POLL_SLEEP_S
                with stage.turn():  # what the turn posts may go out together at its end
                    if first is not None:
                        stage.accept(first)
                    while not stopping and not stage.full:
                        try:
                            job = q.get_nowait()
                        except queue.Empty:
                            break
                        if job is None:
                            stopping = True
                            break
                        self._took()
                        stage.accept(job)
                    moved = stage.progress()
                if moved:
                    sleep = MIN_POLL_SLEEP_S
                elif stage.busy:
                    stage.idle(sleep)
                    sleep = min(sleep * 2, MAX_POLL_SLEEP_S)
            except Exception:
                logger.exception("transfer worker: unexpected error; the worker continues")

    def submit(self, shard_key: str, job: J, *, sticky: bool = False) -> None:
        """Queue ``job`` on the worker that owns ``shard_key`` (or run it now when inline).

        A key's worker is ``crc32(key) % N``; with ``sticky`` (a staged link's destination: a
        few long-lived keys, each needing one worker) the key is given, the first time it is
        seen, the worker with the fewest sticky keys, so two destinations of one prefill rank
        (TP 1 -> 2, fan-out) never share a worker by a hash collision. :meth:`forget` drops
        a sticky key once no job can come for it any more."""
        if self._inline_stage is not None:
            with self._inline_lock:
                self._inline_stage.accept(job)
                self._inline_stage.drain(MIN_POLL_SLEEP_S)
            return
        with self._count_lock:
            self._pending += 1
            i = self._sticky.get(shard_key, -1) if sticky else -1
            if sticky and i < 0:
                load = [0] * len(self._queues)
                for w in self._sticky.values():
                    load[w] += 1
                i = self._sticky[shard_key] = load.index(min(load))
        if i < 0:
            i = zlib.crc32(shard_key.encode()) % len(self._queues)
        self._queues[i].put(job)
        self._stages[i].notify()  # an idle stage may be waiting on something else

    def forget(self, shard_key: str) -> None:
        """Any thread: drop a sticky key's worker (its destination is gone: no job for it can
        come any more, so a later key may take the worker without breaking any order)."""
        with self._count_lock:
            self._sticky.pop(shard_key, None)

    def notify_all(self) -> None:
        """Any thread: end every worker's :meth:`Stage.idle` wait now (a staging grant came,
        so a chunk waiting for ring space may go)."""
        for stage in list(self._stages):
            stage.notify()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Let queued jobs finish (failed requests end fast), then stop every thread."""
        for q, stage in zip(self._queues, self._stages, strict=True):
            q.put(None)
            stage.notify()
        for t in self._threads:
            t.join(timeout_s)
            if t.is_alive():
                frame = sys._current_frames().get(t.ident or -1)
                where = "".join(traceback.format_stack(frame)[-6:]) if frame else "(no frame)"
                logger.warning(
                    "transfer worker %s did not stop within %.1fs; it is at:\n%s",
                    t.name,
                    timeout_s,
                    where,
                )
        self._queues.clear()
        self._stages.clear()
        self._threads.clear()
