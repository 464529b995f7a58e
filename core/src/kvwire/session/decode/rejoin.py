"""Decode side: what this rank does when a prefill rank says it evicted it (protocol 1.9; the
prefill side is :mod:`kvwire.session.prefill.evictions`).

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

Lock contract: handlers run on the liveness thread and take the room lock
(:class:`~kvwire.session.rooms.RoomTable`) only for room-table reads and updates; the
handshake runs on a bootstrap thread, never under a lock. Built by the decode side with what
it needs of it (the context, the room table, the source links, a way to run work on a
bootstrap thread, to fail a room and to build a room's request): it imports nothing of the
side.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvwire.control.wire import Evicted, Failure, TransferRequest
from kvwire.errors import KVWireError, TransferError
from kvwire.session.context import RankContext
from kvwire.session.decode.links import PrefillLink, SourceLinks
from kvwire.session.decode.rooms import RecvRoom
from kvwire.session.report import FailureCause
from kvwire.session.rooms import RoomTable

logger = logging.getLogger(__name__)


class FailRoom(Protocol):
    """The decode side's way to fail a room (under the room lock)."""

    def __call__(
        self,
        room: RecvRoom,
        exc: BaseException,
        skip: str | None = None,
        aborted: bool = False,
        cause: FailureCause = "protocol",
    ) -> None: ...


class Rejoin:
    """Decode: drops the links of prefill ranks that evicted this rank and repeats their
    unheard requests after a new handshake (see the module docstring)."""

    def __init__(
        self,
        ctx: RankContext,
        rooms: RoomTable[RecvRoom],
        sources: SourceLinks,
        submit: Callable[..., Any],
        fail: FailRoom,
        request_message: Callable[[RecvRoom], TransferRequest],
    ) -> None:
        self.ctx = ctx
        self.rooms = rooms
        self.sources = sources
        #: Runs a function on a bootstrap thread (the side's executor).
        self.submit = submit
        self.fail = fail
        self.request_message = request_message

    def on_evicted(self, msg: Evicted) -> None:
        """Liveness thread: prefill rank ``msg.session`` evicted this rank."""
        if msg.peer_session == self.ctx.session:
            self.unlink(msg.session, msg.reason)

    def unlink(self, session: str, why: str) -> None:
        """Liveness thread: forget prefill session ``session`` as a peer and drop its link
        (the next request handshakes again); its rooms keep their sources and its lookup
        stays cached. Nothing is failed here."""
        ctx = self.ctx
        peer = ctx.peers.pop(session)
        self.sources.unlink(session)
        if peer is not None:
            logger.warning(
                "%s: %s (%s) no longer counts this rank as a peer (%s): link dropped, the "
                "next request handshakes again",
                ctx.agent_name,
                peer.agent,
                session,
                why,
            )

    def on_unheard(self, msg: Failure) -> None:
        """Liveness thread: a source of ``msg.room`` dropped its request unread (it evicted
        this rank): handshake again and ask again, once."""
        self.unlink(msg.session, msg.reason)
        with self.rooms.lock:
            room = self.rooms.get(msg.room)
            if room is None or self.rooms.terminal(room) or not room.requested or not room.sources:
                return
            old = next((s for s in room.sources if s.info.session == msg.session), None)
            if old is None:
                return  # not one of the room's sources
            if msg.session in room.asked_again:
                self.fail(
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
            self.ctx.agent_name,
            msg.room,
            old.info.agent,
        )
        self.submit(self._ask_again, room, old)

    def _ask_again(self, room: RecvRoom, old: PrefillLink) -> None:
        """Bootstrap thread: handshake with ``old``'s prefill rank again, then repeat the
        room's request to it (unless the room ended meanwhile)."""
        ctx = self.ctx
        try:
            link = self.sources.handshake(old.info, ctx.options.handshake_timeout_s)
        except KVWireError as exc:
            with self.rooms.lock:
                self.fail(
                    room,
                    TransferError(
                        f"{old.info.agent} evicted this rank and the handshake to ask it "
                        f"again failed: {exc}",
                        room=room.room,
                    ),
                    cause="bootstrap",
                )
            return
        with self.rooms.lock:
            if self.rooms.terminal(room) or self.rooms.get(room.room) is not room:
                return
            assert room.sources is not None
            room.sources = [link if s is old else s for s in room.sources]
            room.last_progress = time.monotonic()
            ctx.tell(link.info.endpoint, self.request_message(room))
