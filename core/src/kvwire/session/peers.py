"""The peers one manager talks to, and their liveness.

A :class:`Peer` is a remote manager this one completed a handshake with (decode ranks on a
prefill rank, prefill ranks on a decode rank), known by its *session* (a random id per manager
incarnation) and its *agent* name.

Lock contract: :class:`PeerTable` has its own plain lock, held only for dictionary operations
(never across a send, an engine call or a callback), so the liveness thread can always record
a sign of life or find the dead, whatever the workers and the engine are doing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Peer:
    """A remote manager this one talks to."""

    session: str
    agent: str
    endpoint: str
    last_seen: float
    #: Role-specific link state (prepared tables on prefill, sender id on decode).
    link: Any = field(default=None, repr=False)
    #: Set when the peer was evicted for silence (no heartbeat), not because its process is
    #: known to be gone: it may be alive behind a partition, its writes still on the way.
    silent_loss: bool = False
    #: When it was last heard (a message or notification arrived), never moved by
    #: :meth:`PeerTable.defer`: evidence that it is alive, where ``last_seen`` is the clock
    #: its silence is judged by. Defaults to ``last_seen``.
    heard: float = -1.0

    def __post_init__(self) -> None:
        if self.heard < 0:
            self.heard = self.last_seen


class PeerTable:
    """Peers by session; thread-safe (see the module docstring for the lock contract)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}

    def add(self, peer: Peer) -> None:
        """Start tracking a peer (after a successful handshake). Any thread."""
        with self._lock:
            self._peers[peer.session] = peer

    def get(self, session: str) -> Peer | None:
        """The peer of ``session``, or None. Any thread."""
        with self._lock:
            return self._peers.get(session)

    def pop(self, session: str) -> Peer | None:
        """Forget a peer; the one removed, or None if it was not there. Any thread."""
        with self._lock:
            return self._peers.pop(session, None)

    def touch(self, session: str, now: float | None = None) -> None:
        """Record a sign of life (any authenticated message, any notification)."""
        with self._lock:
            p = self._peers.get(session)
            if p is not None:
                p.last_seen = p.heard = time.monotonic() if now is None else now

    def defer(self, gap_s: float, now: float) -> None:
        """Move every peer's last sign of life ``gap_s`` later (not past ``now``): this side
        did not listen for that long (liveness thread)."""
        with self._lock:
            for p in self._peers.values():
                p.last_seen = min(now, p.last_seen + gap_s)

    def by_agent(self, agent: str) -> list[Peer]:
        """Peers known under agent name ``agent`` (a restart, or a name collision)."""
        with self._lock:
            return [p for p in self._peers.values() if p.agent == agent]

    def by_endpoint(self, endpoint: str) -> list[Peer]:
        """Peers reached at ``endpoint``."""
        with self._lock:
            return [p for p in self._peers.values() if p.endpoint == endpoint]

    def silent(self, now: float, limit_s: float) -> list[Peer]:
        """Peers with no sign of life for more than ``limit_s``."""
        with self._lock:
            return [p for p in self._peers.values() if now - p.last_seen > limit_s]

    def snapshot(self) -> list[Peer]:
        """The peers now (a copy to iterate without the lock)."""
        with self._lock:
            return list(self._peers.values())

    def __contains__(self, session: object) -> bool:
        with self._lock:
            return session in self._peers

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)

    def __iter__(self) -> Iterator[Peer]:
        return iter(self.snapshot())
