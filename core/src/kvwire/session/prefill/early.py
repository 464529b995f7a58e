"""Prefill side: what arrives for a request before (or after) its sender exists.

* Early requests: a decode rank's transfer request for a room the engine has not created a
  sender for yet; picked up when it does.
* Early failures: a decode rank failed a room before prefill knew it (bad pages, a refused
  handshake); the sender fails as soon as it is created.
* Recent failures: rooms that failed here and were cleared; a decode rank whose request
  arrives late is answered with the failure instead of waiting for its deadline.

Every entry expires after ``limit_s`` (the bootstrap timeout), and the failure tables are
bounded (a flood of failures for unknown rooms cannot grow memory).

Unknown rooms: by default a request for a room with no sender is kept as an early request
(in SGLang's flow decode may ask before prefill has even scheduled the request). An engine
that knows which rooms it will still create gives the manager a :class:`RoomIssuer`; a
request for a room it says will never exist here is answered with a failure at once. In
vLLM's push flow, for instance, prefill picks the room when the request finishes and hands
it to decode only after that, so a room the issuer has not issued (another instance's, or
one already served) is unknown for good; one issued but whose sender the worker has not
created yet (a step later) is still an early request. See docs/control-plane.md.

Lock contract: no lock of its own; every method is called under the prefill side's
the room lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

#: Failures kept at most per table.
MAX_EARLY_FAILURES = 65536

D = TypeVar("D")


class RoomIssuer(Protocol):
    """Engine-provided (prefill): which rooms this rank will still create senders for.

    Both methods are called by the prefill side under the room lock; they must be quick and
    must not call back into the manager.
    """

    def created(self, room: int) -> None:
        """Engine thread: the engine created the sender of ``room`` (``mgr.sender``)."""

    def never(self, room: int) -> str | None:
        """Liveness or engine thread: why no sender for ``room`` (which has none here now)
        will ever be created on this rank, or None when one may still be (the decode
        request is then kept as an early request)."""


class EarlyBook(Generic[D]):
    """Early requests (destinations ``D`` by room and decode session) and failures."""

    def __init__(self, limit_s: float, max_failures: int = MAX_EARLY_FAILURES) -> None:
        self.limit_s = limit_s
        self.max_failures = max_failures
        #: room -> decode session -> (destination, arrival time).
        self.requests: dict[int, dict[str, tuple[D, float]]] = {}
        #: room -> (reason, time), for rooms with no sender yet / failed and cleared here.
        self.failures: dict[int, tuple[str, float]] = {}
        self.recent: dict[int, tuple[str, float]] = {}

    def add_request(self, room: int, session: str, dest: D, now: float) -> None:
        self.requests.setdefault(room, {})[session] = (dest, now)

    def drop_request(self, room: int, session: str) -> None:
        by = self.requests.get(room)
        if by is not None:
            by.pop(session, None)
            if not by:
                del self.requests[room]

    def drop_session(self, session: str) -> None:
        """A decode rank is gone: its early requests go with it."""
        for room in list(self.requests):
            self.drop_request(room, session)

    def drop_room(self, room: int) -> None:
        self.requests.pop(room, None)

    def add_failure(self, room: int, reason: str, now: float) -> None:
        """Decode failed ``room`` before its sender exists (kept while there is room)."""
        if len(self.failures) < self.max_failures:
            self.failures[room] = (reason, now)

    def remember_failed(self, room: int, reason: str, now: float) -> None:
        """``room`` failed here and was cleared: answer late requests with ``reason``."""
        if len(self.recent) < self.max_failures:
            self.recent[room] = (reason, now)

    def failed_recently(self, room: int) -> str | None:
        hit = self.recent.get(room)
        return hit[0] if hit is not None else None

    def take(self, room: int) -> tuple[str | None, Iterator[tuple[str, D]]]:
        """The sender of ``room`` was created: its early failure (if any) and early requests
        (decode session, destination), both removed from the book."""
        failure = self.failures.pop(room, None)
        requests = self.requests.pop(room, {})
        return (
            failure[0] if failure is not None else None,
            ((s, dest) for s, (dest, _t) in requests.items()),
        )

    def expire(self, now: float) -> None:
        """Drop every entry older than ``limit_s``."""
        for room, by_session in list(self.requests.items()):
            for s, (_dest, t) in list(by_session.items()):
                if now - t > self.limit_s:
                    self.drop_request(room, s)
        for table in (self.failures, self.recent):
            for room, (_reason, t) in list(table.items()):
                if now - t > self.limit_s:
                    del table[room]

    def refuse(self, never: RoomIssuer) -> list[tuple[int, str, D, str]]:
        """Remove early requests for rooms ``never`` now says will not exist; returns
        ``(room, decode session, destination, why)`` for the caller to answer."""
        out: list[tuple[int, str, D, str]] = []
        for room in list(self.requests):
            why = never.never(room)
            if why is not None:
                for s, (dest, _t) in self.requests.pop(room).items():
                    out.append((room, s, dest, why))
        return out

    def __len__(self) -> int:
        """Rooms with early requests (the leak check's ``early_requests``)."""
        return len(self.requests)
