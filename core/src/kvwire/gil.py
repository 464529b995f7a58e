"""The interpreter's GIL switch interval, which kvwire may lower for the process it runs in.

kvwire's threads (control, progress, transfer workers, a backend's I/O thread) live in the
engine's process and share its GIL. A thread that waited outside the GIL (a socket, a lock, a
CUDA call) and wants it back while the engine's thread runs Python waits until the interpreter
asks that thread to let go, which it does every *switch interval* (``sys.setswitchinterval``,
5 ms by default). A request's path crosses several such waits on each side, so behind an engine
loop that never sleeps a 2 MiB request took over 100 ms at 0.5 ms and its handshake did not
complete at all at 5 ms (docs/benchmarks.md, "A busy engine thread"). Behind an engine that
sleeps or waits on the GPU, a short interval only makes kvwire's own threads preempt each
other (C=8 and TP 1 -> 2 were up to 30% slower at 0.1 ms).

So the default (``control.gil_switch="auto"``) lowers the interval only while kvwire's threads
are seen waiting for the GIL. :class:`GilWatch` is fed, by the liveness thread, how late each of
its timed waits that nothing ended returned; when the median of the last :data:`WINDOW` is
:data:`STARVED_S` or more (a thread of the process holding the GIL for milliseconds at a time)
it lowers the interval to ``control.gil_switch_interval_us``. A lowered interval hides the
evidence, so every :data:`PROBE_S` (doubling up to :data:`PROBE_MAX_S` while the starvation is
still found) it puts the interval back for one window and looks again: a burst of Python at
startup (imports, compiling kernels, capturing graphs) costs a lowered interval for a while,
not for good. ``"always"`` lowers it when the manager starts, ``"never"`` leaves the
interpreter alone. The interval is process-wide; every change is logged.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

logger = logging.getLogger(__name__)

__all__ = [
    "PROBE_MAX_S",
    "PROBE_S",
    "STARVED_S",
    "WINDOW",
    "GilMode",
    "GilWatch",
    "apply_switch_interval",
]

GilMode = Literal["auto", "always", "never"]
#: Idle waits of the liveness thread whose lateness is looked at together.
WINDOW = 8
#: Median lateness of those waits at which kvwire's threads count as starved of the GIL.
STARVED_S = 0.001
#: How long a lowered interval stays before the watch looks again (doubled, up to
#: :data:`PROBE_MAX_S`, each time the starvation is still there).
PROBE_S = 10.0
PROBE_MAX_S = 300.0


def apply_switch_interval(interval_us: float, agent_name: str, why: str | None) -> float:
    """Lower the interpreter's switch interval to ``interval_us`` microseconds if it is longer
    (an engine that chose a shorter one keeps it), saying ``why`` in the log (None: quietly).
    Returns the interval in force, in seconds. Any thread."""
    current = sys.getswitchinterval()
    if current <= interval_us / 1e6:
        return current
    sys.setswitchinterval(interval_us / 1e6)
    if why is None:
        return sys.getswitchinterval()
    logger.info(
        "%s: GIL switch interval %.3f ms -> %.3f ms (%s; control.gil_switch='never' leaves "
        "the interpreter's setting alone)",
        agent_name,
        current * 1e3,
        interval_us / 1e3,
        why,
    )
    return sys.getswitchinterval()


class GilWatch:
    """One manager's switch-interval policy (built by the manager on the engine thread; fed
    by its liveness thread only, so no lock)."""

    def __init__(
        self,
        mode: GilMode,
        interval_us: float,
        agent_name: str,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[float, bool], None] | None = None,
    ) -> None:
        """``on_change(interval_s, lowered)`` is called (on the calling thread) with the
        interval in force whenever this watch sets it, and once at construction; the
        manager passes its metrics' update."""
        self.mode = mode
        self._on_change = on_change or (lambda interval_s, lowered: None)
        self.interval_us = interval_us
        self.agent_name = agent_name
        self._clock = clock
        self._late: deque[float] = deque(maxlen=WINDOW)
        #: The interval this watch found (and puts back when the starvation is gone).
        self._original = sys.getswitchinterval()
        #: When the interval is lowered: when to look again, and the wait after that.
        self._probe_at: float | None = None
        self._probe_s = PROBE_S
        #: How many times this watch lowered the interval (auto mode; metrics and tests).
        self.lowerings = 0
        if mode == "always":
            apply_switch_interval(interval_us, agent_name, "control.gil_switch='always'")
        self._on_change(sys.getswitchinterval(), False)

    @property
    def lowered(self) -> bool:
        """Whether this watch holds the interval lowered now (auto mode)."""
        return self._probe_at is not None

    def waited(self, asked_s: float, took_s: float) -> None:
        """Liveness thread, after a timed wait that nothing ended (no message came): it was
        asked to last ``asked_s`` and returned after ``took_s``. In auto mode: lowers the
        interval once the median lateness of the last :data:`WINDOW` such waits reaches
        :data:`STARVED_S`; while lowered, puts it back every probe period to look again."""
        if self.mode != "auto":
            return
        now = self._clock()
        if self._probe_at is not None:
            if now < self._probe_at:
                return
            self._probe_at = None  # a window at the engine's own interval
            self._late.clear()
            sys.setswitchinterval(self._original)
            self._on_change(self._original, False)
            return
        self._late.append(max(0.0, took_s - asked_s))
        if len(self._late) < WINDOW:
            return
        late = statistics.median(self._late)
        self._late.clear()
        if late < STARVED_S:
            if self._probe_s > PROBE_S:
                self._probe_s = PROBE_S
                logger.info(
                    "%s: GIL switch interval back at %.3f ms (kvwire's threads run on time)",
                    self.agent_name,
                    self._original * 1e3,
                )
            return
        first = self._probe_s == PROBE_S
        self.lowerings += 1
        self._probe_at = now + self._probe_s
        self._probe_s = min(2 * self._probe_s, PROBE_MAX_S)
        why = (
            f"kvwire's threads waited {late * 1e3:.1f} ms (median of {WINDOW}) to run again: "
            "a thread of this process holds the GIL for milliseconds at a time"
        )
        # still starved at a probe: lowered again, quietly
        interval = apply_switch_interval(self.interval_us, self.agent_name, why if first else None)
        self._on_change(interval, True)
