"""When a transfer worker first polls a write that no backend event announces, and how an
idle worker waits (:func:`idle`).

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

import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvwire.session.layers import LayerGate
    from kvwire.session.prefill.posting import Posted

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
#: An idle worker polls pending CUDA events of layer-wise chunks this often.
GATE_EVENT_POLL_S = 0.0005
#: ...and otherwise wakes on a mark, or after this long (to check deadlines).
GATE_IDLE_S = 0.05
#: With a backend that pushes events, a worker whose posted writes are all the backend's
#: waits for a completion (or a new job) this long at most before polling again.
EVENT_IDLE_S = 0.005
#: A worker with nothing in flight whose chunks wait for staging space sleeps until the
#: strategy wakes it (``StagingContext.wake_fn``: a grant or a watermark came), this long at
#: most (a strategy's retries and deadlines run in its ``plan``).
STAGING_IDLE_S = 0.001


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


def idle(
    posted: Sequence[Posted],
    gates: list[LayerGate | None],
    wake: threading.Event,
    pace: PollPace,
    sleep_s: float,
    announced: bool = False,
) -> None:
    """Worker thread, when its pipeline's poll moved nothing (``posted``: its writes in
    flight; ``gates``: the layer gate of each destination's first waiting job, None for a
    whole chunk; ``wake``: its pipeline's wake-up): sleep ``sleep_s``; or, when all that
    waits is layer-wise chunks whose layers are not computed (nothing in flight), until the
    engine marks a layer (:meth:`LayerGate.watch`), polling pending CUDA events every
    :data:`GATE_EVENT_POLL_S`. Keeps an idle worker from taking the GIL thousands of times a
    second while the engine thread launches the forward pass.

    While every write in flight is the backend's and will be announced (its handle
    ``pushes``: a backend that pushes events, or a backend list's member that does; no copy
    the strategy runs, no job waiting for staging space) the worker sleeps until one of them
    ends or a job comes (``wake``, set by the backend and by the pipeline's ``notify``),
    :data:`EVENT_IDLE_S` at most: no polling timer between a write's completion and its next
    step. Writes that no event announces are first polled once the earliest could have ended
    (``pace``; a job or a grant wakes the wait). ``wake`` is cleared after the wait and the
    caller polls next, so a wake-up that comes in between is not lost. ``announced``: a
    lean lane's writes are in flight too (their launch wakes the worker when it ends)."""
    pushed = all(p.copy is None and p.handle.pushes for p in posted)
    if (posted or announced) and not gates and pushed:
        wake.wait(EVENT_IDLE_S)
        wake.clear()
        return
    if not posted and gates and all(g is None for g in gates):
        # every waiting chunk waits for its strategy (staging space): woken by its grant
        wake.wait(STAGING_IDLE_S)
        wake.clear()
        return
    if posted or not gates or any(g is None for g in gates):
        unannounced = [(p.t_posted, p.handle.num_bytes) for p in posted
                       if p.copy is None and not p.handle.pushes]  # fmt: skip
        ahead = pace.ahead(unannounced, time.perf_counter())
        if ahead <= sleep_s:
            time.sleep(sleep_s)
            return
        wake.wait(ahead)  # no write can have ended yet; a job or a grant wakes it
        wake.clear()
        return
    events = [g.watch(wake) for g in gates if g is not None]
    wake.wait(GATE_EVENT_POLL_S if any(events) else GATE_IDLE_S)
    wake.clear()  # the caller's next progress() reads the gates afresh
