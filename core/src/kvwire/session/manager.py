"""The per-rank :class:`KVManager`: what an inference engine builds once per rank.

A manager owns, for one rank:

* the transfer backend (selected from the config), with the KV pool and the aux rows registered;
* the control channel (a ZeroMQ endpoint) and one *control thread* that receives control
  messages, drives the backend (``progress`` and notifications), sends heartbeats, evicts dead
  peers and enforces deadlines — in that order, so notifications are always drained before a
  deadline is checked;
* the role's side: :class:`~kvwire.session.prefill.PrefillSide` (transfer workers, the
  bootstrap registration, and the bootstrap service itself on prefill rank 0) or
  :class:`~kvwire.session.decode.DecodeSide` (bootstrap lookups and handshakes);
* the room status table.

Engines create one :class:`~kvwire.session.sender.KVSender` or
:class:`~kvwire.session.receiver.KVReceiver` per request from it (:meth:`KVManager.sender`,
:meth:`KVManager.receiver`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from kvwire.backend import TransferBackend
from kvwire.config import KVWireConfig
from kvwire.control.channel import ControlChannel
from kvwire.control.wire import MESSAGE_TYPES, Codec, Goodbye, Heartbeat, Message, StagingMessage
from kvwire.errors import ConfigError, LayoutError
from kvwire.layout import KVLayout, MemoryRegion
from kvwire.security import enforce_secret_policy
from kvwire.selection import create_backends, select_host_staging, select_staging
from kvwire.session import metrics as m
from kvwire.session.early import RoomIssuer
from kvwire.session.peers import Peer, PeerTable
from kvwire.session.poll import KVPoll, StatusTable
from kvwire.staging.base import StagingContext, StagingStrategy

if TYPE_CHECKING:
    from kvwire.session.decode import DecodeSide
    from kvwire.session.prefill import PrefillSide
    from kvwire.session.receiver import KVReceiver
    from kvwire.session.sender import KVSender

logger = logging.getLogger(__name__)

#: Bytes of kvwire's own aux row (the room stamp, padded to 64 bytes for RDMA).
STAMP_ROW_BYTES = 64
#: Longest the liveness thread waits for a message, and the progress thread's period while no
#: request waits on a notification (and while some do).
CONTROL_TICK_S = 0.001
CONTROL_TICK_BUSY_S = 0.0002
#: Longest the liveness thread waits for a message before checking its peers again.
LIVENESS_TICK_S = 0.02


class Role(enum.StrEnum):
    """Which side of the disaggregated pair a manager serves."""

    PREFILL = "prefill"
    DECODE = "decode"


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

    ``kv_tensors`` (the tensors the layout was built from) are needed by staging strategies
    that gather and scatter on the pool (``--staging bulk``).

    Decode only: ``host_layout`` describes a host-memory KV pool (same model, its own page
    size, e.g. 1) that requests can choose per request (``send_metadata(..., pool="host")``);
    ``hooks`` (a :class:`~kvwire.session.receiver.DecodeHooks`) is told when such a request is
    preallocated and when it is admitted or abandoned.

    Prefill only: ``room_issuer`` (a :class:`~kvwire.session.early.RoomIssuer`) says which
    rooms the engine will still create senders for; a decode request for any other room is
    refused at once instead of waiting as an early request (see :mod:`kvwire.session.early`).
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
        host_layout: KVLayout | None = None,
        hooks: Any = None,
        room_issuer: RoomIssuer | None = None,
    ) -> None:
        enforce_secret_policy(config.require_secret, config.secret_bytes, "this kvwire rank")
        self.config = config
        self.role = Role(role)
        self.layout = layout
        self.host_layout = host_layout
        self.hooks = hooks
        self.options = config.control
        self.session = secrets.token_hex(8)
        r = layout.rank
        # Unique by default: two instances of the same shape must never share a name (the
        # engines key peers by it). The session id makes it unique per incarnation too.
        self.agent_name = agent_name or (
            f"{self.role.value}-dp{r.dp_rank}-pp{r.pp_rank}-tp{r.tp_rank}-{self.session[:8]}"
        )
        if dp_size < 1 or r.dp_rank >= dp_size:
            raise LayoutError(f"dp_rank {r.dp_rank} is not below dp_size {dp_size}")
        self.dp_size = dp_size
        self.labels = {"role": self.role.value, "agent": self.agent_name}
        self.status = StatusTable()
        self.lock = threading.RLock()
        #: Engine peer name -> the session that added it (prefill: decode ranks added to
        #: the backend). Guarded by :attr:`engine_peers_lock`, which serialises adding and
        #: removing peers in the engine (handshake threads, progress thread); never taken
        #: together with :attr:`lock`.
        self.engine_peers: dict[str, str] = {}
        self.engine_peers_lock = threading.Lock()
        self.peers = PeerTable()
        self._chores: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._closed = False
        self._cleanup: list[Any] = []
        self._exported_drops: dict[str, int] = {}
        #: When the liveness thread last checked its peers (a late turn: this process stalled).
        self._last_check = time.monotonic()

        slots = {b.num_items for b in aux_buffers}
        if len(slots) > 1:
            raise LayoutError(f"aux buffers must have the same number of rows; got {sorted(slots)}")
        self.aux_slots = slots.pop() if slots else self.options.aux_slots
        self.stamps: NDArray[np.uint64] = np.zeros(
            (self.aux_slots, STAMP_ROW_BYTES // 8), dtype=np.uint64
        )
        self.aux_regions = [
            MemoryRegion.from_pointer(self.stamps.ctypes.data, self.stamps.nbytes, STAMP_ROW_BYTES),
            *aux_buffers,
        ]

        if room_issuer is not None and self.role is not Role.PREFILL:
            raise ConfigError("room_issuer (which rooms prefill will create) is for prefill")
        if host_layout is not None and self.role is not Role.DECODE:
            raise ConfigError("host_layout (a decode host pool) is for decode managers")
        host_buffers = tuple(host_layout.buffers) if host_layout is not None else ()
        groups = layout.group_regions  # state, sliding-window and draft-layer buffers
        kinds = {b.kind for b in (*layout.buffers, *groups, *aux_buffers, *host_buffers)}
        self.backend: TransferBackend
        self.backend, self.backend_plan = create_backends(
            config,
            self.agent_name,
            kinds=kinds,
            on_failover=self._on_failover,
            on_recovery=self._on_recovery,
        )
        #: This rank's backends in preference order (one, or a MultiBackend's members).
        self.backend_names = self.backend_plan.names
        self.backend_name = ",".join(self.backend_names)
        #: Ends the progress thread's wait early: set by the backend when a notification is
        #: queued (a backend that pushes events), by :meth:`later` and by :meth:`close`.
        self._progress_wake = threading.Event()
        self.backend.set_notification_waker(self._progress_wake.set)
        try:
            self.backend.register([*layout.buffers, *groups, *host_buffers, *self.aux_regions])
            context = StagingContext(
                layout,
                self.backend.register,
                self.backend.deregister,
                role=self.role.value,
                num_workers=self.options.num_workers,
                kv_tensors=kv_tensors,
                send_fn=lambda endpoint, msg: self.tell(endpoint, msg),
                session=self.session,
                room_pages=self._room_pages,
            )
            ssel = select_staging(config)
            self.staging: StagingStrategy = ssel.cls(ssel.options)
            self.staging.setup(context)
            hsel = select_host_staging(config)
            #: Strategy for chunks into a decode host pool; see
            #: ``KVWireConfig.host_staging``.
            self.host_staging: StagingStrategy = hsel.cls(hsel.options)
            self.host_staging.setup(
                dataclasses.replace(
                    context, host_layout=host_layout, pool="host", room_pages=self._host_room_pages
                )
            )
            self.codec = Codec(config.secret_bytes)
            self.channel = ControlChannel(self.codec, self.options.host, self.options.send_hwm)
        except BaseException:
            self.backend.close()
            raise
        if self.options.metrics_port is not None:
            m.serve_metrics(self.options.metrics_port)

        self.side: PrefillSide | DecodeSide
        try:
            if self.role is Role.PREFILL:
                from kvwire.session.prefill import PrefillSide

                self.side = PrefillSide(self, bootstrap_addr, room_issuer)
            else:
                from kvwire.session.decode import DecodeSide

                self.side = DecodeSide(self)
        except BaseException:
            self._release_resources()
            raise
        #: kind -> (object, method name); looked up per message so a handler can be wrapped.
        self._handlers = dispatch_table(self, self.side)
        self._threads = [
            threading.Thread(target=fn, name=f"kvwire-{what}-{self.agent_name}", daemon=True)
            for what, fn in (("liveness", self._liveness_loop), ("progress", self._progress_loop))
        ]
        for t in self._threads:
            t.start()
        logger.info(
            "%s: %s manager up (backend %s, endpoint %s)",
            self.agent_name,
            self.role.value,
            self.backend_name,
            self.channel.endpoint,
        )

    # ------------------------------------------------------------------ engine API
    @property
    def bootstrap_addr(self) -> str | None:
        """Prefill: the bootstrap service this rank registered with (``host:port``)."""
        from kvwire.session.prefill import PrefillSide

        return self.side.bootstrap_addr if isinstance(self.side, PrefillSide) else None

    def sender(self, room: int) -> KVSender:
        """Prefill: the sender of request ``room`` (called when the request arrives)."""
        from kvwire.session.prefill import PrefillSide
        from kvwire.session.sender import KVSender

        if not isinstance(self.side, PrefillSide):
            raise ConfigError("sender() is for prefill managers; this one is decode")
        return KVSender(self.side, room)

    def receiver(
        self, room: int, bootstrap_addr: str, prefill_dp_rank: int | None = None
    ) -> KVReceiver:
        """Decode: the receiver of request ``room`` whose prefill instance registered at
        ``bootstrap_addr``; bootstrapping (lookup and handshakes) starts in the background."""
        from kvwire.session.decode import DecodeSide
        from kvwire.session.receiver import KVReceiver

        if not isinstance(self.side, DecodeSide):
            raise ConfigError("receiver() is for decode managers; this one is prefill")
        return KVReceiver(self.side, room, bootstrap_addr, prefill_dp_rank)

    def room_tables(self) -> dict[str, int]:
        """Sizes of every per-room table (a leak check: all zero once every room is cleared)."""
        out = {"status": len(self.status)}
        out.update(self.side.room_tables())
        return out

    @property
    def backlog(self) -> dict[str, int]:
        """What waits here (any thread, cheap): ``queued_chunks`` (prefill: chunks handed to
        ``send()`` that no transfer worker has taken yet) and ``live_rooms``. Queued requests
        are not failed for waiting (deadlines are on progress); watch this, or
        :attr:`saturated`, to apply backpressure."""
        queued = self.side.queued_chunks()
        m.QUEUED_CHUNKS.labels(**self.labels).set(queued)
        return {"queued_chunks": queued, "live_rooms": len(self.status)}

    @property
    def saturated(self) -> bool:
        """Prefill: the workers' queues hold ``control.max_queued_chunks`` chunks or more; an
        engine should hold back new requests until this clears (nothing is refused for it)."""
        return self.side.queued_chunks() >= self.options.max_queued_chunks

    @property
    def dropped(self) -> dict[str, int]:
        """Control frames dropped, by reason (unauthenticated, malformed, version, ...)."""
        return dict(self.channel.dropped)

    def close(self) -> None:
        """Stop threads, tell peers goodbye, fail live rooms and free everything. Idempotent;
        called by the engine at shutdown."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
        for p in self.peers.snapshot():
            self.channel.send(p.endpoint, Goodbye(session=self.session))
        self._stop.set()
        self._progress_wake.set()
        for t in self._threads:
            t.join(5.0)
        self.side.close()
        self._release_resources()

    def _release_resources(self) -> None:
        for strategy in self.strategies:
            strategy.close()
        self.backend.close()
        self.channel.close()

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- liveness lane
    def _liveness_loop(self) -> None:
        """Liveness thread: receive control messages (a bounded batch per turn), dispatch
        them, send heartbeats, and evict peers that are silent or whose connection closed.
        Never calls the transfer engine and never takes a lock held across an engine call:
        handlers only update tables and queue work."""
        opts = self.options
        next_beat = 0.0
        self._last_check = time.monotonic()
        while not self._stop.is_set():
            try:
                # sleep until a message arrives or the next duty is due (no busy ticking)
                wait = min(LIVENESS_TICK_S, max(0.0, next_beat - time.monotonic()))
                for msg in self.channel.receive(wait):
                    self._dispatch(msg)
                for msg in self.channel.take_unsigned():
                    self.side.on_unsigned(msg)
                now = time.monotonic()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + opts.heartbeat_interval_s
                self._check_peers(now)
            except Exception:
                logger.exception("%s: liveness loop error; continuing", self.agent_name)
                time.sleep(CONTROL_TICK_S)

    def _dispatch(self, msg: Message) -> None:
        """Liveness thread: any authenticated message from a peer is a sign of life; then
        the one handler of its kind runs (see :data:`COMMON_HANDLERS` and the sides'
        ``HANDLERS``)."""
        session = getattr(msg, "session", None)
        if isinstance(session, str):
            self.peers.touch(session)
        entry = self._handlers.get(msg.kind)
        if entry is None:  # every kind has one (a test checks); a defensive drop
            logger.debug("%s: no handler for %s", self.agent_name, msg.kind)
            return
        try:
            getattr(entry[0], entry[1])(msg)
        except Exception:
            logger.exception("%s: handling %s failed", self.agent_name, msg.kind)

    def _on_heartbeat(self, msg: Message) -> None:
        """A peer's heartbeat: the touch in :meth:`_dispatch` is all it does. One from a
        session that is not a peer goes to the side (:meth:`Side.on_stranger`)."""
        assert isinstance(msg, Heartbeat)
        if msg.session not in self.peers:
            self.side.on_stranger(msg.session)

    def _on_staging(self, msg: Message) -> None:
        """Liveness thread: a staging strategy's own message. Routed, unread, to this rank's
        strategy of the named pool when it comes from a handshaken peer and that strategy has
        the sender's name; dropped (and counted) otherwise."""
        assert isinstance(msg, StagingMessage)
        strategy = self.host_staging if msg.pool == "host" else self.staging
        peer = self.peers.get(msg.session)
        if peer is None or strategy.name != msg.strategy:
            reason = "staging_unknown_peer" if peer is None else "staging_other_strategy"
            self.channel.dropped[reason] += 1
            logger.debug(
                "%s: dropped a %s/%s staging message from %s (%s)",
                self.agent_name,
                msg.strategy,
                msg.type,
                msg.session,
                reason,
            )
            return
        strategy.on_message(peer.endpoint, msg)

    def _on_goodbye(self, msg: Message) -> None:
        assert isinstance(msg, Goodbye)
        self.evict(msg.session, "it closed (goodbye)")

    def _beat(self) -> None:
        beat = Heartbeat(session=self.session, sent_at=time.time())
        for p in self.peers.snapshot():
            self.channel.send(p.endpoint, beat)
        self._export_drops()

    def _export_drops(self) -> None:
        """Liveness thread, each heartbeat: received frames the channel dropped (malformed,
        unauthenticated, replayed, ...) reach ``kvwire_control_dropped_total`` by reason
        (``send_full`` is counted where it happens, in :meth:`send`)."""
        for reason, n in list(self.channel.dropped.items()):
            seen = self._exported_drops.get(reason, 0)
            if reason != "send_full" and n > seen:
                m.DROPPED.labels(**self.labels, reason=reason).inc(n - seen)
            self._exported_drops[reason] = n

    def _check_peers(self, now: float) -> None:
        # silence counts only while this thread listens: when its turn comes late (this
        # process was stopped or starved), the gap is not held against the peers, who get
        # their heartbeats heard (or say they evicted this rank) before any is evicted
        gap = now - self._last_check
        self._last_check = now
        if gap > self.options.heartbeat_interval_s and len(self.peers):
            logger.warning(
                "%s: liveness thread stalled for %.1fs (process stopped or starved); peers' "
                "silence over that time is not held against them",
                self.agent_name,
                gap,
            )
            self.peers.defer(gap, now)
        # closed connections first: a peer that is both silent and disconnected is gone (its
        # writes cannot still arrive), not merely behind a partition
        for ep in self.channel.lost_endpoints(now):
            gone = self.peers.by_endpoint(ep)
            if not gone:
                self.channel.disconnect(ep)
            for p in gone:
                self.evict(p.session, "its control connection closed (process gone?)")
        limit = self.options.heartbeat_interval_s * self.options.heartbeat_misses
        for p in self.peers.silent(now, limit):
            self.evict(p.session, f"no heartbeat for {limit:.1f}s", silent=True)

    # -------------------------------------------------------------- progress lane
    def _progress_loop(self) -> None:
        """Progress thread: drive the engine (``progress``), drain its notifications, run
        queued chores (engine cleanup of evicted peers), then check deadlines (after the
        drain, so a notification that arrived is never taken for a timeout; at most every
        :data:`CONTROL_TICK_S`: they are seconds long, and a turn while data is awaited
        should cost a poll, not a walk over every room).

        Between turns: with a backend that :attr:`~kvwire.backend.TransferBackend.pushes_events`
        it sleeps until a notification is queued (or a chore, or :data:`CONTROL_TICK_S`);
        with one that must be polled, :data:`CONTROL_TICK_BUSY_S` while a request waits on
        data, :data:`CONTROL_TICK_S` otherwise."""
        backend, side, wake = self.backend, self.side, self._progress_wake
        evented = backend.pushes_events
        next_check = 0.0
        while not self._stop.is_set():
            try:
                backend.progress()
                for note in backend.get_notifications():
                    side.on_notification(note)
                while True:
                    try:
                        chore = self._chores.get_nowait()
                    except queue.Empty:
                        break
                    chore()
                now = time.monotonic()
                if now >= next_check:
                    side.check_deadlines(now)
                    next_check = now + CONTROL_TICK_S
                for strategy in self.strategies:
                    strategy.tick(now)
                if evented:
                    # cleared after the wait, and the next turn drains: a wake-up that
                    # comes in between is never lost
                    wake.wait(CONTROL_TICK_S)
                    wake.clear()
                else:
                    wake.wait(CONTROL_TICK_BUSY_S if side.awaiting_data() else CONTROL_TICK_S)
                    wake.clear()
            except Exception:
                logger.exception("%s: progress loop error; continuing", self.agent_name)
                time.sleep(CONTROL_TICK_S)

    def _on_failover(self, peer: str, src: str, dst: str, why: str) -> None:
        """A link's backend failed and its transfers moved to ``dst`` (any thread)."""
        m.FAILOVERS.labels(**self.labels, src=src, dst=dst).inc()

    def _on_recovery(self, peer: str, backend: str) -> None:
        """A link's failed backend reconnected and takes its transfers again (probe thread)."""
        m.RECOVERIES.labels(**self.labels, backend=backend).inc()

    def later(self, chore: Callable[[], None]) -> None:
        """Run ``chore`` on the progress thread (engine calls the liveness thread must not
        make, such as removing an evicted peer from the engine). Any thread."""
        self._chores.put(chore)
        self._progress_wake.set()

    def add_peer(self, peer: Peer) -> None:
        """Start tracking a peer's liveness (after a successful handshake)."""
        self.peers.add(peer)

    def evict(self, session: str, why: str, silent: bool = False) -> None:
        """Forget a dead or departed peer everywhere: its rooms fail (both sides told), its
        socket is dropped, and its engine state is removed on the progress thread. Called by
        the liveness thread (heartbeats, closed connections, goodbye) or a handshake thread
        (a restart). ``silent``: evicted for silence alone (it may be alive behind a
        partition, with writes still on the way)."""
        peer = self.peers.pop(session)
        if peer is None:
            return
        peer.silent_loss = silent
        level = logging.INFO if "goodbye" in why else logging.WARNING
        logger.log(level, "%s: evicting %s (%s): %s", self.agent_name, peer.agent, session, why)
        m.EVICTIONS.labels(**self.labels).inc()
        self.side.on_peer_lost(peer, why)
        self.channel.disconnect(peer.endpoint)

    def _room_pages(self, room: int) -> Any:
        """Strategies of the KV pool (any thread): a live request's destination pages (none
        while the side is being built: no peer can have asked yet)."""
        side = getattr(self, "side", None)
        return side.room_pages(room, "kv") if side is not None else None

    def _host_room_pages(self, room: int) -> Any:
        """Strategies of the host pool (any thread): as :meth:`_room_pages`."""
        side = getattr(self, "side", None)
        return side.room_pages(room, "host") if side is not None else None

    @property
    def strategies(self) -> tuple[StagingStrategy, StagingStrategy]:
        """The KV pool's staging strategy and the host pool's (release, leak checks, peers)."""
        return self.staging, self.host_staging

    def tell(self, endpoint: str, msg: Message) -> bool:
        """Tell a peer's control endpoint ``msg`` (non-blocking, bounded; False when the
        peer's queue is full and it was dropped). Any thread. Named apart from
        :meth:`KVSender.send <kvwire.session.sender.KVSender.send>`, which queues KV."""
        ok = self.channel.send(endpoint, msg)
        if not ok:
            m.DROPPED.labels(**self.labels, reason="send_full").inc()
        return ok

    def finish(self, room: int, status: KVPoll, t0: float) -> None:
        """Record a room's terminal status in the process metrics."""
        m.REQUESTS.labels(**self.labels, result=status.name).inc()
        m.REQUEST_SECONDS.labels(**self.labels).observe(time.perf_counter() - t0)


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
