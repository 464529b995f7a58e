"""Replay protection of signed control messages: a freshness stamp per frame and a bounded
sliding window of sequence numbers per sender.

With a shared secret, every frame carries ``[origin, seq, sent_at, to]`` under its MAC:

* ``origin``: 8 random bytes per :class:`~kvwire.control.wire.Codec` (per process incarnation);
* ``seq``: that codec's message counter (every frame it encodes has a new one);
* ``sent_at``: the sender's wall clock (seconds);
* ``to``: the endpoint the frame was sent to (``""`` for data-plane notification payloads).

A receiver (:class:`ReplayGuard`) accepts a frame only if it is addressed to it, ``sent_at`` is
within :data:`MAX_AGE_S` of its own clock, and ``seq`` was not seen before from that origin:
it keeps, per origin, the highest ``seq`` and a bitmap of the :data:`SEQ_WINDOW` before it (the
IPsec anti-replay window). A frame older than the window is refused as stale.

Memory is bounded: an origin's state is dropped once its newest frame is older than
:data:`MAX_AGE_S` (any replay of its frames is then refused by the clock check), and at most
:data:`MAX_ORIGINS` origins are kept (the least recently heard is dropped first). Cost per
frame: a dict lookup, a few integer operations, one uncontended lock.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from kvwire.errors import ProtocolError

#: A frame whose stamp is further than this from the receiver's clock is refused (the same
#: allowance as the bootstrap service's signed requests; clocks must be NTP-synchronised).
MAX_AGE_S = 300.0
#: Frames of one origin that may arrive out of order (sends from several threads interleave).
SEQ_WINDOW = 1024
#: Origins (peer processes) remembered at once.
MAX_ORIGINS = 4096
#: How often expired origins are swept out (seconds).
SWEEP_PERIOD_S = 10.0

_FULL = (1 << SEQ_WINDOW) - 1


class FreshnessError(ProtocolError):
    """A signed frame that is authentic but not fresh: ``reason`` is ``"replayed"`` (its
    sequence number was seen) or ``"stale"`` (too old, no stamp, or addressed elsewhere)."""

    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason = reason


class _Window:
    __slots__ = ("last_ts", "mask", "top")

    def __init__(self, seq: int, ts: float) -> None:
        self.top = seq
        self.mask = 1
        self.last_ts = ts


class ReplayGuard:
    """Per-origin sequence windows of one receiver. :meth:`check` is called by whoever decodes
    frames (the liveness thread); thread-safe."""

    def __init__(
        self,
        max_age_s: float = MAX_AGE_S,
        max_origins: int = MAX_ORIGINS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_age_s = max_age_s
        self.max_origins = max_origins
        self.clock = clock
        self._origins: dict[bytes, _Window] = {}
        self._lock = threading.Lock()
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self._origins)

    def check(self, origin: bytes, seq: int, ts: float) -> None:
        """Accept (and remember) frame ``seq`` of ``origin`` stamped ``ts``, or raise
        :class:`FreshnessError`. Call only after the frame's MAC was verified."""
        now = self.clock()
        if not math.isfinite(ts) or abs(now - ts) > self.max_age_s:
            raise FreshnessError(
                "stale",
                f"stale control message: stamped {now - ts:.1f} s from this rank's clock "
                f"(more than {self.max_age_s:.0f} s: a replay, or clocks out of sync; run NTP)",
            )
        with self._lock:
            if now >= self._next_sweep:
                self._sweep(now)
            w = self._origins.get(origin)
            if w is None:
                if len(self._origins) >= self.max_origins:
                    oldest = min(self._origins, key=lambda o: self._origins[o].last_ts)
                    del self._origins[oldest]
                self._origins[origin] = _Window(seq, ts)
                return
            if seq > w.top:
                shift = seq - w.top
                w.mask = ((w.mask << shift) | 1) & _FULL if shift < SEQ_WINDOW else 1
                w.top = seq
            else:
                back = w.top - seq
                if back >= SEQ_WINDOW:
                    raise FreshnessError(
                        "stale",
                        f"stale control message: {back} messages older than the newest from "
                        f"its sender (window {SEQ_WINDOW})",
                    )
                bit = 1 << back
                if w.mask & bit:
                    raise FreshnessError(
                        "replayed", "replayed control message (its sequence number was seen)"
                    )
                w.mask |= bit
            if ts > w.last_ts:
                w.last_ts = ts

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + SWEEP_PERIOD_S
        limit = now - self.max_age_s
        for origin in [o for o, w in self._origins.items() if w.last_ts < limit]:
            del self._origins[origin]
