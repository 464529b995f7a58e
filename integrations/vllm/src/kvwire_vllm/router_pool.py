"""The router's view of its backends: which vLLM instances are up and how busy each is.

One :class:`Pool` per leg (prefill, decode). The router's request handlers call
:meth:`Pool.pick` and hold the returned :class:`Backend` for the leg (``with
pool.use(backend)``) so its in-flight count stays right; :meth:`Pool.check` (called by the
router's health loop, every ``interval`` seconds) marks each backend up or down from its
``GET /health``: down after ``misses`` failed probes in a row (a busy instance may answer one
probe late), up at the first passing one. A handler that cannot connect to a backend marks it
down at once (:meth:`Pool.mark_down`).

Lock contract: everything runs on the router's one asyncio event loop, so no lock is needed;
no method awaits between reading and updating a backend's state except :meth:`check`, which
only writes the ``healthy`` flag after its own probe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import aiohttp

logger = logging.getLogger(__name__)


@dataclass
class Backend:
    """One vLLM instance (``url`` is its base, e.g. ``http://10.0.0.2:8000``)."""

    url: str
    healthy: bool = True
    inflight: int = 0
    #: Why it was last marked down (shown by the router's /health).
    reason: str = ""
    #: Health probes failed in a row.
    misses: int = 0


class NoBackendError(Exception):
    """No backend of a leg is up."""


class Pool:
    """The backends of one leg, picked least-loaded (round-robin among equals)."""

    def __init__(self, leg: str, urls: list[str], misses: int = 2) -> None:
        if not urls:
            raise ValueError(f"no {leg} instance given")
        self.leg = leg
        self.misses = misses
        self.backends = [Backend(u.rstrip("/")) for u in urls]
        self._next = 0

    def pick(self, exclude: frozenset[str] = frozenset()) -> Backend:
        """The healthy backend with the fewest requests in flight, not in ``exclude``
        (called by a request handler before each leg). Raises :class:`NoBackendError`."""
        n = len(self.backends)
        order = [self.backends[(self._next + i) % n] for i in range(n)]
        up = [b for b in order if b.healthy and b.url not in exclude]
        if not up:
            raise NoBackendError(f"no {self.leg} instance is up")
        best = min(up, key=lambda b: b.inflight)
        self._next = (self.backends.index(best) + 1) % n
        return best

    @contextmanager
    def use(self, backend: Backend) -> Iterator[Backend]:
        """Count a request in flight on ``backend`` for the duration of the block."""
        backend.inflight += 1
        try:
            yield backend
        finally:
            backend.inflight -= 1

    def mark_down(self, backend: Backend, reason: str) -> None:
        """A request could not reach ``backend``: stop picking it until a health check passes."""
        if backend.healthy:
            logger.warning("%s instance %s is down: %s", self.leg, backend.url, reason)
        backend.healthy = False
        backend.reason = reason

    async def check(self, session: aiohttp.ClientSession, timeout: float) -> None:
        """Probe every backend's ``GET /health`` once (called by the router's health loop)."""

        async def probe(b: Backend) -> None:
            try:
                async with session.get(
                    f"{b.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)
                ) as resp:
                    ok, reason = resp.status == 200, f"/health answered {resp.status}"
            except (TimeoutError, aiohttp.ClientError) as exc:
                ok, reason = False, f"/health failed: {exc!r}"
            if ok:
                b.misses = 0
                if not b.healthy:
                    logger.info("%s instance %s is up", self.leg, b.url)
                    b.healthy, b.reason = True, ""
            else:
                b.misses += 1
                if b.misses >= self.misses:
                    self.mark_down(b, reason)

        await asyncio.gather(*(probe(b) for b in self.backends))

    def status(self) -> list[dict[str, object]]:
        """Each backend's state, for the router's ``GET /health``."""
        return [
            {"url": b.url, "healthy": b.healthy, "inflight": b.inflight, "reason": b.reason}
            for b in self.backends
        ]
