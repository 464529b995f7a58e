"""The room table: one rank's live requests (rooms), their status, and the room lock.

:class:`RoomTable` owns the per-request records of one role (prefill's
:class:`~kvwire.session.prefill.rooms.SendRoom`, decode's
:class:`~kvwire.session.decode.rooms.RecvRoom`), the :class:`~kvwire.session.poll.StatusTable`
the engine polls, and :attr:`RoomTable.lock`, the lock every room record is guarded by. It is
built by the façade before the rank context (the staging strategies ask it for a room's pages)
and handed to the role's side.

Lock contract: :attr:`RoomTable.lock` (re-entrant) guards the room dict and every field of the
room records, and the side's own per-room tables (early requests, writes in flight, the
quarantine). It is held for table updates and queue puts only, never across an engine call or
a wait. Methods documented "under the lock" expect the caller to hold it; the others take it.
Other locks a holder may take afterwards: a peer table's, the status table's, a source
table's (decode); never the engine peers lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

from kvwire.errors import ConfigError
from kvwire.session import metrics as m
from kvwire.session.metrics import RequestMetrics
from kvwire.session.poll import KVPoll, StatusTable


class RoomState(Protocol):
    """What every per-request record has."""

    room: int
    t0: float
    error: BaseException | None
    metrics: RequestMetrics
    failed_at: float

    def pages_in(self, pool: str) -> Any:
        """Under the lock: the request's destination pages in ``pool`` on this rank (decode),
        or None."""


R = TypeVar("R", bound=RoomState)


class RoomTable(Generic[R]):
    """Live rooms of one rank, their status and their lock (see the module docstring)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.lock = threading.RLock()
        self.status = StatusTable()
        self._rooms: dict[int, R] = {}
        # the request series (kvwire.session.metrics.RoomCounts), made at first use:
        # ``labels`` is filled in by the manager after this table is built
        self._labels = labels
        self._counts: m.RoomCounts | None = None

    # ------------------------------------------------------------------ lookups
    def get(self, room_id: int) -> R | None:
        """Under the lock: the live record of ``room_id``, if any."""
        return self._rooms.get(room_id)

    def values(self) -> list[R]:
        """Under the lock: a snapshot of the live records."""
        return list(self._rooms.values())

    def __iter__(self) -> Iterator[R]:
        return iter(self.values())

    def __len__(self) -> int:
        return len(self._rooms)

    def __contains__(self, room_id: object) -> bool:
        return room_id in self._rooms

    def pages(self, room_id: int, pool: str) -> Any:
        """Any thread (staging strategies, through ``StagingContext.room_pages``): the
        destination pages of live request ``room_id`` in ``pool``, else None."""
        with self.lock:
            room = self._rooms.get(room_id)
            if room is None or self.terminal(room):
                return None
            return room.pages_in(pool)

    # --------------------------------------------------------------- lifecycle
    def create(self, room: R) -> R:
        """Under the lock, engine thread: register a new room as Bootstrapping."""
        rid = room.room
        if not 0 <= rid < 1 << 64:
            raise ConfigError(f"room id {rid} must be an unsigned 64-bit integer")
        if rid in self._rooms:
            raise ConfigError(f"room {rid} already has a request object here; clear() it first")
        self._rooms[rid] = room
        self.status.clear(rid)
        self.status.update(rid, KVPoll.Bootstrapping)
        self._metrics().active = len(self._rooms)
        return room

    def advance(self, room: R, status: KVPoll) -> None:
        """Under the lock: the room reached a non-terminal ``status`` (merged: never back)."""
        self.status.update(room.room, status)

    def terminal(self, room: R) -> bool:
        """Failed, succeeded, or already cleared."""
        return self.status.get(room.room, KVPoll.Failed) in (KVPoll.Failed, KVPoll.Success)

    def fail(self, room: R, exc: BaseException) -> bool:
        """Under the lock: record the first failure of a live room; False if it was already
        failed or succeeded (nothing more to do: the caller tells peers only on True)."""
        if room.error is not None or self.status.get(room.room, KVPoll.Failed) is KVPoll.Success:
            return False
        room.error = exc
        room.failed_at = time.monotonic()
        self.status.update(room.room, KVPoll.Failed)
        self._finish(room, KVPoll.Failed)
        return True

    def succeed(self, room: R) -> None:
        """Under the lock: the request is complete on this rank."""
        now = time.perf_counter()
        room.metrics.total_s = now - room.t0
        room.metrics.marks["success"] = now
        self.status.update(room.room, KVPoll.Success)
        self._finish(room, KVPoll.Success)

    def forget(self, room: R) -> bool:
        """Under the lock: drop a room (the engine cleared it); False if it was not there."""
        if self._rooms.get(room.room) is not room:
            return False
        del self._rooms[room.room]
        self.status.clear(room.room)
        self._metrics().active = len(self._rooms)
        return True

    def _finish(self, room: R, status: KVPoll) -> None:
        self._metrics().finished(status.name, time.perf_counter() - room.t0)

    def _metrics(self) -> m.RoomCounts:
        """Under the lock: this table's request series (plain numbers: no lock of their own,
        a handful of additions per request; :mod:`kvwire.session.metrics`)."""
        counts = self._counts
        if counts is None:
            counts = self._counts = m.RoomCounts(self._labels)
        return counts
