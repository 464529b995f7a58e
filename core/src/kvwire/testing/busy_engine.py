"""The cluster harness's engine loop between polls: a sleep, or Python that never pauses.

A serving engine's scheduler under load runs Python between its polls of kvwire; it gives up
the GIL only when the interpreter asks it to, every switch interval, and kvwire's threads in
its process wait for those turns (:mod:`kvwire.gil`). :class:`EngineLoop` plays either engine
in a rank process (:attr:`~kvwire.testing.cluster_spec.ClusterSpec.engine_busy`) and, for the
busy one, reports how much Python it ran beside kvwire against alone: the share of the GIL
kvwire's threads took from it.
"""

from __future__ import annotations

import sys
import time

__all__ = ["EngineLoop"]


class EngineLoop:
    """One rank process's engine loop pause (its main thread only)."""

    def __init__(self, busy: bool) -> None:
        self.busy = busy
        self._rounds = 0
        self._seconds = 0.0
        self._alone = 0.0

    def pause(self, seconds: float) -> None:
        """Between two polls: sleep ``seconds``, or run Python that long (counting rounds)."""
        if not self.busy:
            time.sleep(seconds)
            return
        start = time.perf_counter()
        end = start + seconds
        n = 0
        while (now := time.perf_counter()) < end:
            sum(range(64))
            n += 1
        self._rounds += n
        self._seconds += now - start

    def rate(self) -> float:
        """Rounds per millisecond of busy time since the last call (and reset)."""
        out = self._rounds / max(self._seconds, 1e-9) / 1e3
        self._rounds, self._seconds = 0, 0.0
        return out

    def measure_alone(self, seconds: float = 0.2) -> None:
        """Before the manager starts (no kvwire thread yet): the busy loop's own rate."""
        if self.busy:
            self.pause(seconds)
            self._alone = self.rate()

    def report(self, who: str) -> None:
        """At the rank's end: the busy loop's rate beside kvwire against alone, on stderr."""
        if not self.busy:
            return
        rate = self.rate()
        print(
            f"[{who}] busy engine loop: {rate:.0f} rounds/ms beside kvwire, {self._alone:.0f} "
            f"alone ({rate / max(self._alone, 1e-9):.2f}x)",
            file=sys.stderr,
            flush=True,
        )
