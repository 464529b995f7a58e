"""A thread that runs Python without pause (as an engine's scheduler does under load), for the
probes of calls that let go of the GIL: scripts/gpu_event_gil_probe.py,
scripts/gpu_launch_gil_probe.py, scripts/held_send_probe.py.

    with BusyThread() as busy:
        rounds, us = busy.measure(call, 2000)   # rounds the busy thread ran meanwhile

A call that keeps the GIL leaves the busy thread its switch-interval turns only; one that lets
go of it hands the GIL over whenever the busy thread is waiting, and then waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType


class BusyThread:
    """The busy thread, running while the ``with`` block does."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._rounds = [0]
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rounds, stop = self._rounds, self._stop
        while not stop.is_set():
            rounds[0] += 1

    def __enter__(self) -> BusyThread:
        self._thread.start()
        time.sleep(0.05)  # running before the first measure
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def measure(self, call: Callable[[], object], n: int) -> tuple[int, float]:
        """Run ``call`` ``n`` times: the busy thread's rounds meanwhile, and microseconds a
        call."""
        r0, t0 = self._rounds[0], time.perf_counter()
        for _ in range(n):
            call()
        return self._rounds[0] - r0, (time.perf_counter() - t0) / n * 1e6
