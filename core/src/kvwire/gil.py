"""The interpreter's GIL switch interval, which kvwire may lower for the process it runs in.

kvwire's threads (control, progress, transfer workers, a backend's I/O thread) live in the
engine's process and share its GIL. A thread that waited outside the GIL (a socket, a lock, a
CUDA call) and wants it back while the engine's thread runs Python waits until the interpreter
asks that thread to let go, which it does every *switch interval* (``sys.setswitchinterval``,
5 ms by default). A request's path crosses several such waits on each side, so behind an engine
loop that never sleeps a 2 MiB request took over 100 ms at 0.5 ms and its handshake did not
complete at all at 5 ms (docs/benchmarks.md, "A busy engine thread"). The interval is
process-wide: :func:`apply_switch_interval` only ever lowers it, once per manager, and says so
in the log.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

__all__ = ["apply_switch_interval"]


def apply_switch_interval(interval_us: float | None, agent_name: str) -> float:
    """Engine thread, when a manager is built: lower the interpreter's switch interval to
    ``interval_us`` microseconds if it is longer (an engine that chose a shorter one keeps
    it; None leaves it alone). Returns the interval in force, in seconds."""
    current = sys.getswitchinterval()
    if interval_us is None or current <= interval_us / 1e6:
        return current
    sys.setswitchinterval(interval_us / 1e6)
    logger.info(
        "%s: GIL switch interval %.3f ms -> %.3f ms, so kvwire's threads run within that long "
        "of wanting to while the engine's thread runs Python (control.gil_switch_interval_us; "
        "null leaves the interpreter's setting alone)",
        agent_name,
        current * 1e3,
        interval_us / 1e3,
    )
    return sys.getswitchinterval()
