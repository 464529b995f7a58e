"""Decode: the aux row of a request arrived, as a transfer of its own (``what="aux"``) or
carried in the last chunk's note (``ChunkNote.aux``, protocol 1.11; see
:mod:`kvwire.session.aux_note`). Progress thread (or the liveness thread for a copy's note),
under the room lock."""

from __future__ import annotations

from kvwire.control.wire import ChunkNote
from kvwire.errors import TransferError
from kvwire.session.aux_note import write_row
from kvwire.session.context import RankContext
from kvwire.session.decode.rooms import RecvRoom


def take_aux(ctx: RankContext, room: RecvRoom, msg: ChunkNote) -> TransferError | None:
    """Check (and for a carried row, write) the aux row ``msg`` brings; the error that fails
    the request, or None when the aux row is in place: it comes from the room's aux sender
    and its slot carries the room's stamp."""
    if room.aux_sender != msg.sender_id:
        return TransferError(
            f"aux row written by sender {msg.sender_id}, expected {room.aux_sender}",
            room=room.room,
        )
    if msg.aux is not None:
        problem = write_row(ctx.aux_regions, room.aux_index, msg.aux)
        if problem is not None:
            return TransferError(f"aux row carried in a note: {problem}", room=room.room)
    stamp = int(ctx.stamps[room.aux_index, 0])
    if stamp != room.room:
        return TransferError(
            f"aux row {room.aux_index} carries room stamp {stamp}, not {room.room} "
            "(aux row reused while a transfer was in flight?)",
            room=room.room,
        )
    return None
