"""Prefill side: handshakes with decode ranks, per-request :class:`KVSender`, transfer workers.

Flow of one request on a prefill rank:

1. The engine creates ``mgr.sender(room)``; the room is ``Bootstrapping``.
2. Each decode rank fed by this rank sends a :class:`~kvwire.control.wire.TransferRequest`
   (destination pages and aux row). A request may arrive before the sender exists; it is kept
   for ``bootstrap_timeout_s`` at most. Once every expected decode rank has asked (``Td/Tp`` of
   them when decode is larger, else one), the room is ``WaitingForInput``.
3. The engine calls ``init(num_pages, aux_index)`` and then ``send(pages, last=...)`` once per
   chunk of chunked prefill; each call only enqueues work for the destination's worker
   (``Transferring``). Chunks sent earlier than step 2 completes are held and flushed then.
4. A worker maps the chunk through the link's index mapper (via the staging strategy), submits
   one transfer tagged with a :class:`~kvwire.control.wire.ChunkNote`, waits for it, and after
   the last chunk writes the aux row (when this rank is the aux sender for that decode rank) or,
   when the last chunk carried no KV, sends a :class:`~kvwire.control.wire.Completion` marker.
5. When every destination is done the room is ``Success``. Any failure fails the room, is pushed
   to every destination, and is re-raised by ``failure_exception()``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from kvwire.backend import Notification, PreparedPair, TransferHandle
from kvwire.control.bootstrap import BootstrapClient, RankInfo
from kvwire.control.handshake import (
    aux_problems,
    build_mapper,
    handshake_problems,
    slot_table,
    topology_for,
)
from kvwire.control.wire import (
    PROTOCOL_MAJOR,
    Failure,
    Hello,
    HelloAck,
    HelloReject,
    Message,
    TransferRequest,
    WritesDone,
    WritesQuery,
    pages_from_bytes,
)
from kvwire.errors import (
    BootstrapError,
    ConfigError,
    DescriptorError,
    KVWireError,
    TransferError,
)
from kvwire.index.base import IndexMapper, TablePair, check_pages
from kvwire.index.topology import Topology
from kvwire.layout import MemoryRegion
from kvwire.selection import select_host_mapper
from kvwire.session import metrics as m
from kvwire.session.common import RequestHandle, Side
from kvwire.session.manager import KVManager
from kvwire.session.metrics import RequestMetrics
from kvwire.session.peers import Peer
from kvwire.session.pipeline import Pipeline
from kvwire.session.poll import KVPoll
from kvwire.session.segments import KindSplit, split_tables
from kvwire.session.workers import TransferWorkers
from kvwire.staging.base import QueuedChunk, StagingStrategy

if TYPE_CHECKING:
    from kvwire.control.bootstrap_server import BootstrapServer

logger = logging.getLogger(__name__)


@dataclass
class PoolLink:
    """One pool of a decode rank this prefill rank can write into: decode's KV pool
    ("kv"), or a host pool ("host"), each with its own mapper, prepared table and strategy."""

    mapper: IndexMapper
    #: Slots of the destination pool (decode's indices are checked against it).
    slots: int
    #: Name of the prepared pair holding the mapper's tables.
    table: str
    strategy: StagingStrategy
    #: The strategy prepared tables of its own for this link (it stages or maps).
    staged: bool


@dataclass
class DecodeLink:
    """Everything prepared for one decode rank (one handshake)."""

    mapper: IndexMapper
    backend_peer: str
    #: Prepared table pairs by name: "kv" (the mapper's), "aux", and a staging strategy's.
    pairs: dict[str, PreparedPair]
    aux_rows: int
    #: Who sends to whom between this prefill instance and that decode instance.
    topology: Topology
    decode_tp_rank: int
    sends_aux: bool
    dummy: bool
    #: The decode rank's pools this rank can write into, by the name decode's requests use.
    pools: dict[str, PoolLink] = field(default_factory=dict)
    #: Why a pool decode may ask for is not usable (e.g. its host pool is incompatible).
    pool_problems: dict[str, str] = field(default_factory=dict)
    #: Pairs whose rows mix memory kinds: their chunks move as one segment per kind pair.
    splits: dict[str, KindSplit] = field(default_factory=dict)


@dataclass
class Dest:
    """One decode rank's part of a room."""

    session: str
    endpoint: str
    dst_pages: NDArray[np.int64]
    aux_index: int
    #: Decode ranks this prefill rank feeds for the request (it waits for all of them).
    fan_out: int
    next_chunk: int = 0
    done: bool = False
    #: The decode pool the request goes to (a key of ``DecodeLink.pools``).
    pool: str = "kv"


