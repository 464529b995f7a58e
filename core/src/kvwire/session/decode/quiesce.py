"""Decode side: write quiescence of failed requests.

When a request fails, its destination pages may still be the target of writes its prefill
sources posted before they heard of the failure. The engine must not reuse those pages until
every source confirmed that none of its writes for the request is in flight (``WritesDone``,
asked for with ``WritesQuery`` until answered), or is gone. A cleared request waiting for that
stays here, in quarantine; a source that never answers is released after the transfer timeout
(every write has hit its deadline by then).

"Gone" means the source's process is known to have ended (its connection closed, it said
goodbye, it restarted). A source evicted for silence alone may be alive behind a network
partition, with its writes still queued in the network (and its own engine may have given
them up as failed while the bytes sit in a socket buffer): it does not count as quiet, even if
it confirms after it comes back, until the transfer timeout has passed since it was lost. A
late write from a partition that heals after that can still land: see docs/across-hosts.md.

Lock contract: no lock of its own; every method is called under the room lock (the decode
side's :class:`~kvwire.session.rooms.RoomTable`). What must be sent (the queries) is returned,
for the caller to send after it released the lock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvwire.session.decode.links import SourceLinks
from kvwire.session.decode.rooms import RecvRoom

logger = logging.getLogger(__name__)

#: How often decode asks the sources of a failed request whether their writes ended.
QUERY_RETRY_S = 0.1


class WriteQuarantine:
    """Failed requests whose sources may still write into their pages (see the module)."""

    def __init__(self, sources: SourceLinks, transfer_timeout_s: float, agent: str) -> None:
        self._sources = sources
        self._limit_s = transfer_timeout_s + QUERY_RETRY_S * 10
        self._agent = agent
        #: Cleared failed rooms still waiting for their sources' confirmation.
        self.rooms: dict[int, RecvRoom] = {}

    def quiet(self, room: RecvRoom) -> bool:
        """Every source of a failed room confirmed, or its process is gone (a source lost
        to silence is not: it may still be writing)."""
        assert room.sources is not None
        silent = self._sources.lost_silently
        return all(
            not silent(s.info.session)
            and (s.info.session in room.quiet or s.info.session not in self._sources)
            for s in room.sources
        )

    def confirmed(self, room: RecvRoom | None, room_id: int, session: str) -> None:
        """Liveness thread: ``session`` confirmed its writes for ``room_id`` ended (``room``:
        the live room, if any)."""
        held = room or self.rooms.get(room_id)
        if held is None:
            return
        held.quiet.add(session)
        if room_id in self.rooms and self.quiet(held):
            del self.rooms[room_id]

    def hold(self, room: RecvRoom) -> None:
        """Engine thread, on clear: keep a failed room whose sources did not all confirm."""
        held = room.error is not None and room.requested and room.sources is not None
        if held and not self.quiet(room):
            self.rooms[room.room] = room

    def due_queries(self, now: float, live: Iterable[RecvRoom]) -> list[tuple[str, int]]:
        """Progress thread: release quiet or expired rooms, and the (endpoint, room) queries
        due for failed rooms (live or held) whose sources have not all answered."""
        self._sources.expire_silent(now, self._limit_s)
        silent = self._sources.lost_silently
        for rid, room in list(self.rooms.items()):
            if self.quiet(room):
                del self.rooms[rid]
            elif now - room.failed_at > self._limit_s:
                logger.warning(
                    "%s: room %d: sources never confirmed their writes ended; releasing",
                    self._agent,
                    rid,
                )
                del self.rooms[rid]
        asks: list[tuple[str, int]] = []
        for room in [*live, *self.rooms.values()]:
            if room.error is None or not room.requested or room.sources is None:
                continue
            if now - room.queried_at < QUERY_RETRY_S:
                continue
            room.queried_at = now
            for src in room.sources:
                if src.info.session in room.quiet:
                    continue
                if src.info.session not in self._sources:
                    if not silent(src.info.session):  # its process is gone: nothing in flight
                        room.quiet.add(src.info.session)
                    continue  # lost to silence: asked again once it is back
                else:
                    asks.append((src.info.endpoint, room.room))
        return asks

    def quiesced(self, room: RecvRoom, live: bool, now: float) -> bool:
        """Engine thread: whether no source can still write into a failed room's pages
        (``live``: the room is still in the side's table)."""
        if self.quiet(room) or (not live and room.room not in self.rooms):
            return True
        return now - room.failed_at > self._limit_s  # every write has hit its deadline

    def __len__(self) -> int:
        return len(self.rooms)
