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

Engines create one :class:`~kvwire.session.prefill.KVSender` or
:class:`~kvwire.session.decode.KVReceiver` per request from it (:meth:`KVManager.sender`,
:meth:`KVManager.receiver`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from kvwire.backend import TransferBackend
from kvwire.config import KVWireConfig
from kvwire.control.channel import ControlChannel
from kvwire.control.wire import Codec, Failure, Goodbye, Heartbeat, Message
from kvwire.errors import ConfigError, LayoutError
from kvwire.layout import KVLayout, MemoryRegion
from kvwire.selection import select_backend, select_host_staging, select_staging
from kvwire.session import metrics as m
from kvwire.session.poll import KVPoll, StatusTable
from kvwire.staging.base import StagingContext, StagingStrategy

if TYPE_CHECKING:
    from kvwire.session.decode import DecodeSide, KVReceiver
    from kvwire.session.prefill import KVSender, PrefillSide

logger = logging.getLogger(__name__)

#: Bytes of kvwire's own aux row (the room stamp, padded to 64 bytes for RDMA).
STAMP_ROW_BYTES = 64
#: Longest the control thread sleeps waiting for a message (also the notification drain period),
#: while no request waits on a notification, and while some do.
CONTROL_TICK_S = 0.001
CONTROL_TICK_BUSY_S = 0.0002


class Role(enum.StrEnum):
    """Which side of the disaggregated pair a manager serves."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Peer:
    """A remote manager this one talks to (decode ranks on prefill, prefill ranks on decode)."""

    session: str
    agent: str
    endpoint: str
    last_seen: float
    #: Role-specific link state (prepared tables on prefill, sender id on decode).
    link: Any = field(default=None, repr=False)


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
    size, e.g. 1) that requests can choose per request (``send_metadata(..., hisparse=True)``);
    ``hooks`` (a :class:`~kvwire.session.decode.DecodeHooks`) is told when such a request is
    preallocated and when it is admitted or abandoned.
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
    ) -> None:
        self.config = config
        self.role = Role(role)
        self.layout = layout
        self.host_layout = host_layout
        self.hooks = hooks
        self.options = config.control
        self.session = secrets.token_hex(8)
        r = layout.rank
        self.agent_name = agent_name or (
            f"{self.role.value}-dp{r.dp_rank}-pp{r.pp_rank}-tp{r.tp_rank}"
        )
        if dp_size < 1 or r.dp_rank >= dp_size:
            raise LayoutError(f"dp_rank {r.dp_rank} is not below dp_size {dp_size}")
        self.dp_size = dp_size
        self.labels = {"role": self.role.value, "agent": self.agent_name}
        self.status = StatusTable()
        self.lock = threading.RLock()
        self.peers: dict[str, Peer] = {}
        self._stop = threading.Event()
        self._closed = False
        self._cleanup: list[Any] = []

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

        if host_layout is not None and self.role is not Role.DECODE:
            raise ConfigError("host_layout (the HiSparse host pool) is for decode managers")
        host_buffers = tuple(host_layout.buffers) if host_layout is not None else ()
        kinds = {b.kind for b in (*layout.buffers, *aux_buffers, *host_buffers)}
        sel = select_backend(config, kinds=kinds)
        self.backend_name = sel.name
        self.backend: TransferBackend = sel.cls(self.agent_name, sel.options)
        try:
            self.backend.register([*layout.buffers, *host_buffers, *self.aux_regions])
            context = StagingContext(
                layout,
                self.backend.register,
                self.backend.deregister,
                role=self.role.value,
                num_workers=self.options.num_workers,
                kv_tensors=kv_tensors,
                send_fn=lambda endpoint, msg: self.send(endpoint, msg),
            )
            ssel = select_staging(config)
            self.staging: StagingStrategy = ssel.cls(ssel.options)
            self.staging.setup(context)
            hsel = select_host_staging(config)
            #: Strategy for chunks into a decode host pool (HiSparse path); see
            #: ``KVWireConfig.host_staging``.
            self.host_staging: StagingStrategy = hsel.cls(hsel.options)
            self.host_staging.setup(dataclasses.replace(context, host_layout=host_layout))
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

                self.side = PrefillSide(self, bootstrap_addr)
            else:
                from kvwire.session.decode import DecodeSide

                self.side = DecodeSide(self)
        except BaseException:
            self._release_resources()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"kvwire-control-{self.agent_name}", daemon=True
        )
        self._thread.start()
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
        from kvwire.session.prefill import KVSender, PrefillSide

        if not isinstance(self.side, PrefillSide):
            raise ConfigError("sender() is for prefill managers; this one is decode")
        return KVSender(self.side, room)

    def receiver(
        self, room: int, bootstrap_addr: str, prefill_dp_rank: int | None = None
    ) -> KVReceiver:
        """Decode: the receiver of request ``room`` whose prefill instance registered at
        ``bootstrap_addr``; bootstrapping (lookup and handshakes) starts in the background."""
        from kvwire.session.decode import DecodeSide, KVReceiver

        if not isinstance(self.side, DecodeSide):
            raise ConfigError("receiver() is for decode managers; this one is prefill")
        return KVReceiver(self.side, room, bootstrap_addr, prefill_dp_rank)

    def room_tables(self) -> dict[str, int]:
        """Sizes of every per-room table (a leak check: all zero once every room is cleared)."""
        out = {"status": len(self.status)}
        out.update(self.side.room_tables())
        return out

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
            peers = list(self.peers.values())
        for p in peers:
            self.channel.send(p.endpoint, Goodbye(session=self.session))
        self._stop.set()
        self._thread.join(5.0)
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

    # --------------------------------------------------------------- control thread
    def _run(self) -> None:
        interval = self.options.heartbeat_interval_s
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                tick = CONTROL_TICK_BUSY_S if self.side.awaiting_data() else CONTROL_TICK_S
                for msg in self.channel.receive(tick):
                    self._dispatch(msg)
                self.backend.progress()
                for note in self.backend.get_notifications():
                    self.side.on_notification(note)
                now = time.monotonic()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + interval
                self._check_peers(now)
                self.side.check_deadlines(now)
            except Exception:
                logger.exception("%s: control loop error; continuing", self.agent_name)
                time.sleep(CONTROL_TICK_S)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Heartbeat):
            self.touch(msg.session)
        elif isinstance(msg, Goodbye):
            self.evict(msg.session, "it closed (goodbye)")
        elif isinstance(msg, Failure):
            self.touch(msg.session)
            self.side.on_failure(msg)
        else:
            self.side.on_message(msg)

    def touch(self, session: str) -> None:
        """Record a sign of life from a peer."""
        with self.lock:
            p = self.peers.get(session)
            if p is not None:
                p.last_seen = time.monotonic()

    def _beat(self) -> None:
        with self.lock:
            endpoints = [p.endpoint for p in self.peers.values()]
        beat = Heartbeat(session=self.session, sent_at=time.time())
        for ep in endpoints:
            self.channel.send(ep, beat)

    def _check_peers(self, now: float) -> None:
        limit = self.options.heartbeat_interval_s * self.options.heartbeat_misses
        with self.lock:
            dead = [p.session for p in self.peers.values() if now - p.last_seen > limit]
        for s in dead:
            self.evict(s, f"no heartbeat for {limit:.1f}s")

    def add_peer(self, peer: Peer) -> None:
        """Start tracking a peer's liveness (after a successful handshake)."""
        with self.lock:
            self.peers[peer.session] = peer

    def evict(self, session: str, why: str) -> None:
        """Forget a dead or departed peer everywhere: its rooms fail, its backend state and its
        socket are dropped. Called by the control thread (heartbeats, goodbye) or a restart."""
        with self.lock:
            peer = self.peers.pop(session, None)
        if peer is None:
            return
        level = logging.INFO if "goodbye" in why else logging.WARNING
        logger.log(level, "%s: evicting %s (%s): %s", self.agent_name, peer.agent, session, why)
        m.EVICTIONS.labels(**self.labels).inc()
        self.side.on_peer_lost(peer, why)
        self.channel.disconnect(peer.endpoint)

    @property
    def strategies(self) -> tuple[StagingStrategy, StagingStrategy]:
        """The KV pool's staging strategy and the host pool's (release, leak checks, peers)."""
        return self.staging, self.host_staging

    def send(self, endpoint: str, msg: Message) -> bool:
        """Send a control message (non-blocking, bounded)."""
        ok = self.channel.send(endpoint, msg)
        if not ok:
            m.DROPPED.labels(**self.labels, reason="send_full").inc()
        return ok

    def finish(self, room: int, status: KVPoll, t0: float) -> None:
        """Record a room's terminal status in the process metrics."""
        m.REQUESTS.labels(**self.labels, result=status.name).inc()
        m.REQUEST_SECONDS.labels(**self.labels).observe(time.perf_counter() - t0)
