"""When a transfer worker first polls a write that no backend event announces.

A backend that does not push events (NIXL, Mooncake) is polled by the worker that posted the
write: after a write, the worker sleeps 20 µs, then twice as long each time nothing moved, up
to 200 µs (:mod:`kvwire.session.prefill.workers`). A 128 MiB staged block takes 0.4-1 ms over
NVLink, so that is six or more polls per block, each a call into the engine and, on the GPU
hosts, 15-30 µs of the worker's time on the process's one GIL (NIXL's ``check_xfer_state``
took 0.11-0.15 ms per 128 MiB request in the session 19 and 21 samples).

:class:`PollPace` learns how long a byte takes on this worker's writes (the fastest seen,
drifting back up slowly, so a fast outlier does not hold it) and tells the worker how long
the earliest write in flight cannot have ended yet (:data:`LEAD` of the expected time, at most
:data:`MAX_AHEAD_S`): the worker waits that long once, woken at once by a new job or a grant,
and then polls as before.
Owned by one :class:`~kvwire.session.prefill.pipeline.Pipeline` (its worker thread only: no
lock).
"""

from __future__ import annotations

from collections.abc import Iterable

#: The share of a write's expected time the worker waits before its first poll (below 1:
#: an estimate learnt from a slow write, e.g. the first one's lazy setup, falls by this
#: much per write until it meets the link).
LEAD = 0.7
#: The longest such wait (a poll at least this often, whatever was learnt).
MAX_AHEAD_S = 0.002
#: How much the learnt time per byte may grow per slower write (the link got slower).
DRIFT = 1.05
#: Writes shorter than this teach nothing (their time is the calls', not the bytes').
MIN_BYTES = 1 << 20


class PollPace:
    """Seconds per byte of this worker's unannounced writes, and the first poll they need."""

    def __init__(self) -> None:
        #: The learnt seconds per byte (None until a write of :data:`MIN_BYTES` ended).
        self.s_per_byte: float | None = None

    def ended(self, nbytes: int, seconds: float) -> None:
        """Worker thread: a write of ``nbytes`` that no event announced was seen done
        ``seconds`` after it was posted (late by the poll that saw it, so the fastest such
        write is the nearest to the link)."""
        if nbytes < MIN_BYTES or seconds <= 0:
            return
        per = seconds / nbytes
        cur = self.s_per_byte
        self.s_per_byte = per if cur is None or per < cur else min(per, cur * DRIFT)

    def ahead(self, writes: Iterable[tuple[float, int]], now: float) -> float:
        """Worker thread, idle with writes in flight (``(posted at, bytes)`` of each that no
        event announces, ``perf_counter`` times): how long the earliest cannot have ended yet
        (0: poll now, as without a pace)."""
        per = self.s_per_byte
        if per is None:
            return 0.0
        due = min((t + LEAD * n * per for t, n in writes if n >= MIN_BYTES), default=now)
        return min(MAX_AHEAD_S, max(0.0, due - now))
