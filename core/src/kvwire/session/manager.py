"""The per-rank :class:`KVManager`: the engine-facing façade an inference engine builds once
per rank.

The façade builds, in this order, and owns:

* the :class:`~kvwire.session.rooms.RoomTable` (live requests, their status, the room lock);
* the :class:`~kvwire.session.context.RankContext` (identity, layouts, aux rows, backend,
  codec and control channel, staging strategies, peers; the ``tell``/``later``/``evict``
  verbs and the progress thread);
* the role's side: :class:`~kvwire.session.prefill.side.PrefillSide` (transfer workers, the
  bootstrap registration, and the bootstrap service itself on prefill rank 0) or
  :class:`~kvwire.session.decode.side.DecodeSide` (bootstrap lookups and handshakes);
* the two lanes: the *liveness* thread (control messages, heartbeats, eviction; never an
  engine call) and the *progress* step run on the context's progress thread (engine progress,
  notifications, chores, deadlines, in that order, so notifications are always drained before
  a deadline is checked).

Nothing below the façade imports this module: sides, links and workers get the context and
the room table. Engines create one :class:`~kvwire.session.sender.KVSender` or
:class:`~kvwire.session.receiver.KVReceiver` per request from it (:meth:`KVManager.sender`,
:meth:`KVManager.receiver`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvwire.backend import TransferBackend
from kvwire.config import KVWireConfig
from kvwire.control.channel import ControlChannel
from kvwire.control.wire import (
    MESSAGE_TYPES,
    Codec,
    Goodbye,
    Heartbeat,
    Message,
    StagingMessage,
)
from kvwire.errors import ConfigError
from kvwire.gil import GilWatch
from kvwire.layout import KVLayout, MemoryRegion
from kvwire.session import metrics as m
from kvwire.session.common import room_id
from kvwire.session.context import STAMP_ROW_BYTES, RankContext, Role
from kvwire.session.decode.side import DecodeSide
from kvwire.session.peers import PeerTable
from kvwire.session.poll import StatusTable
from kvwire.session.prefill.early import RoomIssuer
from kvwire.session.prefill.side import PrefillSide
from kvwire.session.receiver import KVReceiver
from kvwire.session.rooms import RoomTable
from kvwire.session.sender import KVSender
from kvwire.staging.base import StagingStrategy
from kvwire.timer_slack import set_thread_slack

logger = logging.getLogger(__name__)

__all__ = ["STAMP_ROW_BYTES", "KVManager", "Role", "dispatch_table"]

#: Longest the liveness thread waits for a message, and the progress thread's period while no
#: request waits on a notification (and while some do).
CONTROL_TICK_S = 0.001
CONTROL_TICK_BUSY_S = 0.0002
#: The progress thread's period while the rank has no request at all: its duties then are
#: housekeeping on timers of 0.1 s and more (early requests' expiry, the write quarantine's
#: queries, the strategies' retries), a notification still wakes it at once on a backend that
#: pushes events, and the first new room wakes it (the sides' ``create_room``). At 1 ms an
#: idle manager cost 1.5% of a core on its progress thread alone (the development VM).
IDLE_TICK_S = 0.02
#: Least time between two walks of the progress thread's timers (the sides' deadlines, which
#: are seconds long) and between two checks of the liveness thread's peers (silence and closed
#: connections, also seconds): a turn that a notification or a message woke should cost a
#: poll and its handling, not a walk over every room or peer.
DEADLINE_TICK_S = 0.005
#: Longest the liveness thread waits for a message before checking its peers again.
LIVENESS_TICK_S = 0.02


class KVManager:
    """One rank's kvwire: backend, control plane and request objects.

    Built by the engine at startup, after its KV pool exists::

        mgr = KVManager(config, Role.PREFILL, layout, aux_buffers=[aux_region], dp_size=1)

    ``bootstrap_addr`` (``"host:port"``) is where prefill ranks register; prefill rank 0 (tp 0,
    pp 0, dp 0) runs the service itself when it is not given and ``control.run_bootstrap`` is on,
    and publishes its address as :attr:`bootstrap_addr`. Decode managers take the bootstrap
    address per request instead (:meth:`receiver`).

    ``aux_buffers`` are the engine's per-request metadata rows (first token, ...), all with the
    same number of rows; kvwire adds a 64-byte stamp row of its own in front of them.

    ``kv_tensors`` (the tensors the layout was built from) are read by staging strategies
    that gather and scatter on the pool (``--staging bulk``); without them bulk staging views
    the layout's buffers by address (:mod:`kvwire.staging.pool_views`), so an engine adapter
    need not hand them over. Pass them for a pool given as one stacked tensor.

    Decode only: ``pools`` names extra KV pools (same model, each its own page size, e.g. a
    host-memory pool of page size 1, or an SSD tier) that requests can choose per request
    (``send_metadata(..., pool=name)``); the handshake announces them to prefill, which
    serves each with ``KVWireConfig.pools[name]``'s mapper and staging strategy. ``hooks``
    (a :class:`~kvwire.session.receiver.DecodeHooks`) is told when a request into an extra
    pool is preallocated and when it is admitted or abandoned.

    Prefill only: ``room_issuer`` (a :class:`~kvwire.session.prefill.early.RoomIssuer`) says
    which rooms the engine will still create senders for; a decode request for any other room
    is refused at once instead of waiting as an early request (see
    :mod:`kvwire.session.prefill.early`).
    """

    def __init__(
        self,
        config: KVWireConfig,
        role: Role | str,
        layout: KVLayout,
        *,
        aux_buffers: Sequence[MemoryRegion] = (),
        bootstrap_addr: str | None = None,
        dp_size: int = 1,
        agent_name: str | None = None,
        kv_tensors: Any = None,
        pools: Mapping[str, KVLayout] | None = None,
        hooks: Any = None,
        room_issuer: RoomIssuer | None = None,
    ) -> None:
        if room_issuer is not None and Role(role) is not Role.PREFILL:
            raise ConfigError("room_issuer (which rooms prefill will create) is for prefill")
        self._closed = False
        self._next_check = 0.0
        self._next_tick = 0.0
        #: Progress thread: whether a request awaited data when last asked, and when to ask.
        self._awaiting = False
        self._next_await = 0.0
        #: When the liveness thread last checked its peers (a late turn: this process stalled).
        self._last_check = time.monotonic()
        self._exported_drops: dict[str, int] = {}
        labels: dict[str, str] = {}  # filled once the context named the rank
        rooms: RoomTable[Any] = RoomTable(labels)
        self.ctx = ctx = RankContext(
            config,
            role,
            layout,
            room_pages=rooms.pages,
            aux_buffers=aux_buffers,
            dp_size=dp_size,
            agent_name=agent_name,
            kv_tensors=kv_tensors,
            pools=pools,
            hooks=hooks,
        )
        labels.update(ctx.labels)
        #: The switch-interval policy (kvwire.gil), fed by the liveness thread; read-only to
        #: others (``gil.lowered``, ``gil.lowerings``).
        self.gil = GilWatch(
            config.control.gil_switch,
            config.control.gil_switch_interval_us,
            ctx.agent_name,
            on_change=self._gil_changed,
        )
        #: The room table (live requests, their status and the room lock).
        self.rooms = rooms
        self.side: PrefillSide | DecodeSide
        try:
            if ctx.role is Role.PREFILL:
                self.side = PrefillSide(ctx, rooms, bootstrap_addr, room_issuer)
            else:
                self.side = DecodeSide(ctx, rooms)
        except BaseException:
            self.gil.close()
            ctx.close()
            raise
        ctx.watch_peers(self.side.on_peer_lost)
        #: kind -> (object, method name); looked up per message so a handler can be wrapped.
        self._handlers = dispatch_table(self, self.side)
        self._liveness = threading.Thread(
            target=self._liveness_loop, name=f"kvwire-liveness-{ctx.agent_name}", daemon=True
        )
        self._liveness.start()
        ctx.start(self._progress_step)
        whose = "num_workers" if ctx.options.num_workers else "the backend's number, else 4"
        workers = (
            f", {ctx.num_workers} transfer workers ({whose})" if ctx.role is Role.PREFILL else ""
        )
        logger.info(
            "%s: %s manager up (backend %s, endpoint %s%s)",
            ctx.agent_name,
            ctx.role.value,
            ctx.backend_name,
            ctx.channel.endpoint,
            workers,
        )

    # ------------------------------------------------------------------ engine API
    @property
    def bootstrap_addr(self) -> str | None:
        """Prefill: the bootstrap service this rank registered with (``host:port``)."""
        return self.side.bootstrap_addr if isinstance(self.side, PrefillSide) else None

    def sender(self, room: int) -> KVSender:
        """Prefill: the sender of request ``room`` (called when the request arrives)."""
        if not isinstance(self.side, PrefillSide):
            raise ConfigError("sender() is for prefill managers; this one is decode")
        return KVSender(self.side, room_id(room))

    def receiver(
        self, room: int, bootstrap_addr: str, prefill_dp_rank: int | None = None
    ) -> KVReceiver:
        """Decode: the receiver of request ``room`` whose prefill instance registered at
        ``bootstrap_addr``; bootstrapping (lookup and handshakes) starts in the background."""
        if not isinstance(self.side, DecodeSide):
            raise ConfigError("receiver() is for decode managers; this one is prefill")
        return KVReceiver(self.side, room_id(room), bootstrap_addr, prefill_dp_rank)

    def room_tables(self) -> dict[str, int]:
        """Sizes of every per-room table (a leak check: all zero once every room is cleared)."""
        out = {"status": len(self.rooms.status)}
        out.update(self.side.room_tables())
        return out

    @property
    def backlog(self) -> dict[str, int]:
        """What waits here (any thread, cheap): ``queued_chunks`` (prefill: chunks handed to
        ``send()`` that no transfer worker has taken yet) and ``live_rooms``. Queued requests
        are not failed for waiting (deadlines are on progress); watch this, or
        :attr:`saturated`, to apply backpressure."""
        queued = self.side.queued_chunks()
        m.QUEUED_CHUNKS.labels(**self.ctx.labels).set(queued)
        return {"queued_chunks": queued, "live_rooms": len(self.rooms.status)}

    @property
    def saturated(self) -> bool:
        """Prefill: the workers' queues hold ``control.max_queued_chunks`` chunks or more; an
        engine should hold back new requests until this clears (nothing is refused for it)."""
        return self.side.queued_chunks() >= self.ctx.options.max_queued_chunks

    @property
    def dropped(self) -> dict[str, int]:
        """Control frames dropped, by reason (unauthenticated, malformed, version, ...)."""
        return dict(self.ctx.channel.dropped)

    # The rank's identity and parts, read-only, for engines, tools and tests (the session
    # layer below reads them from the context).
    @property
    def config(self) -> KVWireConfig:
        """The configuration this rank was built with."""
        return self.ctx.config

    @property
    def role(self) -> Role:
        """Prefill or decode."""
        return self.ctx.role

    @property
    def layout(self) -> KVLayout:
        """The KV pool's layout."""
        return self.ctx.layout

    @property
    def pools(self) -> Mapping[str, KVLayout]:
        """Every pool of this rank by name ("kv" and, on decode, the extra pools)."""
        return self.ctx.pool_layouts

    @property
    def session(self) -> str:
        """This incarnation's session id (peers key it)."""
        return self.ctx.session

    @property
    def agent_name(self) -> str:
        """This rank's agent name (unique per incarnation)."""
        return self.ctx.agent_name

    @property
    def labels(self) -> dict[str, str]:
        """This rank's metric labels."""
        return self.ctx.labels

    @property
    def backend(self) -> TransferBackend:
        """The transfer backend (a ``MultiBackend`` when several are configured)."""
        return self.ctx.backend

    @property
    def backend_names(self) -> list[str]:
        """This rank's backends in preference order."""
        return self.ctx.backend_names

    @property
    def backend_name(self) -> str:
        """The backends' names, comma-separated."""
        return self.ctx.backend_name

    @property
    def staging(self) -> StagingStrategy:
        """The KV pool's staging strategy."""
        return self.ctx.staging

    def staging_of(self, pool: str) -> StagingStrategy | None:
        """The staging strategy of ``pool`` on this rank, if it has one."""
        return self.ctx.staging_of(pool)

    @property
    def peers(self) -> PeerTable:
        """The peers this rank has handshaken with."""
        return self.ctx.peers

    @property
    def channel(self) -> ControlChannel:
        """The control channel."""
        return self.ctx.channel

    @property
    def codec(self) -> Codec:
        """The control messages' codec (MACs with the shared secret)."""
        return self.ctx.codec

    @property
    def status(self) -> StatusTable:
        """Every live room's status."""
        return self.rooms.status

    def tell(self, endpoint: str, msg: Message) -> bool:
        """Tell a peer's control endpoint ``msg`` (see :meth:`RankContext.tell`)."""
        return self.ctx.tell(endpoint, msg)

    def evict(self, session: str, why: str, silent: bool = False) -> None:
        """Forget peer ``session`` as the liveness thread does (see
        :meth:`RankContext.evict`); tools and tests use it to evict by hand."""
        self.ctx.evict(session, why, silent)

    def close(self) -> None:
        """Stop threads, tell peers goodbye, fail live rooms and free everything. Idempotent;
        called by the engine at shutdown."""
        with self.rooms.lock:
            if self._closed:
                return
            self._closed = True
        ctx = self.ctx
        for p in ctx.peers.snapshot():
            ctx.channel.tell(p.endpoint, Goodbye(session=ctx.session))
        ctx.stop(5.0)
        self._liveness.join(5.0)
        self.gil.close()
        self.side.close()
        ctx.close()

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _gil_changed(self, interval_s: float, lowered: bool) -> None:
        """The GIL watch set the switch interval (engine thread at start, then the liveness
        thread): export it, and count a lowering."""
        m.GIL_SWITCH_INTERVAL.labels(**self.ctx.labels).set(interval_s)
        if lowered:
            m.GIL_LOWERINGS.labels(**self.ctx.labels).inc()

    # -------------------------------------------------------------- liveness lane
    def _liveness_loop(self) -> None:
        """Liveness thread: receive control messages (a bounded batch per turn), dispatch
        them, send heartbeats, and evict peers that are silent or whose connection closed.
        Never calls the transfer engine and never takes a lock held across an engine call:
        handlers only update tables and queue work."""
        ctx = self.ctx
        opts = ctx.options
        set_thread_slack(ctx.timer_slack_us)
        next_beat = next_check = 0.0
        self._last_check = time.monotonic()
        while not ctx.stopping:
            try:
                # sleep until a message arrives or the next duty is due (no busy ticking)
                wait = min(LIVENESS_TICK_S, max(0.0, next_beat - time.monotonic()))
                t_wait = time.monotonic()
                msgs = ctx.channel.receive(wait)
                if not msgs:  # the wait's lateness is how long this thread waited to run
                    self.gil.waited(ctx.channel.timeout_granted(wait), time.monotonic() - t_wait)
                for msg in msgs:
                    self._dispatch(msg)
                for msg in ctx.channel.take_unsigned():
                    self.side.on_unsigned(msg)
                now = time.monotonic()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + opts.heartbeat_interval_s
                if now >= next_check:
                    self._check_peers(now)
                    next_check = now + DEADLINE_TICK_S
            except Exception:
                logger.exception("%s: liveness loop error; continuing", ctx.agent_name)
                time.sleep(CONTROL_TICK_S)

    def _dispatch(self, msg: Message) -> None:
        """Liveness thread: any authenticated message from a peer is a sign of life; then
        the one handler of its kind runs (see :data:`COMMON_HANDLERS` and the sides'
        ``HANDLERS``)."""
        session = getattr(msg, "session", None)
        if isinstance(session, str):
            self.ctx.peers.touch(session)
        entry = self._handlers.get(msg.kind)
        if entry is None:  # every kind has one (a test checks); a defensive drop
            logger.debug("%s: no handler for %s", self.ctx.agent_name, msg.kind)
            return
        try:
            getattr(entry[0], entry[1])(msg)
        except Exception:
            logger.exception("%s: handling %s failed", self.ctx.agent_name, msg.kind)

    def _on_heartbeat(self, msg: Message) -> None:
        """A peer's heartbeat: the touch in :meth:`_dispatch` is all it does. One from a
        session that is not a peer goes to the side (:meth:`Side.on_stranger`)."""
        assert isinstance(msg, Heartbeat)
        if msg.session not in self.ctx.peers:
            self.side.on_stranger(msg.session)

    def _on_staging(self, msg: Message) -> None:
        """Liveness thread: a staging strategy's own message. Routed, unread, to this rank's
        strategy of the named pool when it comes from a handshaken peer and that strategy has
        the sender's name; dropped (and counted) otherwise."""
        assert isinstance(msg, StagingMessage)
        ctx = self.ctx
        strategy = ctx.staging_of(msg.pool)
        peer = ctx.peers.get(msg.session)
        if peer is None or strategy is None or strategy.name != msg.strategy:
            reason = (
                "staging_unknown_peer"
                if peer is None
                else "staging_unknown_pool"
                if strategy is None
                else "staging_other_strategy"
            )
            ctx.channel.dropped[reason] += 1
            logger.debug(
                "%s: dropped a %s/%s staging message from %s (%s)",
                ctx.agent_name,
                msg.strategy,
                msg.type,
                msg.session,
                reason,
            )
            return
        strategy.on_message(peer.endpoint, msg)

    def _on_goodbye(self, msg: Message) -> None:
        assert isinstance(msg, Goodbye)
        self.ctx.evict(msg.session, "it closed (goodbye)")

    def _beat(self) -> None:
        ctx = self.ctx
        beat = Heartbeat(session=ctx.session, sent_at=time.time())
        for p in ctx.peers.snapshot():
            ctx.channel.tell(p.endpoint, beat)
        self._export_drops()

    def _export_drops(self) -> None:
        """Liveness thread, each heartbeat: received frames the channel dropped (malformed,
        unauthenticated, replayed, ...) reach ``kvwire_control_dropped_total`` by reason
        (``send_full`` is counted where it happens, in :meth:`RankContext.tell`)."""
        for reason, n in list(self.ctx.channel.dropped.items()):
            seen = self._exported_drops.get(reason, 0)
            if reason != "send_full" and n > seen:
                m.DROPPED.labels(**self.ctx.labels, reason=reason).inc(n - seen)
            self._exported_drops[reason] = n

    def _check_peers(self, now: float) -> None:
        # silence counts only while this thread listens: when its turn comes late (this
        # process was stopped or starved), the gap is not held against the peers, who get
        # their heartbeats heard (or say they evicted this rank) before any is evicted
        ctx = self.ctx
        gap = now - self._last_check
        self._last_check = now
        if gap > ctx.options.heartbeat_interval_s and len(ctx.peers):
            logger.warning(
                "%s: liveness thread stalled for %.1fs (process stopped or starved); peers' "
                "silence over that time is not held against them",
                ctx.agent_name,
                gap,
            )
            ctx.peers.defer(gap, now)
        # closed connections first: a peer that is both silent and disconnected is gone (its
        # writes cannot still arrive), not merely behind a partition
        for ep in ctx.channel.lost_endpoints(now):
            gone = ctx.peers.by_endpoint(ep)
            if not gone:
                ctx.channel.disconnect(ep)
            for p in gone:
                ctx.evict(p.session, "its control connection closed (process gone?)")
        limit = ctx.options.heartbeat_interval_s * ctx.options.heartbeat_misses
        for p in ctx.peers.silent(now, limit):
            ctx.evict(p.session, f"no heartbeat for {limit:.1f}s", silent=True)

    # -------------------------------------------------------------- progress lane
    def _progress_step(self) -> None:
        """Progress thread (the context's :class:`~kvwire.owner_loop.OwnerLoop`, which runs
        the chores :meth:`RankContext.later` queued before each step): drive the engine
        (``progress``), drain its notifications, then check deadlines (after the drain, so a
        notification that arrived is never taken for a timeout; at most every
        :data:`DEADLINE_TICK_S`: they are seconds long, and a turn while data is awaited
        should cost a poll, not a walk over every room), and let the strategies tick (at most
        every :data:`CONTROL_TICK_S`).

        Between turns: with a backend that :attr:`~kvwire.backend.TransferBackend.pushes_events`
        it sleeps until a notification is queued (or a chore, or :data:`CONTROL_TICK_S`);
        with one that must be polled, :data:`CONTROL_TICK_BUSY_S` while a request waits on
        data, :data:`CONTROL_TICK_S` otherwise; :data:`IDLE_TICK_S` instead of
        :data:`CONTROL_TICK_S` while the rank has no room (the first one wakes it)."""
        ctx, side = self.ctx, self.side
        backend, wake = ctx.backend, ctx.wake
        try:
            backend.progress()
            try:
                for note in backend.get_notifications():
                    side.on_notification(note)
            finally:
                side.notifications_drained()
            now = time.monotonic()
            if now >= self._next_check:
                side.check_deadlines(now)
                self._next_check = now + DEADLINE_TICK_S
            if now >= self._next_tick:
                for strategy in ctx.strategies:
                    strategy.tick(now)
                self._next_tick = now + CONTROL_TICK_S
            # the wait takes the wake-up; one that comes after it stays for the next wait,
            # and the next turn drains anyway: none is lost
            # (whether data is awaited is a walk over the rooms: asked every turn while none
            # is, at most every CONTROL_TICK_S while some are)
            if not backend.pushes_events and (not self._awaiting or now >= self._next_await):
                self._awaiting = side.awaiting_data()
                self._next_await = now + CONTROL_TICK_S
            if backend.pushes_events or not self._awaiting:
                wake.wait(CONTROL_TICK_S if len(self.rooms) else IDLE_TICK_S)
            else:
                wake.wait(CONTROL_TICK_BUSY_S)
        except Exception:
            logger.exception("%s: progress loop error; continuing", ctx.agent_name)
            time.sleep(CONTROL_TICK_S)


