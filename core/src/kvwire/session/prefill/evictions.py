"""Prefill side: the decode sessions this rank evicted, so that a frame one sends afterwards is
answered, never silently dropped.

A decode rank evicted for silence (frozen, starved, or cut off past the liveness bound) is
usually alive; when it speaks again it still counts this rank as a peer. Its frames (a
heartbeat, a transfer request, a writes query) would otherwise be dropped as coming from an
unknown session, its requests failing only when its own liveness bound runs out and this
rank's share of them waiting for the bootstrap timeout. Instead (protocol 1.9):

* a transfer request is answered with ``Failure(unheard=True)`` naming the eviction (a 1.9
  decode rank handshakes again and repeats the request; an older one fails it at once);
* the first frame after the eviction, and then at most one per heartbeat interval, is also
  answered with :class:`~kvwire.control.wire.Evicted` (the decode rank drops its link, so its
  next request handshakes again), and the first one with the failures of the rooms the
  eviction failed here, sent again (those sent at the eviction were discarded with the
  socket).

A session that handshakes again is forgotten here (:meth:`EvictionBook.rejoined`). The book
keeps the last :data:`MAX_KEPT` evictions for silence (a session never heard of, or one whose
process is gone, is not answered: its frames are dropped, logged). It also holds the evicted
peers whose engine state is not released yet, so that a session handshaking again releases it
first and a late release cannot remove the new link's state (:meth:`take_release`).

Lock contract: guarded by the room lock (:class:`~kvwire.session.rooms.RoomTable`), held by
every caller.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from kvwire.control.wire import Evicted, Failure
from kvwire.session.context import RankContext
from kvwire.session.peers import Peer

logger = logging.getLogger(__name__)

#: Evictions remembered (oldest forgotten first).
MAX_KEPT = 256


@dataclass
class EvictedPeer:
    """One decode session this rank evicted."""

    agent: str
    endpoint: str
    why: str
    #: Rooms of that session the eviction failed here, with their errors (sent again once).
    failed: dict[int, str] = field(default_factory=dict)
    #: Rooms it had asked for before this rank created their senders: the eviction dropped
    #: those requests unread (answered once as unheard).
    unheard: list[int] = field(default_factory=list)
    #: When it was last told it was evicted (``time.monotonic()``); None: never.
    told_at: float | None = None


class EvictionBook:
    """Decode sessions this prefill rank evicted (see the module docstring)."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self._kept: OrderedDict[str, EvictedPeer] = OrderedDict()
        self._unreleased: dict[str, Peer] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def evicted(self, peer: Peer, why: str, failed: dict[int, str], unheard: list[int]) -> None:
        """Control thread (an eviction): remember ``peer``, the rooms the eviction failed and
        those whose early requests it dropped, when it was evicted for silence alone. One
        whose process is gone (its connection closed, it said goodbye or restarted) is not
        answered: frames it sent before dying may still be read, and an answer would open a
        socket to an endpoint where nothing listens."""
        self._kept.pop(peer.session, None)
        if peer.silent_loss:
            self._kept[peer.session] = EvictedPeer(
                peer.agent, peer.endpoint, why, dict(failed), list(unheard)
            )
            while len(self._kept) > MAX_KEPT:
                self._kept.popitem(last=False)
        self._unreleased[peer.session] = peer

    def endpoint(self, session: str) -> str | None:
        """The control endpoint of evicted session ``session``, or None."""
        entry = self._kept.get(session)
        return entry.endpoint if entry is not None else None

    def take_release(self, peer: Peer) -> bool:
        """Whether ``peer``'s engine state is still to be released (and by the caller, now):
        True once per eviction, whoever asks first (the deferred release, or a handshake of
        the same session)."""
        if self._unreleased.get(peer.session) is not peer:
            return False
        del self._unreleased[peer.session]
        return True

    def unreleased(self, session: str) -> Peer | None:
        """The evicted peer of ``session`` whose engine state is not released yet."""
        return self._unreleased.get(session)

    def rejoined(self, session: str) -> None:
        """Handshake thread, as the session becomes a peer again: forget its eviction."""
        self._kept.pop(session, None)

    def answer(self, session: str, room: int | None, now: float) -> bool:
        """Liveness thread: a frame from ``session``, which is not a peer. Tell it it was
        evicted (at most once per heartbeat interval, the failures of its rooms the first
        time) and, for a transfer request (``room``), that the request was not accepted.
        False when the session is not one this rank evicted (nothing to answer with)."""
        entry = self._kept.get(session)
        if entry is None:
            return False
        ctx = self.ctx
        mine = ctx.session
        interval = ctx.options.heartbeat_interval_s
        if entry.told_at is None or now - entry.told_at >= interval:
            first = entry.told_at is None
            entry.told_at = now
            logger.warning(
                "%s: %s (%s), evicted earlier (%s), is speaking again: told it so",
                ctx.agent_name,
                entry.agent,
                session,
                entry.why,
            )
            reason = f"prefill rank {ctx.agent_name} evicted this decode rank: {entry.why}"
            ctx.tell(entry.endpoint, Evicted(session=mine, peer_session=session, reason=reason))
            if first:
                for failed_room, error in entry.failed.items():
                    ctx.tell(entry.endpoint, Failure(room=failed_room, session=mine, reason=error))
                rooms = entry.unheard if room is None else [*entry.unheard, room]
                entry.failed.clear()
                entry.unheard = []
                room = None
                for r in dict.fromkeys(rooms):
                    self._unheard(entry, session, r)
        if room is not None:
            self._unheard(entry, session, room)
        return True

    def _unheard(self, entry: EvictedPeer, session: str, room: int) -> None:
        """Tell an evicted session its request for ``room`` was dropped unread."""
        ctx = self.ctx
        reason = (
            f"prefill rank {ctx.agent_name} did not accept the request: it evicted decode "
            f"rank {entry.agent} ({entry.why}) and does not count it as a peer; handshake "
            "again and repeat the request"
        )
        ctx.tell(
            entry.endpoint, Failure(room=room, session=ctx.session, reason=reason, unheard=True)
        )
