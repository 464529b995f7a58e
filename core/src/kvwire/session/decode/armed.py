"""Decode's checksum checks armed while a request's KV is on its way (issue 26 item 1).

When a request's transfer request went out to sources that send checksums, decode's progress
thread arms, per source link, the check of a chunk that lands on every destination page of
the request (:meth:`LandedSums.arm <kvwire.session.checksums.LandedSums.arm>`: on a GPU, the
sums enqueued behind a flag, :mod:`kvwire.integrity_armed`; nothing on host memory). The
source's first whole chunk takes it (:meth:`RecvRoom.chunk_check
<kvwire.session.decode.rooms.RecvRoom.chunk_check>`): a chunk of exactly those pages releases
it and waits for its sums, with no launch between the note and ``Success``; any other chunk
drops it and is checked as before. A room that fails or is cleared drops what is left.

Lock contract: :func:`arm_checks` runs on the progress thread (a chore, before the step that
drains notes: a note of the request cannot be handled before it), arms with no lock held and
keeps an armed check only for a room still waiting, under the room lock, for a source none
of whose notes was counted yet; otherwise it drops it at once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from kvwire.session.decode.rooms import RecvRoom
from kvwire.session.rooms import RoomTable


def arm_later(
    later: Callable[[Callable[[], None]], None], rooms: RoomTable[RecvRoom], room: RecvRoom
) -> None:
    """Under the room lock, when ``room``'s transfer request went out (``later``: the rank
    context's, which runs a chore on the progress thread): queue :func:`arm_checks` when a
    source of its KV pool sends checksums."""
    if room.pool != "kv" or room.dst_pages is None or room.sources is None:
        return
    if any(s.checksums is not None for s in room.sources):
        pages = room.dst_pages
        later(lambda: arm_checks(rooms, room.room, pages))


def arm_checks(rooms: RoomTable[RecvRoom], room_id: int, pages: NDArray[np.int64]) -> None:
    """Progress thread: arm each checked source's check of the whole request (see the
    module docstring)."""
    with rooms.lock:
        room = rooms.get(room_id)
        if room is None or room.dst_pages is not pages or rooms.terminal(room):
            return
        links = [
            s
            for s in room.sources or ()
            if s.checksums is not None
            and (s.info.session, s.sender_id) not in room.armed
            and not room.noted_from(s.sender_id)
        ]
    made = [(s, s.checksums.arm(pages)) for s in links if s.checksums is not None]
    with rooms.lock:
        live = rooms.get(room_id) is room and not rooms.terminal(room)
        for s, armed in made:
            if armed is None:
                continue
            key = (s.info.session, s.sender_id)
            if live and key not in room.armed and not room.noted_from(s.sender_id):
                room.armed[key] = armed
            else:
                armed.drop()
