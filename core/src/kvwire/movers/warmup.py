"""Kernels compiled before their first launch: one thread per owner that runs warm-ups.

A Triton kernel variant is compiled at its first launch (about a second on a host whose
Triton cache lacks it: a fresh container), so a link's first chunk would wait for it. The
owners of movers (``cudaipc``'s lean lane, bulk staging) know at a link's handshake which
variants its chunks will launch; they hand a warm-up (a callable that compiles them through
:meth:`kvwire.movers.triton_pages.PageCopier.compiling` and returns how many it compiled) to
their :class:`Warmer`, which runs them one after the other off the request path and logs
each. Links of one shape share variants: a later link's warm-up compiles nothing. Why the
standard library's executor: one worker thread, a queue and shutdown with cancellation are
what it is; nothing here is worth writing again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

__all__ = ["Warmer"]


class Warmer:
    """One owner's warm-up thread (made at its first warm-up). Thread contract: any thread
    may :meth:`submit` and :meth:`close`; a lock of its own guards the executor and whether
    it is closed (a handshake may race the owner's close)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, what: str, warm: Callable[[], int | None]) -> None:
        """Run ``warm`` on the warm-up thread, after the ones before it; ``what`` names it
        in the log. ``warm`` returns the kernel variants it compiled (0: nothing to log), or
        None where it ran a real launch that compiled what it needed (logged with its time).
        Returns at once; nothing once closed. A warm-up that raises is logged (the first
        launch of its variants compiles them, as without a warm-up)."""
        with self._lock:
            if self._closed:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kvwire-{self.name}-warm")
            self._pool.submit(self._run, what, warm)

    @staticmethod
    def _run(what: str, warm: Callable[[], int | None]) -> None:
        """The warm-up thread: one warm-up, timed and logged."""
        t0 = time.perf_counter()
        try:
            n = warm()
        except Exception:
            logger.warning("compiling %s failed", what, exc_info=True)
            return
        if n is None:
            logger.info("%s ready in %.2f s", what, time.perf_counter() - t0)
        elif n:
            logger.info(
                "%s ready: %d kernel variant(s) compiled in %.2f s",
                what,
                n,
                time.perf_counter() - t0,
            )

    def close(self, wait: bool = False) -> None:
        """The owner's close: none starts; one under way finishes on its own, or before this
        returns with ``wait`` (a warm-up that reads the rank's buffers, which the engine
        may free once the owner closed)."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)
