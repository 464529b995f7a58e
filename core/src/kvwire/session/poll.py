"""Request status: the ordered :class:`KVPoll` and the per-room status table.

Engines all-reduce a request's status with MIN across the ranks of a group, so the order
matters: one rank's failure fails the group, and success needs every rank.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable


class KVPoll(enum.IntEnum):
    """Status of one request on one rank, ordered for MIN-reduction."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def merge_status(old: KVPoll, new: KVPoll) -> KVPoll:
    """Monotone update: take the max, except that Failed overwrites and then sticks."""
    if old is KVPoll.Failed or new is KVPoll.Failed:
        return KVPoll.Failed
    return max(old, new)


def reduce_polls(polls: Iterable[KVPoll | int]) -> KVPoll:
    """The group status of a request from its ranks' polls (MIN); an engine calls this after
    gathering every rank's :meth:`poll`, or all-reduces the integer values with MIN itself."""
    values = [KVPoll(int(p)) for p in polls]
    if not values:
        raise ValueError("reduce_polls needs at least one status")
    return min(values)


class StatusTable:
    """Status of every live room on one manager; thread-safe.

    Rules: an update for an unknown room inserts it unless it is Failed (a late failure must not
    resurrect a cleared room; room ids are random and may be reused); updates are merged with
    :func:`merge_status`; :meth:`clear` forgets the room.
    """

    def __init__(self) -> None:
        self._status: dict[int, KVPoll] = {}
        self._lock = threading.Lock()

    def update(self, room: int, status: KVPoll) -> KVPoll | None:
        """Apply an update; returns the new status, or None if the room is unknown and the
        update was a failure (ignored)."""
        with self._lock:
            old = self._status.get(room)
            if old is None:
                if status is KVPoll.Failed:
                    return None
                self._status[room] = status
                return status
            new = merge_status(old, status)
            self._status[room] = new
            return new

    def get(self, room: int, default: KVPoll) -> KVPoll:
        """Current status of ``room``, or ``default`` when unknown."""
        with self._lock:
            return self._status.get(room, default)

    def clear(self, room: int) -> None:
        """Forget a room (its terminal path is done)."""
        with self._lock:
            self._status.pop(room, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._status)