#: Handlers the manager itself runs, whatever its role (kind -> method of :class:`KVManager`).
COMMON_HANDLERS: dict[str, str] = {
    "heartbeat": "_on_heartbeat",
    "goodbye": "_on_goodbye",
    "staging": "_on_staging",
}


def dispatch_table(mgr: KVManager, side: Any) -> dict[str, tuple[Any, str]]:
    """The one handler of every wire message kind for ``side``'s role: the manager's
    :data:`COMMON_HANDLERS` and the side's ``HANDLERS``. Refuses a kind handled twice or not
    at all (a new message type must be given a handler, or an explicit ignore, per side)."""
    names: dict[str, tuple[Any, str]] = {k: (mgr, v) for k, v in COMMON_HANDLERS.items()}
    for kind, method in side.HANDLERS.items():
        if kind in names:
            raise TypeError(f"message kind {kind!r} has two handlers on {type(side).__name__}")
        names[kind] = (side, method)
    missing = sorted(set(MESSAGE_TYPES) - set(names))
    extra = sorted(set(names) - set(MESSAGE_TYPES))
    if missing or extra:
        raise TypeError(
            f"{type(side).__name__} dispatch table: no handler for {missing}, unknown kinds {extra}"
        )
    for kind, (obj, method) in names.items():
        if not callable(getattr(obj, method, None)):
            raise TypeError(f"handler {method!r} of message kind {kind!r} is not a method")
    return names
