"""The timer slack of kvwire's own threads: short waits that end when they were asked to.

Linux lets a sleeping thread wake up to its *timer slack* late (50 µs by default), so the
kernel can serve several timers with one wake-up. kvwire's threads wait for short times on a
request's path: a prefill worker polls a write that no event announces (NIXL, Mooncake) after
20 µs, doubling to 200 µs; decode's progress thread waits 0.2 ms between polls of such a
backend's notifications. Measured on the 2-core development VM, 300 waits each
(``scripts/timer_slack_probe.py``): ``time.sleep(20 µs)`` took 133 µs at the default slack
and 61 µs at 1 µs; a 0.2 ms ``Event.wait`` 324 against 253 µs (docs/benchmarks.md, "Timer
slack").

:func:`set_thread_slack` sets the calling thread's slack (``prctl(PR_SET_TIMERSLACK)``: it
is per thread, and a thread's new threads start with its value). The liveness, progress and
worker threads of a rank whose backend is polled call it first with
``ControlOptions.timer_slack_us`` (``RankContext.timer_slack_us``: None, the default slack,
where the backend pushes events); the engine's threads keep theirs. Elsewhere than Linux,
or where ``prctl`` cannot be found, it does nothing. Any thread; it acts on the calling one
only.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

from kvwire.held_io import libc_function

logger = logging.getLogger(__name__)

__all__ = ["get_thread_slack_ns", "set_thread_slack"]

_PR_SET_TIMERSLACK = 29
_PR_GET_TIMERSLACK = 30
_ARGS = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    return libc_function("prctl", _ARGS, ctypes.c_int)


def set_thread_slack(us: float | None) -> bool:
    """Set the calling thread's timer slack to ``us`` microseconds (None: leave it). True
    when it was set. Called at the start of kvwire's own threads (liveness, progress,
    transfer workers), on that thread."""
    if us is None:
        return False
    prctl = _prctl()
    if prctl is None:
        return False
    ns = max(1, round(us * 1000))
    ok = bool(prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0) == 0)
    if not ok:
        logger.debug("timer slack %d ns refused (errno %d)", ns, ctypes.get_errno())
    return ok


def get_thread_slack_ns() -> int | None:
    """The calling thread's timer slack in nanoseconds, None where it cannot be read
    (tests and diagnostics)."""
    prctl = _prctl()
    if prctl is None:
        return None
    value = int(prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0))
    return value if value >= 0 else None