@dataclass
class SendRoom:
    """State of one request on this prefill rank; removed on clear()."""

    room: int
    t0: float = field(default_factory=time.perf_counter)
    created: float = field(default_factory=time.monotonic)
    num_pages: int | None = None
    aux_index: int | None = None
    dests: dict[str, Dest] = field(default_factory=dict)
    expected: int | None = None
    held: list[tuple[NDArray[np.int64], bool]] = field(default_factory=list)
    #: Pages accepted from send() so far, and pages handed to workers so far.
    pages_queued: int = 0
    pages_dispatched: int = 0
    last_queued: bool = False
    ready: bool = False
    error: BaseException | None = None
    failed_at: float = 0.0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


#: Early failures kept at most (a flood of failures for unknown rooms cannot grow memory).
MAX_EARLY_FAILURES = 65536
#: Answers to unsigned hellos (a decode rank without the secret) per second, at most.
UNSIGNED_REPLIES_PER_S = 20


class PrefillSide(Side[SendRoom]):
    """The prefill role of a :class:`~kvwire.session.manager.KVManager`.

    Lock contract: room tables (``rooms``, ``early``, ``early_failures``,
    ``writes_inflight``) are guarded by ``mgr.lock``, held only for table updates and queue
    puts, never across an engine call or a wait. Handlers run on the liveness thread.
    """

    #: The handler of every wire message kind on prefill (kind -> method).
    HANDLERS: ClassVar[dict[str, str]] = {
        "hello": "_on_hello",
        "transfer_request": "_on_request",
        "failure": "on_failure",
        "writes_query": "_on_writes_query",
        "hello_ack": "not_for_role",
        "hello_reject": "not_for_role",
        "completion": "not_for_role",
        "note": "not_for_role",
        "writes_done": "not_for_role",
    }

    def __init__(self, mgr: KVManager, bootstrap_addr: str | None) -> None:
        super().__init__(mgr)
        #: Transfer requests for rooms whose sender does not exist yet: room -> decode session
        #: -> (destination, arrival time). Expire after ``bootstrap_timeout_s``.
        self.early: dict[int, dict[str, tuple[Dest, float]]] = {}
        #: Failures pushed by decode for rooms whose sender does not exist yet (decode failed
        #: before prefill knew the request): room -> (reason, arrival time). Same expiry.
        self.early_failures: dict[int, tuple[str, float]] = {}
        #: Rooms that failed here and were cleared: room -> (reason, time). A decode rank whose
        #: request arrives late is answered with the failure. Same expiry and bound.
        self.recent_failures: dict[int, tuple[str, float]] = {}
        self._unsigned_replies: list[float] = []
        #: Writes posted and not ended, per (room, decode session).
        self.writes_inflight: dict[tuple[int, str], int] = {}
        self.sender_id = mgr.layout.rank.sender_id
        opts = mgr.options
        self.workers: TransferWorkers[Job] = TransferWorkers(
            opts.num_workers,
            mgr.agent_name,
            lambda i: Pipeline(self, i),
            inline=opts.sync_transfers,
        )
        self.handshakes = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix=f"kvwire-hs-{mgr.agent_name}"
        )
        self.server: BootstrapServer | None = None
        r = mgr.layout.rank
        if bootstrap_addr is None:
            if not (opts.run_bootstrap and r.tp_rank == 0 and r.pp_rank == 0 and r.dp_rank == 0):
                raise ConfigError(
                    f"prefill rank tp={r.tp_rank} pp={r.pp_rank} dp={r.dp_rank} needs "
                    "bootstrap_addr (the address prefill rank 0's bootstrap service listens on)"
                )
            from kvwire.control.bootstrap_server import BootstrapServer

            self.server = BootstrapServer(
                opts.bootstrap_host, opts.bootstrap_port, mgr.config.secret_bytes
            ).start()
            bootstrap_addr = self.server.address
        self.bootstrap_addr: str = bootstrap_addr
        self.info = RankInfo(
            tp_rank=r.tp_rank,
            pp_rank=r.pp_rank,
            dp_rank=r.dp_rank,
            tp_size=r.tp_size,
            pp_size=r.pp_size,
            dp_size=mgr.dp_size,
            endpoint=mgr.channel.endpoint,
            agent=mgr.agent_name,
            session=mgr.session,
            protocol=PROTOCOL_MAJOR,
        )
        self.client = BootstrapClient(bootstrap_addr, mgr.config.secret_bytes)
        try:
            self._register(opts.bootstrap_timeout_s)
        except BaseException:
            self.close()
            raise

    def _register(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client.register(self.info)
                return
            except BootstrapError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def queued_chunks(self) -> int:
        """Chunks queued for the transfer workers and not yet taken by one. Any thread."""
        return self.workers.queued

    # ------------------------------------------------------------ liveness thread
    def _on_hello(self, msg: Message) -> None:
        """Liveness thread: a decode rank's hello; answered on a handshake thread."""
        assert isinstance(msg, Hello)
        self.handshakes.submit(self._handshake, msg)

    def on_unsigned(self, msg: Message) -> None:
        """Liveness thread: a hello without the MAC this rank requires. Tell its sender why
        (signed, rate-limited), so decode fails at once naming the secret instead of timing
        out; nothing else is done with it."""
        if not isinstance(msg, Hello):
            return
        now = time.monotonic()
        self._unsigned_replies = [t for t in self._unsigned_replies if now - t < 1.0]
        if len(self._unsigned_replies) >= UNSIGNED_REPLIES_PER_S:
            return
        self._unsigned_replies.append(now)
        reason = (
            "the prefill rank requires signed control messages (a shared secret, "
            "KVWIRE_SECRET, is set on prefill) but this decode rank sent none: set the "
            "same KVWIRE_SECRET on both sides"
        )
        logger.warning("%s: refused an unsigned hello from %s", self.mgr.agent_name, msg.agent)
        reject = HelloReject(
            session=self.mgr.session,
            peer_session=msg.session,
            reason=reason,
            problems=["secret: prefill=set decode=unset"],
        )
        # a stranger: no socket is kept for its (possibly made-up) endpoint
        self.mgr.channel.send_once(msg.endpoint, reject)

    def _handshake(self, hello: Hello) -> None:
        """Handshake thread: validate a decode rank, add it to the backend, prepare tables."""
        mgr = self.mgr
        with mgr.lock:
            known = mgr.peers.get(hello.session)
        if known is not None:  # a retried hello: answer again
            self._ack(hello, known.link)
            return
        problems = handshake_problems(mgr.layout, hello.layout, mgr.backend_name, hello.backend)
        problems += aux_problems(mgr.aux_regions, hello.aux_regions)
        if problems:
            self._reject(hello, "incompatible layouts", problems)
            return
        # The same agent name with a new session: a restart, or two live instances sharing
        # an explicit name. A restart reuses nothing alive: its old endpoint is the new one,
        # or the old incarnation went quiet. A live namesake is refused (the engines key
        # peers by name, so the two would evict each other).
        quiet_s = mgr.options.heartbeat_interval_s * 1.5
        for old in mgr.peers.by_agent(hello.agent):
            alive = time.monotonic() - old.last_seen < quiet_s
            if old.endpoint != hello.endpoint and alive:
                self._reject(
                    hello,
                    f"agent name {hello.agent!r} is already used by a live decode rank at "
                    f"{old.endpoint}",
                    [
                        "give every decode instance a unique agent_name, or leave it unset "
                        "(the default name is unique)"
                    ],
                )
                return
            mgr.evict(old.session, "it restarted (new session)")
        try:
            mapper = build_mapper(mgr.config, mgr.layout, hello.layout)
            extra = mgr.staging.link_tables(mapper, hello.staging)
            name = mgr.backend.add_peer(hello.backend_metadata)
            pairs = {
                "aux": mgr.backend.prepare(
                    name, slot_table(mgr.aux_regions), slot_table(hello.aux_regions)
                )
            }
            splits: dict[str, KindSplit] = {}
            local = mgr.layout.buffers
            if not mapper.is_dummy:
                self._prepare(
                    name, "kv", mapper.build_tables(), local, hello.layout.buffers, pairs, splits
                )
            for table_name, tp in extra.items():
                pairs[table_name] = mgr.backend.prepare(name, tp.src, tp.dst)
            host_mapper, host_problem = self._host_mapper(hello)
            host_extra: dict[str, Any] = {}
            if host_mapper is not None:
                assert hello.host_layout is not None
                host_tables = host_mapper.build_tables()
                self._prepare(
                    name, "host", host_tables, local, hello.host_layout.buffers, pairs, splits
                )
                # last: the strategy may map decode's pool for this link
                host_extra = mgr.host_staging.link_tables(
                    host_mapper, hello.host_staging, session=hello.session, tables=host_tables
                )
                for table_name, tp in host_extra.items():
                    pairs[table_name] = mgr.backend.prepare(name, tp.src, tp.dst)
            r = mgr.layout.rank
            topo = topology_for(mgr.config, mgr.layout, r.tp_size, r.pp_size, hello.rank.tp_size)
            pools = {"kv": PoolLink(mapper, hello.layout.num_slots, "kv", mgr.staging, bool(extra))}
            if host_mapper is not None:
                assert hello.host_layout is not None
                pools["host"] = PoolLink(
                    host_mapper,
                    hello.host_layout.num_slots,
                    "host",
                    mgr.host_staging,
                    bool(host_extra),
                )
            link = DecodeLink(
                mapper=mapper,
                backend_peer=name,
                pairs=pairs,
                aux_rows=len(mgr.aux_regions),
                topology=topo,
                decode_tp_rank=hello.rank.tp_rank,
                sends_aux=topo.aux_sender(hello.rank.tp_rank) == self.sender_id,
                dummy=mapper.is_dummy,
                pools=pools,
                pool_problems={} if host_mapper is not None else {"host": host_problem},
                splits=splits,
            )
        except KVWireError as exc:
            mgr.host_staging.peer_lost(hello.session)  # unmap what link_tables may have mapped
            self._reject(hello, f"handshake failed on prefill: {exc}", [])
            return
        mgr.add_peer(Peer(hello.session, hello.agent, hello.endpoint, time.monotonic(), link=link))
        logger.info(
            "%s: handshake with %s (%s mapper%s%s)",
            mgr.agent_name,
            hello.agent,
            mapper.name,
            ", dummy" if mapper.is_dummy else "",
            ", staged" if extra else "",
        )
        self._ack(hello, link)

    def _prepare(
        self,
        peer: str,
        name: str,
        tables: TablePair,
        src_regions: Sequence[MemoryRegion],
        dst_regions: Sequence[MemoryRegion],
        pairs: dict[str, PreparedPair],
        splits: dict[str, KindSplit],
    ) -> None:
        """Handshake: prepare ``tables`` as pair ``name``, or as one pair per (source kind,
        destination kind) when either side mixes VRAM and DRAM regions."""
        parts, split = split_tables(name, tables, src_regions, dst_regions)
        for table_name, tp in parts.items():
            pairs[table_name] = self.mgr.backend.prepare(peer, tp.src, tp.dst)
        if split is not None:
            splits[name] = split

    def _host_mapper(self, hello: Hello) -> tuple[IndexMapper | None, str]:
        """The mapper into a decode rank's host pool, or why there is none. Regular requests
        work either way."""
        host = hello.host_layout
        if host is None:
            return None, "the decode rank has no host pool"
        problems = [
            p
            for p in handshake_problems(self.mgr.layout, host, self.mgr.backend_name, hello.backend)
            if not p.startswith("page_size")
        ]
        if problems:
            return None, "host pool incompatible: " + "; ".join(problems)
        try:
            sel = select_host_mapper(self.mgr.config)
            mapper: IndexMapper = sel.cls(self.mgr.layout, host, sel.options)
        except KVWireError as exc:
            return None, f"no usable host pool mapper: {exc}"
        return mapper, ""

    def _ack(self, hello: Hello, link: DecodeLink) -> None:
        mgr = self.mgr
        mgr.send(
            hello.endpoint,
            HelloAck(
                session=mgr.session,
                agent=mgr.agent_name,
                endpoint=mgr.channel.endpoint,
                rank=mgr.layout.rank,
                sender_id=self.sender_id,
                layout_hash=mgr.layout.compatibility_hash(),
                dummy=link.dummy,
                peer_session=hello.session,
                layout=mgr.layout,
                staged=link.pools["kv"].staged,
            ),
        )

    def _reject(self, hello: Hello, reason: str, problems: list[str]) -> None:
        logger.warning(
            "%s: refused handshake from %s: %s %s",
            self.mgr.agent_name,
            hello.agent,
            reason,
            problems,
        )
        self.mgr.send(
            hello.endpoint,
            HelloReject(
                session=self.mgr.session,
                peer_session=hello.session,
                reason=reason,
                problems=problems,
            ),
        )

    def _on_request(self, msg: TransferRequest) -> None:
        mgr = self.mgr
        with mgr.lock:
            peer = mgr.peers.get(msg.session)
            if peer is None:
                logger.warning(
                    "%s: transfer request for room %d from unknown session %s dropped",
                    mgr.agent_name,
                    msg.room,
                    msg.session,
                )
                return
            peer.last_seen = time.monotonic()
            link: DecodeLink = peer.link
            try:
                target = link.pools.get(msg.pool)
                if target is None:
                    why = link.pool_problems.get(msg.pool, "no such pool")
                    raise ConfigError(f"cannot write into decode pool {msg.pool!r}: {why}")
                pages = check_pages(
                    pages_from_bytes(msg.dst_pages), target.slots, "decode's page indices"
                )
                if not 0 <= msg.aux_index < mgr.aux_slots:
                    raise DescriptorError(
                        f"decode's aux index {msg.aux_index} is outside [0, {mgr.aux_slots})"
                    )
                if msg.state_indices:
                    raise ConfigError("state buffers are not supported by this kvwire version")
            except KVWireError as exc:
                mgr.send(
                    peer.endpoint,
                    Failure(room=msg.room, session=mgr.session, reason=f"refused: {exc}"),
                )
                return
            dest = Dest(
                msg.session,
                peer.endpoint,
                pages,
                msg.aux_index,
                len(link.topology.targets(mgr.layout.rank.tp_rank)),
                pool=msg.pool,
            )
            room = self.rooms.get(msg.room)
            failed = self.recent_failures.get(msg.room)
            if room is not None and room.error is not None:
                failed = (str(room.error), 0.0)
            if failed is not None:  # the request already failed here: tell decode now
                mgr.send(
                    peer.endpoint,
                    Failure(room=msg.room, session=mgr.session, reason=failed[0]),
                )
                return
            if room is None:
                self.early.setdefault(msg.room, {})[msg.session] = (dest, time.monotonic())
                return
            self._add_dest(room, dest)

    def _add_dest(self, room: SendRoom, dest: Dest) -> None:
        """Under the manager lock: a decode rank's request joins its room."""
        if self.mgr.status.get(room.room, KVPoll.Bootstrapping) is KVPoll.Failed:
            return
        expected = dest.fan_out
        if room.expected is not None and room.expected != expected:
            self._fail(
                room,
                TransferError("decode ranks of one request disagree on decode TP", room=room.room),
            )
            return
        room.expected = expected
        room.dests[dest.session] = dest
        self._maybe_ready(room)

    def _maybe_ready(self, room: SendRoom) -> None:
        if room.ready or room.expected is None or len(room.dests) < room.expected:
            return
        room.ready = True
        self.mgr.status.update(room.room, KVPoll.WaitingForInput)
        held, room.held = room.held, []
        for pages, last in held:
            self._dispatch(room, pages, last)

    def on_notification(self, note: Notification) -> None:
        """Prefill receives no data-plane notifications in WRITE mode; ignore strays."""
        logger.debug("%s: unexpected notification from %s", self.mgr.agent_name, note.peer)

    def on_failure(self, msg: Message) -> None:
        """Liveness thread: a decode rank failed or aborted a room. Accepted from a room's
        destination, or, while the room still waits for its destinations, from any
        authenticated decode rank (one that failed before or during its handshake, e.g. on
        a layout mismatch). A failure for a room with no sender yet is kept (bounded, expiring
        like early requests) and fails the sender when the engine creates it."""
        assert isinstance(msg, Failure)
        what = "aborted" if msg.aborted else "failed"
        with self.mgr.lock:
            self._drop_early(msg.room, msg.session)
            room = self.rooms.get(msg.room)
            if room is None:
                if len(self.early_failures) < MAX_EARLY_FAILURES:
                    reason = f"decode {what} the request: {msg.reason}"
                    self.early_failures[msg.room] = (reason, time.monotonic())
                return
            if msg.session not in room.dests and room.ready:
                return  # not one of this room's destinations
            err = TransferError(f"decode {what} the request: {msg.reason}", room=msg.room)
            self._fail(room, err, skip=msg.session)

    def on_peer_lost(self, peer: Peer, why: str) -> None:
        """Control thread: a decode rank is dead or gone; fail its rooms, drop its tables."""
        mgr = self.mgr
        with mgr.lock:
            for room_id in list(self.early):
                self._drop_early(room_id, peer.session)
            for room in list(self.rooms.values()):
                if peer.session in room.dests and not self._terminal(room):
                    err = TransferError(
                        f"decode peer {peer.agent} lost: {why}", room=room.room, peer=peer.agent
                    )
                    self._fail(room, err, skip=peer.session)
        mgr.later(lambda: self._release_peer(peer))

    def _release_peer(self, peer: Peer) -> None:
        """Progress thread: drop an evicted decode rank's engine and strategy state."""
        mgr = self.mgr
        for strategy in mgr.strategies:
            strategy.peer_lost(peer.session)
        link: DecodeLink | None = peer.link
        if link is not None and link.backend_peer in mgr.backend.peers():
            try:
                mgr.backend.remove_peer(link.backend_peer)
            except KVWireError as exc:
                logger.warning("%s: remove_peer(%s): %s", mgr.agent_name, peer.agent, exc)

    def check_deadlines(self, now: float) -> None:
        """Control thread: bootstrap timeouts and expiry of early requests."""
        limit = self.mgr.options.bootstrap_timeout_s
        with self.mgr.lock:
            for room_id, by_session in list(self.early.items()):
                for s, (_msg, t) in list(by_session.items()):
                    if now - t > limit:
                        self._drop_early(room_id, s)
            for table in (self.early_failures, self.recent_failures):
                for room_id, (_reason, t) in list(table.items()):
                    if now - t > limit:
                        del table[room_id]
            for room in list(self.rooms.values()):
                if not room.ready and now - room.created > limit and not self._terminal(room):
                    got = len(room.dests)
                    want = "?" if room.expected is None else str(room.expected)
                    hint = ""
                    unsigned = self.mgr.channel.dropped.get("unauthenticated", 0)
                    if unsigned:
                        hint = (
                            f"; {unsigned} control frames were dropped as unauthenticated "
                            "(a decode rank without this rank's KVWIRE_SECRET?)"
                        )
                    self._fail(
                        room,
                        TransferError(
                            f"bootstrap timeout: {got} of {want} decode ranks sent their "
                            f"metadata within {limit:.1f}s{hint}",
                            room=room.room,
                        ),
                    )

    def _drop_early(self, room_id: int, session: str) -> None:
        by = self.early.get(room_id)
        if by is not None:
            by.pop(session, None)
            if not by:
                del self.early[room_id]

    # --------------------------------------------------------------- engine thread
    def create_room(self, room_id: int) -> SendRoom:
        """Engine thread (KVSender creation): a new room, picking up early requests."""
        with self.mgr.lock:
            room = self._add_room(SendRoom(room_id))
            early_failure = self.early_failures.pop(room_id, None)
            if early_failure is not None:
                self._fail(room, TransferError(early_failure[0], room=room_id))
            for s, (dest, _t) in self.early.pop(room_id, {}).items():
                if s in self.mgr.peers:
                    self._add_dest(room, dest)
            return room

    def init(self, room: SendRoom, num_pages: int, aux_index: int) -> None:
        """Engine thread: the request's page count and aux row are known."""
        if num_pages < 0:
            raise ConfigError(f"num_pages must be >= 0, got {num_pages}")
        if not 0 <= aux_index < self.mgr.aux_slots:
            raise DescriptorError(
                f"aux_index {aux_index} is outside [0, {self.mgr.aux_slots}) (the aux rows "
                "this manager was built with)"
            )
        with self.mgr.lock:
            room.num_pages = num_pages
            room.aux_index = aux_index

    def send(self, room: SendRoom, pages: Any, last: bool) -> None:
        """Engine thread: queue one chunk; never blocks on the transfer."""
        mgr = self.mgr
        with mgr.lock:
            status = mgr.status.get(room.room, KVPoll.Failed)
            if status is KVPoll.Success:
                raise ConfigError(
                    f"room {room.room}: send() after the request succeeded (every chunk was "
                    "already delivered); the chunk is not sent"
                )
        try:
            arr = check_pages(pages, mgr.layout.num_slots, "page indices")
        except KVWireError as exc:
            with mgr.lock:
                self._fail(room, TransferError(f"bad pages in send(): {exc}", room=room.room))
            raise
        with mgr.lock:
            if self._terminal(room):
                return
            problem = None
            if room.num_pages is None or room.aux_index is None:
                problem = "send() before init(num_pages, aux_index)"
            elif room.last_queued:
                problem = "send() after the last chunk was sent"
            elif room.pages_queued + arr.size > room.num_pages:
                problem = (
                    f"chunks add up to {room.pages_queued + arr.size} pages but init() "
                    f"declared {room.num_pages}"
                )
            elif last and room.pages_queued + arr.size != room.num_pages:
                problem = (
                    f"last chunk ends at page {room.pages_queued + arr.size} of the "
                    f"{room.num_pages} declared by init(); KV would be missing on decode"
                )
            if problem is not None:
                err = ConfigError(f"room {room.room}: {problem}")
                self._fail(room, err)
                raise err
            room.last_queued = last
            room.pages_queued += arr.size
            if not room.ready:
                room.held.append((arr, last))
                return
            self._dispatch(room, arr, last)

    def _dispatch(self, room: SendRoom, pages: NDArray[np.int64], last: bool) -> None:
        """Under the lock: split a chunk per destination and hand it to that worker."""
        assert room.num_pages is not None
        mgr = self.mgr
        start = room.pages_dispatched
        end = room.pages_dispatched = start + pages.size
        mgr.status.update(room.room, KVPoll.Transferring)
        for dest in room.dests.values():
            peer = mgr.peers.get(dest.session)
            if peer is None:
                continue
            link: DecodeLink = peer.link
            target = link.pools[dest.pool]
            try:
                src, lo, hi = target.mapper.chunk_slice(
                    room.num_pages, dest.dst_pages, pages, start, end
                )
            except KVWireError as exc:
                self._fail(room, TransferError(str(exc), room=room.room))
                return
            chunk_id = None
            if src.size and not link.dummy:
                chunk_id = dest.next_chunk
                dest.next_chunk += 1
                if target.staged:
                    chunk = QueuedChunk(
                        room.room,
                        chunk_id,
                        target.mapper,
                        int(src.size),
                        lo,
                        dest.session,
                        dest.endpoint,
                        self.sender_id,
                        mgr.session,
                        mgr.options.transfer_timeout_s,
                    )
                    try:
                        target.strategy.on_queued(chunk)
                    except KVWireError as exc:
                        self._fail(room, exc)
                        return
            job = Job(
                room,
                dest,
                link,
                src,
                dest.dst_pages[lo:hi],
                chunk_id,
                last,
                time.perf_counter(),
                pool=dest.pool,
            )
            self.workers.submit(dest.session, job)

    # ------------------------------------------------------------------ workers
    def is_dead(self, room: SendRoom) -> bool:
        """Worker thread: the request is terminal or was cleared (its work is skipped)."""
        with self.mgr.lock:
            return self._terminal(room) or self.rooms.get(room.room) is not room

    def record(
        self,
        room: SendRoom,
        handle: TransferHandle,
        t_start: float,
        t_posted: float,
        t_done: float,
        t_enqueued: float | None,
    ) -> None:
        """Worker thread: account a completed transfer in the request's and process metrics."""
        mt = room.metrics
        with self.mgr.lock:
            mt.bytes += handle.num_bytes
            mt.descriptors += handle.num_descs
            mt.chunks += 1
            if t_enqueued is not None:
                mt.queue_s += t_start - t_enqueued
            mt.post_s += t_posted - t_start
            mt.transfer_s += t_done - t_posted
        lb = self.mgr.labels
        m.BYTES.labels(**lb).inc(handle.num_bytes)
        m.DESCRIPTORS.labels(**lb).inc(handle.num_descs)
        m.CHUNKS.labels(**lb, result="ok").inc()
        if t_enqueued is not None:
            m.QUEUE_SECONDS.labels(**lb).observe(t_start - t_enqueued)
        m.POST_SECONDS.labels(**lb).observe(t_posted - t_start)
        m.TRANSFER_SECONDS.labels(**lb).observe(t_done - t_posted)

    def _on_writes_query(self, msg: WritesQuery) -> None:
        """Control thread: decode asks whether it may reuse a failed request's pages (or a
        cleared request's ring space): answer once no write of ours is in flight."""
        with self.mgr.lock:
            room = self.rooms.get(msg.room)
            if room is not None and not self._terminal(room):
                return  # still live here: its tail releases the space when it ends
            if self.writes_inflight.get((msg.room, msg.session), 0):
                return  # a write is still in flight; decode asks again
            peer = self.mgr.peers.get(msg.session)
        if peer is not None:
            self.mgr.send(
                peer.endpoint,
                WritesDone(room=msg.room, sender_id=self.sender_id, session=self.mgr.session),
            )

    def writes_posted(self, room: int, dest: str, delta: int) -> None:
        """Worker thread: count writes in flight per (request, destination)."""
        key = (room, dest)
        with self.mgr.lock:
            n = self.writes_inflight.get(key, 0) + delta
            if n > 0:
                self.writes_inflight[key] = n
            else:
                self.writes_inflight.pop(key, None)

    def abandon(self, room: SendRoom, dest: Dest, target: PoolLink) -> None:
        """Worker thread: nothing more will be written to ``dest`` for this request."""
        target.strategy.on_abandoned(
            room.room, dest.session, dest.endpoint, self.sender_id, self.mgr.session
        )

    def fail(self, room: SendRoom, exc: BaseException) -> None:
        """Any thread: fail the request (once), tell its destinations."""
        with self.mgr.lock:
            self._fail(room, exc)

    def dest_done(self, room: SendRoom, dest: Dest) -> None:
        """Worker thread: a destination has every chunk and its aux row."""
        with self.mgr.lock:
            dest.done = True
            if all(d.done for d in room.dests.values()) and not self._terminal(room):
                self.succeed(room)

    # ---------------------------------------------------------------- failures
    def _fail(
        self, room: SendRoom, exc: BaseException, skip: str | None = None, aborted: bool = False
    ) -> None:
        """Under the lock: fail a room once, record why, tell every other destination."""
        mgr = self.mgr
        if not self._mark_failed(room, exc):
            return
        logger.warning("%s: room %d failed: %s", mgr.agent_name, room.room, exc)
        msg = Failure(room=room.room, session=mgr.session, reason=str(exc), aborted=aborted)
        for d in room.dests.values():
            if d.session != skip:
                mgr.send(d.endpoint, msg)

    def clear(self, room: SendRoom) -> None:
        """Engine thread: forget the room (every terminal path ends here)."""
        with self.mgr.lock:
            if (
                self._forget(room)
                and room.error is not None
                and len(self.recent_failures) < MAX_EARLY_FAILURES
            ):
                self.recent_failures[room.room] = (str(room.error), time.monotonic())
            for s in list(self.early.get(room.room, {})):
                self._drop_early(room.room, s)
        for strategy in self.mgr.strategies:
            strategy.release(room.room)

    def room_tables(self) -> dict[str, int]:
        """Per-room table sizes (leak check)."""
        with self.mgr.lock:
            return {
                "send_rooms": len(self.rooms),
                "early_requests": len(self.early),
                "writes_inflight": len(self.writes_inflight),
                **{k: v for st in self.mgr.strategies for k, v in st.room_tables().items()},
            }

    def close(self) -> None:
        """Manager shutdown: fail live rooms, stop workers and the bootstrap service."""
        with self.mgr.lock:
            self._fail_live("prefill manager closed")
        self.workers.stop()
        self.handshakes.shutdown(wait=False, cancel_futures=True)
        try:
            self.client.deregister(self.info)
        except BootstrapError as exc:
            logger.debug("deregister: %s", exc)
        if self.server is not None:
            self.server.stop()


@dataclass
class Job:
    """One chunk of one request for one destination, queued for that destination's worker."""

    room: SendRoom
    dest: Dest
    link: DecodeLink
    src: NDArray[np.int64]
    dst: NDArray[np.int64]
    chunk_id: int | None
    last: bool
    t_enqueued: float
    #: Decode pool the chunk goes to (a key of ``DecodeLink.pools``).
    pool: str = "kv"

    @property
    def target(self) -> PoolLink:
        """The link's pool this job writes into (its mapper, table and strategy)."""
        return self.link.pools[self.pool]


class KVSender(RequestHandle[SendRoom]):
    """Prefill side of one request. Created by the engine with ``mgr.sender(room)``.

    Engine thread calls, in order: :meth:`init` once, :meth:`send` once per chunk (the last with
    ``last=True``), :meth:`poll` each scheduler step, and :meth:`clear` once the request is
    finished (on every path: success, failure, abort). None of them blocks on a transfer.
    Unknown rooms poll as ``WaitingForInput`` (the decode side may not have asked yet).
    """

    unknown_status = KVPoll.WaitingForInput

    def __init__(self, side: PrefillSide, room: int) -> None:
        super().__init__(side, room, side.create_room(room))

    def init(self, num_pages: int, aux_index: int) -> None:
        """Declare the request's number of KV pages and its aux row index on this rank."""
        self._side.init(self._state, num_pages, aux_index)

    def send(self, page_indices: Any, last: bool = False, state_indices: Any | None = None) -> None:
        """Queue one chunk of chunked prefill (page slots of this rank's pool, in request
        order). Raises :class:`~kvwire.errors.DescriptorError` or ``ConfigError`` on bad input
        (the room is failed and decode is told)."""
        if state_indices is not None:
            raise ConfigError(
                "state buffers (hybrid models) are not supported yet; pass state_indices=None"
            )
        self._side.send(self._state, page_indices, last)
