"""Prefill's book of writes in flight, and every section of the room lock a transfer worker
takes (:class:`WriteBook`, the worker-facing side of
:class:`~kvwire.session.prefill.side.PrefillSide`).

A write is counted in flight per (request, decode session) from before it can touch decode's
pages until it is terminal: decode asks (``WritesQuery``) before it reuses a failed request's
pages, and is answered only once the count is zero. A worker's lean lane
(:mod:`kvwire.session.prefill.lane`) checks a turn's requests live and counts their writes in
one section (:meth:`WriteBook.start_turn`) and ends them, with their accounting and their
destinations' completion, in another (:meth:`WriteBook.end_turn`).

Lock contract: every method takes the room lock (``RoomTable.lock``, re-entrant) itself,
except ``count_locked``; ``inflight`` is read and changed only under it. Called by transfer
workers (any of them, concurrently) and, for ``inflight``, by the liveness thread's
``WritesQuery`` handling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvwire.session import metrics as m
from kvwire.session.context import RankContext
from kvwire.session.prefill.links import PoolLink
from kvwire.session.prefill.rooms import Dest, SendRoom
from kvwire.session.rooms import RoomTable

logger = logging.getLogger(__name__)

#: One lane write as it ends: its request, destination, accounting (None: it failed or was
#: handed to the general path) and the error it failed with (None: it did not fail).
Ended = tuple[SendRoom, Dest, m.ChunkDone | None, BaseException | None]


class WriteBook:
    """Writes in flight per (request, decode session), and the request bookkeeping a
    transfer worker does under the room lock. Built by the prefill side with its rank
    context, room table and failure routine (``fail_locked``: fails a room once and tells its
    destinations, under the lock); handed to every worker's pipeline as its
    :class:`~kvwire.session.prefill.posting.WorkerSide`."""

    def __init__(
        self,
        ctx: RankContext,
        rooms: RoomTable[SendRoom],
        sender_id: int,
        fail_locked: Callable[[SendRoom, BaseException], None],
    ) -> None:
        self.ctx = ctx
        self.rooms = rooms
        self.sender_id = sender_id
        self._fail_locked = fail_locked
        #: Writes posted and not ended, per (room, decode session); under the room lock.
        self.inflight: dict[tuple[int, str], int] = {}
        #: This rank's labelled metric children (a ``labels()`` lookup per chunk costs more).
        self._metrics = m.ChunkMetrics(ctx.labels)

    def _live(self, room: SendRoom) -> bool:
        """Under the lock: the request is neither terminal nor cleared."""
        return not self.rooms.terminal(room) and self.rooms.get(room.room) is room

    def is_dead(self, room: SendRoom) -> bool:
        """Worker thread: the request is terminal or was cleared (its work is skipped)."""
        with self.rooms.lock:
            return not self._live(room)

    def ended(self, room: SendRoom, dest: str, done: m.ChunkDone | None) -> bool:
        """Worker thread: a write of the request to ``dest`` is terminal. It is no longer in
        flight (:meth:`writes_posted`), ``done`` (when it moved bytes and succeeded) is
        accounted in the request's and the process's metrics, and the answer is whether the
        request is still live (not :meth:`is_dead`): one section of the room lock for the
        three, as a completion needs them together."""
        with self.rooms.lock:
            self.count_locked((room.room, dest), -1)
            if done is not None:
                room.metrics.add_transfer(done)
            live = self._live(room)
        if done is not None:
            self._metrics.observe(done)
        return live

    def writes_posted(self, room: int, dest: str, delta: int) -> None:
        """Worker thread: count writes in flight per (request, destination)."""
        with self.rooms.lock:
            self.count_locked((room, dest), delta)

    def count_locked(self, key: tuple[int, str], delta: int) -> None:
        """Under the room lock: writes in flight of (request, destination) ``key`` by
        ``delta`` (the entry goes at zero: nothing left behind per request)."""
        n = self.inflight.get(key, 0) + delta
        if n > 0:
            self.inflight[key] = n
        else:
            self.inflight.pop(key, None)

    def abandon(self, room: SendRoom, dest: Dest, target: PoolLink) -> None:
        """Worker thread: nothing more will be written to ``dest`` for this request."""
        target.strategy.on_abandoned(
            room.room, dest.session, dest.endpoint, self.sender_id, self.ctx.session
        )

    def fail(self, room: SendRoom, exc: BaseException) -> None:
        """Any thread: fail the request (once), tell its destinations."""
        with self.rooms.lock:
            self._fail_locked(room, exc)

    def dest_done(self, room: SendRoom, dest: Dest) -> None:
        """Worker thread: a destination has every chunk and its aux row."""
        with self.rooms.lock:
            self._dest_done_locked(room, dest)

    def _dest_done_locked(self, room: SendRoom, dest: Dest) -> None:
        dest.done = True
        every = room.ready and all(d.done for d in room.dests.values())
        if every and not self.rooms.terminal(room):
            self.rooms.succeed(room)

    # ------------------------------------------------------------ a lane's turn
    def start_turn(self, writes: Sequence[tuple[SendRoom, Dest]]) -> list[bool]:
        """Worker thread, before its lane launches a turn's writes: which requests are
        live, each live one's write counted in flight, in one section (a request failed
        after this is answered ``WritesDone`` only once its write ended)."""
        with self.rooms.lock:
            live = [self._live(room) for room, _ in writes]
            for (room, dest), ok in zip(writes, live, strict=True):
                if ok:
                    self.count_locked((room.room, dest.session), +1)
        return live

    def end_turn(self, writes: Sequence[Ended]) -> None:
        """Worker thread, once its lane's launched writes ended: each is no longer in
        flight; a successful one is accounted and its destination done (the request
        succeeds with its last destination), a failed one fails its request, one handed to
        the general path is left to it, in one section."""
        with self.rooms.lock:
            for room, dest, done, error in writes:
                self.count_locked((room.room, dest.session), -1)
                if error is not None:
                    self._fail_locked(room, error)
                    continue
                if done is None:
                    continue  # posted again on the general path, which counts it
                room.metrics.add_transfer(done)
                if self._live(room):
                    self._dest_done_locked(room, dest)
        for _, _, done, error in writes:
            if done is not None:
                self._metrics.observe(done)
            elif error is not None:
                m.chunk_failed(self.ctx.labels)
