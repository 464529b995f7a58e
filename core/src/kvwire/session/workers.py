"""Transfer worker threads with queues sharded by destination.

``send()`` on the engine's thread only enqueues; a worker maps, submits and waits. All chunks for
one destination go to the same worker (``shard = hash(destination) % N``), so a request's chunks
to a destination stay in order. A worker never dies: the job itself records failures per room
(see :mod:`kvwire.session.prefill`); anything that still escapes is logged and the worker goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import zlib
from collections.abc import Callable

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class TransferWorkers:
    """``n`` daemon threads, one FIFO queue each. ``inline=True`` runs jobs on the caller's
    thread instead (the synchronous single-thread mode the benchmark compares against)."""

    def __init__(self, n: int, name: str, *, inline: bool = False) -> None:
        self.inline = inline
        self._queues: list[queue.SimpleQueue[Job | None]] = []
        self._threads: list[threading.Thread] = []
        if inline:
            return
        for i in range(n):
            q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
            t = threading.Thread(target=self._loop, args=(q,), name=f"{name}-w{i}", daemon=True)
            self._queues.append(q)
            self._threads.append(t)
            t.start()

    @staticmethod
    def _loop(q: queue.SimpleQueue[Job | None]) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                logger.exception("transfer worker: job raised; the worker continues")

    def submit(self, shard_key: str, job: Job) -> None:
        """Queue ``job`` on the worker that owns ``shard_key`` (or run it now when inline)."""
        if self.inline:
            try:
                job()
            except Exception:
                logger.exception("transfer job raised")
            return
        q = self._queues[zlib.crc32(shard_key.encode()) % len(self._queues)]
        q.put(job)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Let queued jobs finish, then stop every thread (bounded by ``timeout_s`` each)."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout_s)
            if t.is_alive():
                logger.warning("transfer worker %s did not stop within %.1fs", t.name, timeout_s)
        self._queues.clear()
        self._threads.clear()
