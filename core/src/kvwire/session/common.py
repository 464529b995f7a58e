"""What the prefill and decode sides share: room lifetimes, terminal checks, aborts, and the
per-request handle the engine holds (:class:`KVSender` and :class:`KVReceiver` derive from
:class:`RequestHandle`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from kvwire.errors import ConfigError, TransferError
from kvwire.session import metrics as m
from kvwire.session.metrics import RequestMetrics
from kvwire.session.poll import KVPoll

if TYPE_CHECKING:
    from kvwire.session.manager import KVManager

logger = logging.getLogger(__name__)


class RoomState(Protocol):
    """What every per-request state object has."""

    room: int
    t0: float
    error: BaseException | None
    metrics: RequestMetrics
    failed_at: float


R = TypeVar("R", bound=RoomState)


class Side(Generic[R]):
    """Room table of one role; subclasses add how a room is created, failed and freed."""

    def __init__(self, mgr: KVManager) -> None:
        self.mgr = mgr
        self.rooms: dict[int, R] = {}

    def not_for_role(self, msg: Any) -> None:
        """Liveness thread: a message kind the other role handles; dropped (a confused or
        hostile peer), counted at debug level."""
        logger.debug("%s: ignoring %s on %s", self.mgr.agent_name, msg.kind, self.mgr.role.value)

    def on_unsigned(self, msg: Any) -> None:
        """Liveness thread: a handshake message that lacked the MAC this side requires; only
        used to explain a failure. Default: nothing."""

    def on_stranger(self, session: str) -> None:
        """Liveness thread: a heartbeat from ``session``, which is not a peer here (prefill
        tells a decode rank it evicted so). Default: nothing."""

    def room_pages(self, room_id: int, pool: str) -> Any:
        """Any thread: the destination pages of live request ``room_id`` in ``pool`` on this
        rank (decode overrides it; prefill has none)."""
        return None

    def queued_chunks(self) -> int:
        """Chunks queued for transfer workers and not yet taken (prefill overrides it)."""
        return 0

    def awaiting_data(self) -> bool:
        """Whether a request here waits on data-plane notifications (the control thread then
        drains them more often). Decode overrides it."""
        return False

    def _add_room(self, room: R) -> R:
        """Under the lock, engine thread: register a new room as Bootstrapping."""
        rid = room.room
        if not 0 <= rid < 1 << 64:
            raise ConfigError(f"room id {rid} must be an unsigned 64-bit integer")
        if rid in self.rooms:
            raise ConfigError(f"room {rid} already has a request object here; clear() it first")
        self.rooms[rid] = room
        self.mgr.status.clear(rid)
        self.mgr.status.update(rid, KVPoll.Bootstrapping)
        m.ACTIVE_ROOMS.labels(**self.mgr.labels).set(len(self.rooms))
        return room

    def _terminal(self, room: R) -> bool:
        """Failed, succeeded, or already cleared."""
        return self.mgr.status.get(room.room, KVPoll.Failed) in (KVPoll.Failed, KVPoll.Success)

    def _mark_failed(self, room: R, exc: BaseException) -> bool:
        """Under the lock: record the first failure of a live room; False if it was already
        failed or succeeded (nothing more to do)."""
        if room.error is not None or self.mgr.status.get(room.room, KVPoll.Failed) is (
            KVPoll.Success
        ):
            return False
        room.error = exc
        room.failed_at = time.monotonic()
        self.mgr.status.update(room.room, KVPoll.Failed)
        self.mgr.finish(room.room, KVPoll.Failed, room.t0)
        return True

    def _fail(
        self, room: R, exc: BaseException, skip: str | None = None, aborted: bool = False
    ) -> None:
        raise NotImplementedError

    def succeed(self, room: R) -> None:
        """Under the lock: the request is complete on this rank."""
        now = time.perf_counter()
        room.metrics.total_s = now - room.t0
        room.metrics.marks["success"] = now
        self.mgr.status.update(room.room, KVPoll.Success)
        self.mgr.finish(room.room, KVPoll.Success, room.t0)

    def abort(self, room: R) -> None:
        """Engine thread: abort the request here and on every peer rank it involves."""
        with self.mgr.lock:
            if not self._terminal(room):
                err = TransferError(f"aborted by {self.mgr.role.value}", room=room.room)
                self._fail(room, err, aborted=True)

    def _fail_live(self, why: str) -> None:
        """Under the lock: fail every room not yet terminal (manager shutdown)."""
        for room in list(self.rooms.values()):
            if not self._terminal(room):
                self._fail(room, TransferError(why, room=room.room))

    def _forget(self, room: R) -> bool:
        """Under the lock: drop a room from the tables; False if it was not there."""
        if self.rooms.get(room.room) is not room:
            return False
        del self.rooms[room.room]
        self.mgr.status.clear(room.room)
        m.ACTIVE_ROOMS.labels(**self.mgr.labels).set(len(self.rooms))
        return True


class RequestHandle(Generic[R]):
    """The engine's handle on one request (one room) on one rank."""

    #: Status reported for a room this rank does not know (yet).
    unknown_status: ClassVar[KVPoll] = KVPoll.Failed

    def __init__(self, side: Any, room: int, state: R) -> None:
        self._side = side
        self.room = room
        self._state = state
        self._final: KVPoll | None = None

    def poll(self) -> KVPoll:
        """Status of the request on this rank (MIN-reduce across ranks with reduce_polls)."""
        if self._final is not None:
            return self._final
        status: KVPoll = self._side.mgr.status.get(self.room, self.unknown_status)
        return status

    def failure_exception(self) -> None:
        """Re-raise why the request failed here (the original exception); no-op otherwise."""
        if self.poll() is KVPoll.Failed:
            raise self._state.error or TransferError("request failed", room=self.room)

    @property
    def metrics(self) -> RequestMetrics:
        """What the request cost on this rank (bytes, descriptors, queue/post/transfer time)."""
        return self._state.metrics

    def abort(self) -> None:
        """Abort the request; the peer ranks involved learn of it."""
        self._side.abort(self._state)

    def clear(self) -> None:
        """Free every per-request entry on this rank. Call once the request is terminal."""
        if self._final is None:
            self._final = self.poll()
            self._side.clear(self._state)
