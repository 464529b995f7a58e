"""What the prefill and decode sides share: room lifetimes, terminal checks, aborts, and the
per-request handle the engine holds (:class:`KVSender` and :class:`KVReceiver` derive from
:class:`RequestHandle`)."""

from __future__ import annotations

import logging
import operator
from typing import Any, ClassVar, Generic

from kvwire.errors import ConfigError, TransferError
from kvwire.session.context import RankContext
from kvwire.session.metrics import RequestMetrics
from kvwire.session.poll import KVPoll
from kvwire.session.rooms import R, RoomTable

logger = logging.getLogger(__name__)


class Side(Generic[R]):
    """What both roles' sides share: the rank context, the room table, and aborts.

    Built by the façade with the :class:`~kvwire.session.context.RankContext` and the
    :class:`~kvwire.session.rooms.RoomTable` of its role; subclasses add how a room is
    created, failed and freed."""

    def __init__(self, ctx: RankContext, rooms: RoomTable[R]) -> None:
        self.ctx = ctx
        self.rooms = rooms

    def not_for_role(self, msg: Any) -> None:
        """Liveness thread: a message kind the other role handles; dropped (a confused or
        hostile peer), counted at debug level."""
        logger.debug("%s: ignoring %s on %s", self.ctx.agent_name, msg.kind, self.ctx.role.value)

    def on_unsigned(self, msg: Any) -> None:
        """Liveness thread: a handshake message that lacked the MAC this side requires; only
        used to explain a failure. Default: nothing."""

    def on_stranger(self, session: str) -> None:
        """Liveness thread: a heartbeat from ``session``, which is not a peer here (prefill
        tells a decode rank it evicted so). Default: nothing."""

    def queued_chunks(self) -> int:
        """Chunks queued for transfer workers and not yet taken (prefill overrides it)."""
        return 0

    def notifications_drained(self) -> None:
        """Progress thread, after handing a drain of data-plane notifications to
        ``on_notification`` one by one (even when one of them raised), no lock held: work
        the drain left for the end (decode runs the checksum checks the notes completed,
        a batch's launches first). Default: nothing."""

    def awaiting_data(self) -> bool:
        """Whether a request here waits on data-plane notifications (the control thread then
        drains them more often). Decode overrides it."""
        return False

    def _fail(
        self, room: R, exc: BaseException, skip: str | None = None, aborted: bool = False
    ) -> None:
        raise NotImplementedError

    def abort(self, room: R) -> None:
        """Engine thread: abort the request here and on every peer rank it involves."""
        with self.rooms.lock:
            if not self.rooms.terminal(room):
                err = TransferError(f"aborted by {self.ctx.role.value}", room=room.room)
                self._fail(room, err, aborted=True)

    def _fail_live(self, why: str) -> None:
        """Under the lock: fail every room not yet terminal (manager shutdown)."""
        for room in self.rooms.values():
            if not self.rooms.terminal(room):
                self._fail(room, TransferError(why, room=room.room))


def room_id(room: object) -> int:
    """Engine thread, creating a request's handle: the engine's room id as a plain ``int``
    (a NumPy integer is taken; a room travels in notes and messages as it is);
    :class:`~kvwire.errors.ConfigError` for anything else or a negative id."""
    try:
        value = operator.index(room)  # type: ignore[arg-type]
    except TypeError:
        value = -1
    if value < 0 or isinstance(room, bool):
        raise ConfigError(f"room must be a non-negative integer, got {room!r}")
    return value


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
        status: KVPoll = self._side.rooms.status.get(self.room, self.unknown_status)
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
