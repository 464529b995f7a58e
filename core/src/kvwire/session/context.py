"""The rank context: what every part of one rank's session layer shares, built first.

A :class:`RankContext` holds, for one rank, what is fixed once the rank is up: its identity
(role, agent name, session id, metric labels), its layouts and aux rows, its transfer
backend(s) with the memory registered, the codec and control channel, the staging strategy of
each pool, the peers it has handshaken with, and three verbs:

* :meth:`RankContext.tell` sends a control message to a peer (any thread);
* :meth:`RankContext.later` runs a chore on the progress thread (an
  :class:`~kvwire.owner_loop.OwnerLoop` the context owns; the façade gives it its step);
* :meth:`RankContext.evict` forgets a dead or departed peer (its rooms are failed by whoever
  :meth:`RankContext.watch_peers` registered, the role's side).

It is built by :class:`~kvwire.session.manager.KVManager` (the engine-facing façade) before
the role's side, and handed down to the side, its links and its workers. Nothing in it refers
to a side or to the façade, so nothing below the façade imports ``manager.py``.

Lock contract: the context's own fields are set in the constructor and not rebound (the
tables it holds have their own locks: :class:`~kvwire.session.peers.PeerTable`, and
:attr:`RankContext.engine_peers_lock` for :attr:`RankContext.engine_peers`). The room lock is
the :class:`~kvwire.session.rooms.RoomTable`'s, not the context's.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import TypeAdapter

from kvwire.backend import TransferBackend
from kvwire.config import AUTO, KVWireConfig
from kvwire.control.channel import ControlChannel
from kvwire.control.wire import Codec, Message, PoolName
from kvwire.errors import ConfigError, LayoutError
from kvwire.layout import KVLayout, MemKind, MemoryRegion
from kvwire.owner_loop import OwnerLoop, Wake
from kvwire.security import enforce_secret_policy
from kvwire.selection import create_backends, select_pool_staging, staging_candidates
from kvwire.session import metrics as m
from kvwire.session.peers import Peer, PeerTable
from kvwire.staging.base import StagingContext, StagingStrategy
from kvwire.timer_slack import set_thread_slack

logger = logging.getLogger(__name__)

#: Bytes of kvwire's own aux row (the room stamp, padded to 64 bytes for RDMA).
STAMP_ROW_BYTES = 64
#: Transfer workers of a prefill rank when neither the operator
#: (``ControlOptions.num_workers``) nor the backend
#: (:meth:`~kvwire.backend.TransferBackend.workers_wanted`) says.
DEFAULT_WORKERS = 4


class Role(enum.StrEnum):
    """Which side of the disaggregated pair a rank serves."""

    PREFILL = "prefill"
    DECODE = "decode"


#: ``pool -> room id -> that room's destination pages in the pool`` (any thread); given by
#: the owner of the rooms (:meth:`~kvwire.session.rooms.RoomTable.pages`).
RoomPages = Callable[[int, str], Any]


_POOL_NAME: TypeAdapter[str] = TypeAdapter(PoolName)


def kv_staging(
    config: KVWireConfig, kinds: set[MemKind], context: StagingContext, agent: str
) -> StagingStrategy:
    """Manager startup: the KV pool's staging strategy, set up. The first candidate of
    :func:`~kvwire.selection.staging_candidates` whose ``setup`` succeeds; under ``auto`` a
    candidate that cannot set up here (no view of the pool's GPU memory, no memory left for
    its ring, a backend that cannot register it) is logged with the reason and the next one
    is tried, so the default never stops a rank from starting. A named strategy's failure
    raises."""
    candidates = staging_candidates(config, kinds)
    for i, sel in enumerate(candidates):
        strategy: StagingStrategy = sel.cls(sel.options)
        try:
            strategy.setup(context)
        except Exception as exc:
            strategy.close()
            if i == len(candidates) - 1:
                raise
            logger.warning(
                "%s: staging %r cannot serve the KV pool here (%s: %s); trying %r",
                agent, sel.name, type(exc).__name__, exc, candidates[i + 1].name,
            )  # fmt: skip
            continue
        took = strategy.memory()
        if config.staging == AUTO:
            logger.info("%s: staging auto -> %s (KV pool in %s memory)%s", agent, sel.name,
                        "/".join(sorted(k.name for k in kinds)),
                        f"; {took}" if took else "")  # fmt: skip
        elif took:
            logger.info("%s: staging %s; %s", agent, sel.name, took)
        return strategy
    raise AssertionError("staging_candidates always ends with 'direct'")


class RankContext:
    """One rank's shared, fixed state and its verbs (see the module docstring).

    Built by the façade at startup; raises (with everything it built released) on a bad
    configuration, an unusable backend or a layout the backend cannot register.
    """

    def __init__(
        self,
        config: KVWireConfig,
        role: Role | str,
        layout: KVLayout,
        *,
        room_pages: RoomPages,
        aux_buffers: Sequence[MemoryRegion] = (),
        dp_size: int = 1,
        agent_name: str | None = None,
        kv_tensors: Any = None,
        pools: Mapping[str, KVLayout] | None = None,
        hooks: Any = None,
    ) -> None:
        enforce_secret_policy(config.require_secret, config.secret_bytes, "this kvwire rank")
        self.config = config
        self.role = Role(role)
        self.layout = layout
        extra = dict(pools or {})
        #: Every pool of this rank by name: "kv" (``layout``) and, on decode, the extra pools
        #: the engine declared (``KVManager(pools=...)``), which requests may choose
        #: (``send_metadata(..., pool=name)``). Fixed after construction.
        self.pool_layouts: dict[str, KVLayout] = {"kv": layout, **extra}
        #: Decode only: the engine's :class:`~kvwire.session.receiver.DecodeHooks`, called for
        #: requests into an extra pool.
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
        if "kv" in extra:
            raise ConfigError("pools: 'kv' is the KV pool (the layout argument); name others")
        if extra and self.role is not Role.DECODE:
            raise ConfigError(f"pools {sorted(extra)} (extra decode pools) are for decode managers")
        for name in extra:
            try:
                _POOL_NAME.validate_python(name)
            except ValueError as exc:
                raise ConfigError(f"pool name {name!r} is not a valid pool name: {exc}") from exc
        #: Handshaken peers and their last sign of life (own lock).
        self.peers = PeerTable()
        #: Engine peer name -> the session that added it (prefill: decode ranks added to
        #: the backend). Guarded by :attr:`engine_peers_lock`, which serialises adding and
        #: removing peers in the engine (handshake threads, progress thread); never taken
        #: together with the room lock.
        self.engine_peers: dict[str, str] = {}
        self.engine_peers_lock = threading.Lock()
        self._peer_lost: list[Callable[[Peer, str], None]] = []

        slots = {b.num_items for b in aux_buffers}
        if len(slots) > 1:
            raise LayoutError(f"aux buffers must have the same number of rows; got {sorted(slots)}")
        self.aux_slots: int = slots.pop() if slots else self.options.aux_slots
        #: kvwire's own aux row per slot: the room stamp decode checks the aux row against.
        self.stamps: NDArray[np.uint64] = np.zeros(
            (self.aux_slots, STAMP_ROW_BYTES // 8), dtype=np.uint64
        )
        self.aux_regions = [
            MemoryRegion.from_pointer(self.stamps.ctypes.data, self.stamps.nbytes, STAMP_ROW_BYTES),
            *aux_buffers,
        ]

        extra_buffers = tuple(b for lay in extra.values() for b in lay.buffers)
        groups = layout.group_regions  # state, sliding-window and draft-layer buffers
        kinds = {b.kind for b in (*layout.buffers, *groups, *aux_buffers, *extra_buffers)}
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
        #: queued (a backend that pushes events), by :meth:`later` and by :meth:`stop`.
        self.wake = Wake()
        self.backend.set_notification_waker(self.wake.set)
        #: Transfer workers of a prefill rank: the operator's number, else the backend's.
        self.num_workers: int = (
            self.options.num_workers or self.backend.workers_wanted() or DEFAULT_WORKERS
        )
        #: Wakes prefill's transfer workers (set by the prefill side once they exist); a
        #: staging strategy calls it through ``StagingContext.wake_fn`` when a grant comes.
        self.wake_workers: Callable[[], None] = lambda: None
        built: list[StagingStrategy] = []
        try:
            self.backend.register([*layout.buffers, *groups, *extra_buffers, *self.aux_regions])
            context = StagingContext(
                layout,
                self.backend.register,
                self.backend.deregister,
                role=self.role.value,
                num_workers=self.num_workers,
                kv_tensors=kv_tensors,
                send_fn=self.tell,
                session=self.session,
                room_pages=lambda room: room_pages(room, "kv"),
                wake_fn=lambda: self.wake_workers(),
            )
            #: Strategy of chunks into the KV pool (``KVWireConfig.staging``; ``auto``:
            #: bulk staging for a GPU pool, direct elsewhere, see :func:`kv_staging`).
            self.staging: StagingStrategy = kv_staging(
                config, {b.kind for b in layout.buffers}, context, self.agent_name
            )
            built.append(self.staging)
            #: Staging strategy per pool: "kv" is :attr:`staging`; an extra pool's is
            #: ``KVWireConfig.pools[name].staging``. Decode builds one per declared pool;
            #: prefill builds one when a decode rank first announces the pool
            #: (:meth:`strategy_for`). Copy on write: an add replaces the dict (under
            #: :attr:`_stagings_lock`), so readers on any thread take no lock.
            self.stagings: dict[str, StagingStrategy] = {"kv": self.staging}
            self._stagings_lock = threading.Lock()
            self._staging_context = context
            self._room_pages = room_pages
            for name in extra:
                built.append(self._build_strategy(name))
            self.codec = Codec(config.secret_bytes)
            self.channel = ControlChannel(
                self.codec,
                self.options.host,
                self.options.send_hwm,
                local=self.options.local_control,
                agent=self.agent_name,
            )
        except BaseException:
            for strategy in built:
                strategy.close()
            self.backend.close()
            raise
        #: The progress thread: runs :meth:`later`'s chores, then the step the façade gives
        #: :meth:`start` (engine progress, notifications, deadlines).
        # its step waits on ``wake`` (set by every poster), never on a pipe
        self.progress = OwnerLoop(f"kvwire-progress-{self.agent_name}", self._step, pipe=False)
        self._progress_step: Callable[[], None] = lambda: None
        self._stop = threading.Event()
        if self.options.metrics_port is not None:
            m.serve_metrics(self.options.metrics_port)

    def _build_strategy(self, pool: str) -> StagingStrategy:
        """Build, set up and record the strategy of extra pool ``pool`` (under
        :attr:`_stagings_lock` or during construction)."""
        sel = select_pool_staging(self.config, pool)
        strategy: StagingStrategy = sel.cls(sel.options)
        strategy.setup(
            dataclasses.replace(
                self._staging_context,
                pool_layout=self.pool_layouts.get(pool),
                pool=pool,
                room_pages=lambda room: self._room_pages(room, pool),
            )
        )
        self.stagings = {**self.stagings, pool: strategy}
        return strategy

    def strategy_for(self, pool: str) -> StagingStrategy:
        """The staging strategy of ``pool`` (prefill, handshake thread: built on the first
        decode rank that announces the pool; raises ``KVWireError`` if it cannot be)."""
        with self._stagings_lock:
            found = self.stagings.get(pool)
            return found if found is not None else self._build_strategy(pool)

    def staging_of(self, pool: str) -> StagingStrategy | None:
        """The strategy of ``pool`` if this rank has one (any thread), else None."""
        return self.stagings.get(pool)

    @property
    def strategies(self) -> tuple[StagingStrategy, ...]:
        """Every pool's staging strategy, "kv" first (release, leak checks, peers). Any
        thread, no lock."""
        return tuple(self.stagings.values())

    # ---------------------------------------------------------------------- verbs
    def one_worker(self, peer: str) -> bool:
        """Prefill's engine thread, at a request's first chunk to backend peer ``peer``: the
        link's backend wants one worker (``cudaipc``) and the operator set no
        ``num_workers``, so the chunks of every such link share one worker queue."""
        return self.options.num_workers is None and self.backend.workers_wanted(peer) == 1

    def tell(self, endpoint: str, msg: Message) -> bool:
        """Tell a peer's control endpoint ``msg`` (non-blocking, bounded; False when the
        peer's queue is full and it was dropped). Any thread. Named apart from
        :meth:`KVSender.send <kvwire.session.sender.KVSender.send>`, which queues KV."""
        ok = self.channel.tell(endpoint, msg)
        if not ok:
            m.DROPPED.labels(**self.labels, reason="send_full").inc()
        return ok

    def later(self, chore: Callable[[], None]) -> None:
        """Run ``chore`` on the progress thread (engine calls the liveness thread must not
        make, such as removing an evicted peer from the engine). Any thread."""
        self.progress.post(chore)
        self.wake.set()

    def add_peer(self, peer: Peer) -> None:
        """Handshake threads: start tracking a peer's liveness (after a successful handshake)."""
        self.peers.add(peer)

    def watch_peers(self, on_lost: Callable[[Peer, str], None]) -> None:
        """Called once by the façade after the side is built: ``on_lost(peer, why)`` runs for
        every evicted peer (on the evicting thread, before its socket is dropped)."""
        self._peer_lost.append(on_lost)

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
        for on_lost in self._peer_lost:
            on_lost(peer, why)
        self.channel.disconnect(peer.endpoint)

    @property
    def timer_slack_us(self) -> float | None:
        """The timer slack this rank's liveness, progress and worker threads ask for when they
        start (:mod:`kvwire.timer_slack`): ``ControlOptions.timer_slack_us`` where the backend
        is polled (it does not :attr:`~kvwire.backend.TransferBackend.pushes_events`: NIXL,
        Mooncake, a backend list), whose short timed polls it makes end on time; None (the
        default slack) where events wake every wait on a request's path (``cudaipc``,
        ``tcp``): there it bought nothing and ``cudaipc`` at C=8 moved 5-12% less with it
        (docs/benchmarks.md, "Timer slack")."""
        return None if self.backend.pushes_events else self.options.timer_slack_us

    # ------------------------------------------------------------ progress thread
    def start(self, step: Callable[[], None]) -> None:
        """Called once by the façade after the side is built: start the progress thread,
        which runs the posted chores and then ``step`` (which waits at most a tick, on
        :attr:`wake`) until :meth:`stop`."""
        self._progress_step = step
        slack = self.timer_slack_us

        def first() -> None:  # the first thing the progress thread runs
            set_thread_slack(slack)

        self.progress.post(first)
        self.progress.start()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called (the liveness loop ends on it too)."""
        return self._stop.is_set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Engine thread (shutdown): end the progress thread (chores already posted still
        run on it)."""
        self._stop.set()
        self.wake.set()
        self.progress.stop(timeout_s)

    def _step(self) -> None:
        if not self._stop.is_set():
            self._progress_step()

    def close(self) -> None:
        """Engine thread, after :meth:`stop` and the side's close: release the strategies,
        the backend and the channel."""
        for strategy in self.strategies:
            strategy.close()
        self.backend.close()
        self.channel.close()

    # -------------------------------------------------------------------- metrics
    def _on_failover(self, peer: str, src: str, dst: str, why: str) -> None:
        """A link's backend failed and its transfers moved to ``dst`` (any thread)."""
        m.FAILOVERS.labels(**self.labels, src=src, dst=dst).inc()

    def _on_recovery(self, peer: str, backend: str) -> None:
        """A link's failed backend reconnected and takes its transfers again (probe thread)."""
        m.RECOVERIES.labels(**self.labels, backend=backend).inc()
