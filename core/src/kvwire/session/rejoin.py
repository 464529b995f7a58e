"""Decode side: what this rank does when a prefill rank says it evicted it (protocol 1.9; the
prefill side is :mod:`kvwire.session.evictions`).

A prefill rank evicts a decode rank that was silent past the liveness bound (frozen, starved,
cut off) and fails the requests it held for it. When the decode rank speaks again, the prefill
rank answers instead of dropping its frames:

* :class:`~kvwire.control.wire.Evicted`: this rank drops its link to that prefill rank (it
  stops beating to it; its next request to it handshakes again). Requests already asked keep
  their sources: the ones the eviction failed arrive as failures (sent again), the ones whose
  request was dropped unread arrive as unheard failures, the others (complete before the
  eviction) still land.
* ``Failure(unheard=True)``: the request for that room was dropped unread. This rank
  handshakes again with that prefill rank (on a bootstrap thread) and repeats the request to
  it, once per (room, prefill rank); a second unheard answer fails the request naming it.

Lock contract: handlers run on the liveness thread and take ``mgr.lock`` only for room-table
reads and updates; the handshake runs on a bootstrap thread, never under a lock.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvwire.control.wire import Evicted, Failure
from kvwire.errors import KVWireError, TransferError

if TYPE_CHECKING:
    from kvwire.session.decode import DecodeSide, RecvRoom
    from kvwire.session.decode_links import PrefillLink

logger = logging.getLogger(__name__)


class Rejoin:
    """Decode: drops the links of prefill ranks that evicted this rank and repeats their
    unheard requests after a new handshake (see the module docstring)."""

    def __init__(self, side: DecodeSide) -> None:
        self.side = side
        self.mgr = side.mgr

    def on_evicted(self, msg: Evicted) -> None:
        """Liveness thread: prefill rank ``msg.session`` evicted this rank."""
        if msg.peer_session == self.mgr.session:
            self.unlink(msg.session, msg.reason)

    def unlink(self, session: str, why: str) -> None:
        """Liveness thread: forget prefill session ``session`` as a peer and drop its link
        (the next request handshakes again); its rooms keep their sources and its lookup
        stays cached. Nothing is failed here."""
        mgr = self.mgr
        peer = mgr.peers.pop(session)
        self.side.sources.unlink(session)
        if peer is not None:
            logger.warning(
                "%s: %s (%s) no longer counts this rank as a peer (%s): link dropped, the "
                "next request handshakes again",
                mgr.agent_name,
                peer.agent,
                session,
                why,
            )

    def on_unheard(self, msg: Failure) -> None:
        """Liveness thread: a source of ``msg.room`` dropped its request unread (it evicted
        this rank): handshake again and ask again, once."""
        side = self.side
        self.unlink(msg.session, msg.reason)
        with self.mgr.lock:
            room = side.rooms.get(msg.room)
            if room is None or side._terminal(room) or not room.requested or not room.sources:
                return
            old = next((s for s in room.sources if s.info.session == msg.session), None)
            if old is None:
                return  # not one of the room's sources
            if msg.session in room.asked_again:
                side._fail(
                    room,
                    TransferError(
                        f"prefill did not accept the request twice: {msg.reason}", room=room.room
                    ),
                    skip=msg.session,
                    cause="prefill_failed",
                )
                return
            room.asked_again.add(msg.session)
            room.last_progress = time.monotonic()
        logger.info(
            "%s: room %d: %s did not accept the request (it evicted this rank); handshaking "
            "again to repeat it",
            self.mgr.agent_name,
            msg.room,
            old.info.agent,
        )
        side.bootstraps.submit(self._ask_again, room, old)

    def _ask_again(self, room: RecvRoom, old: PrefillLink) -> None:
        """Bootstrap thread: handshake with ``old``'s prefill rank again, then repeat the
        room's request to it (unless the room ended meanwhile)."""
        side, mgr = self.side, self.mgr
        try:
            link = side.sources.handshake(old.info, mgr.options.handshake_timeout_s)
        except KVWireError as exc:
            with mgr.lock:
                side._fail(
                    room,
                    TransferError(
                        f"{old.info.agent} evicted this rank and the handshake to ask it "
                        f"again failed: {exc}",
                        room=room.room,
                    ),
                    cause="bootstrap",
                )
            return
        with mgr.lock:
            if side._terminal(room) or side.rooms.get(room.room) is not room:
                return
            assert room.sources is not None
            room.sources = [link if s is old else s for s in room.sources]
            room.last_progress = time.monotonic()
            mgr.tell(link.info.endpoint, side.request_message(room))
