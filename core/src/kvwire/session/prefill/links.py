"""Prefill side: the decode ranks a prefill rank writes to — handshakes (validation, engine
peers, prepared descriptor tables per pool) and what one prepared link holds.

Lock contract: :class:`DecodeLinker` keeps no table of its own: a finished link goes into the
manager's :class:`~kvwire.session.peers.PeerTable` (its own lock). Handshakes run on the
linker's handshake threads (engine calls: ``add_peer``, ``prepare``), never on the liveness
thread, and hold no lock across an engine call.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvwire.backend import LinkChoice, PreparedPair
from kvwire.control.reach import endpoint_host, is_local, is_loopback
from kvwire.control.wire import Hello, HelloAck, HelloReject, Message
from kvwire.errors import KVWireError
from kvwire.index.base import IndexMapper, TablePair
from kvwire.index.groups import GroupMapper
from kvwire.index.topology import Topology
from kvwire.layout import KVLayout, MemoryRegion
from kvwire.movers.warmup import Warmer
from kvwire.selection import select_pool_mapper
from kvwire.session.aux_note import carries_aux
from kvwire.session.checksums import SentSums
from kvwire.session.group_sums import SentGroupSums
from kvwire.session.handshake import (
    aux_problems,
    build_mapper,
    handshake_problems,
    slot_table,
    topology_for,
)
from kvwire.session.peers import Peer
from kvwire.session.prefill.evictions import EvictionBook
from kvwire.session.prefill.warm import warm_link
from kvwire.session.segments import KindSplit, split_tables
from kvwire.staging.base import StagingStrategy

if TYPE_CHECKING:
    from kvwire.session.context import RankContext

logger = logging.getLogger(__name__)

#: Prepared pair name of a link's buffer-group tables.
GROUPS_TABLE = "state"

#: Answers to unsigned hellos (a decode rank without the secret) per second, at most.
UNSIGNED_REPLIES_PER_S = 20

#: How often a handshake waiting to tell a restart from a live namesake looks again.
NAMESAKE_POLL_S = 0.01


@dataclass
class PoolLink:
    """One pool of a decode rank this prefill rank can write into: decode's KV pool
    ("kv"), or an extra pool it announced (``Hello.pools``), each with its own mapper,
    prepared table and strategy."""

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
    #: Why a pool decode announced is not usable (e.g. incompatible, or no mapper for it).
    pool_problems: dict[str, str] = field(default_factory=dict)
    #: Pairs whose rows mix memory kinds: their chunks move as one segment per kind pair.
    splits: dict[str, KindSplit] = field(default_factory=dict)
    #: The layouts' buffer groups (state, sliding window, draft layers), moved after a
    #: request's last chunk through pair ``"state"``; None when the layouts have none.
    groups: GroupMapper | None = None
    #: Per-layer checksums of KV chunks, when decode asked for them (``Hello.checksum``).
    checksums: SentSums | None = None
    #: ...and of its buffer groups' rows, when it moves any (1.14).
    group_sums: SentGroupSums | None = None
    #: The backend the link uses, its fallbacks, and why other offers were passed over.
    choice: LinkChoice | None = None
    #: The aux row rides in the last chunk's note (decode takes it: ``Hello.aux_in_note``;
    #: both sides' aux rows in host memory). (1.11)
    aux_in_note: bool = False
    #: Why a worker's lean lane never carries this link's KV (None: it may, a request whose
    #: only chunk the backend's lane takes; :func:`lane_problem`, set at the handshake).
    lane_problem: str | None = "not decided"

    @property
    def sends_groups(self) -> bool:
        """Whether this rank moves group bytes to that decode rank (one note per request)."""
        return self.groups is not None and self.groups.sends


def lane_problem(link: DecodeLink, offered: bool) -> str | None:
    """Handshake thread, once the link is built: why the lean lane
    (:mod:`kvwire.session.prefill.lane`) never carries the link's KV chunks, or None
    (``offered``: the rank's backend has a lane). The lane moves a request's whole chunk as
    pages in place with its note, so it leaves to the general path what needs more."""
    kv = link.pools["kv"]
    checks = (
        (not offered, "the backend offers none"),
        (link.checksums is not None, "KV checksums are on"),
        (link.sends_groups, "the link moves buffer groups"),
        (link.dummy, "this rank sends no KV to it"),
        (link.sends_aux and not link.aux_in_note, "the aux row moves as a write of its own"),
        (kv.staged, "the link is staged"),
        (kv.table in link.splits, "its KV rows mix memory kinds"),
        (kv.table not in link.pairs, "no prepared KV tables"),
    )
    return next((why for hit, why in checks if hit), None)


class DecodeLinker:
    """Answers decode ranks' hellos for one prefill rank: validates, adds the engine peer,
    prepares every table pair, acks (or rejects, naming every problem)."""

    def __init__(
        self,
        ctx: RankContext,
        lock: threading.RLock,
        sender_id: int,
        evictions: EvictionBook,
        release_first: Callable[[str], None],
    ) -> None:
        self.ctx = ctx
        #: The room lock (:class:`~kvwire.session.rooms.RoomTable`): a new peer and the end
        #: of its eviction are one step for the liveness thread's request handling.
        self.lock = lock
        self.sender_id = sender_id
        #: The decode sessions this rank evicted (a rejoining one is forgotten there).
        self.evictions = evictions
        #: Releases what an earlier eviction of a session left in the engine, now.
        self.release_first = release_first
        self._unsigned_replies: list[float] = []
        #: Sessions a handshake is waiting on to tell a restart from a live namesake (see
        #: :meth:`_namesake_alive`); its own lock, held for set operations only.
        self._namesake_lock = threading.Lock()
        self._namesake_waits: set[str] = set()
        self.handshakes = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix=f"kvwire-hs-{ctx.agent_name}"
        )
        #: Sums each checksummed link's first page once, compiling its hasher's kernel.
        self._warmer = Warmer("checksums")

    def on_hello(self, msg: Message) -> None:
        """Liveness thread: a decode rank's hello; answered on a handshake thread."""
        assert isinstance(msg, Hello)
        self.handshakes.submit(self._answer, msg, time.monotonic())

    def _answer(self, hello: Hello, arrived: float) -> None:
        """Handshake thread: :meth:`handshake`, and a rejection naming the error if it raised
        where it does not answer itself (decode would otherwise wait out its handshake
        timeout, and the error would go unlogged)."""
        try:
            self.handshake(hello, arrived)
        except Exception as exc:
            logger.exception("%s: handshake with %s failed", self.ctx.agent_name, hello.agent)
            self._reject(hello, f"handshake failed on prefill: {type(exc).__name__}: {exc}", [])

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
        logger.warning("%s: refused an unsigned hello from %s", self.ctx.agent_name, msg.agent)
        reject = HelloReject(
            session=self.ctx.session,
            peer_session=msg.session,
            reason=reason,
            problems=["secret: prefill=set decode=unset"],
        )
        # a stranger: no socket is kept for its (possibly made-up) endpoint
        self.ctx.channel.tell_once(msg.endpoint, reject)

    def handshake(self, hello: Hello, arrived: float | None = None) -> None:
        """Handshake thread: validate a decode rank, add it to the backend, prepare tables.
        ``arrived``: when the liveness thread took the hello (now when not given)."""
        arrived = time.monotonic() if arrived is None else arrived
        ctx = self.ctx
        known = ctx.peers.get(hello.session)
        if known is not None:  # a retried hello: answer again
            self._ack(hello, known.link)
            return
        theirs = [n for n, _ in hello.offers()]
        problems = handshake_problems(ctx.layout, hello.layout, ctx.backend_names, theirs)
        problems += aux_problems(ctx.aux_regions, hello.aux_regions)
        if problems:
            self._reject(hello, "incompatible layouts", problems)
            return
        unreachable = self._data_loopback(hello)
        if unreachable is not None:
            self._reject(hello, "unreachable data plane", [unreachable])
            return
        # The same agent name with a new session: a restart, or two live instances sharing
        # an explicit name. A restart reuses nothing alive: its old endpoint is the new one,
        # or the old incarnation went quiet. A live namesake is refused (the engines key
        # peers by name, so the two would evict each other).
        stale: list[str] = []
        for old in ctx.peers.by_agent(hello.agent):
            if old.endpoint != hello.endpoint and self._namesake_alive(old, arrived):
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
            ctx.evict(old.session, "it restarted (new session)")
            if old.link is not None:
                stale.append(old.link.backend_peer)
        try:
            self.release_first(hello.session)  # evicted earlier (silent) and back
            mapper = build_mapper(ctx.config, ctx.layout, hello.layout)
            choice = self._add_engine_peer(hello, stale)
            # the per-link rule's staging advice, applied by the KV pool's strategy
            applied = ctx.staging.link_staging(
                mapper, hello.staging, choice.staging, session=hello.session
            )
            extra = applied.tables
            name = choice.peer
            pairs = {
                "aux": ctx.backend.prepare(
                    name, slot_table(ctx.aux_regions), slot_table(hello.aux_regions)
                )
            }
            splits: dict[str, KindSplit] = {}
            local = ctx.layout.buffers
            if not mapper.is_dummy:
                self._prepare(
                    name, "kv", mapper.build_tables(), local, hello.layout.buffers, pairs, splits
                )
            for table_name, tp in extra.items():
                pairs[table_name] = ctx.backend.prepare(name, tp.src, tp.dst)
            groups, gt = mapper.group_mapper(), None
            if groups is not None and groups.sends:
                kinds = {r.kind for r in (*ctx.layout.group_regions, *hello.layout.group_regions)}
                if len(kinds) > 1:
                    raise KVWireError(
                        "buffer groups that mix VRAM and DRAM regions are not supported yet; "
                        "keep every group buffer in one memory kind"
                    )
                gt = groups.build_tables()
                pairs[GROUPS_TABLE] = ctx.backend.prepare(name, gt.src, gt.dst)
            checksums = None
            group_sums = None
            if hello.checksum and not mapper.is_dummy:
                checksums = SentSums(mapper, ctx.layout)
            if hello.checksum and gt is not None:
                group_sums = SentGroupSums(ctx.layout, gt)
            extra_links: dict[str, PoolLink] = {}
            pool_problems: dict[str, str] = {}
            for pool, (pool_layout, described) in hello.extra_pools().items():
                pool_mapper, problem = self._pool_mapper(pool, pool_layout, hello)
                if pool_mapper is None:
                    pool_problems[pool] = problem
                    continue
                try:
                    strategy = ctx.strategy_for(pool)
                except KVWireError as exc:
                    pool_problems[pool] = f"no usable {pool} pool staging strategy: {exc}"
                    continue
                tables = pool_mapper.build_tables()
                self._prepare(name, pool, tables, local, pool_layout.buffers, pairs, splits)
                # last: the strategy may map decode's pool for this link
                pool_extra = strategy.link_tables(
                    pool_mapper, described, session=hello.session, tables=tables
                )
                for table_name, tp in pool_extra.items():
                    pairs[table_name] = ctx.backend.prepare(name, tp.src, tp.dst)
                extra_links[pool] = PoolLink(
                    pool_mapper, pool_layout.num_slots, pool, strategy, bool(pool_extra)
                )
            r = ctx.layout.rank
            topo = topology_for(
                ctx.config, ctx.layout, r.tp_size, r.pp_size, hello.rank.tp_size, hello.rank.pp_size
            )
            kv = PoolLink(mapper, hello.layout.num_slots, "kv", ctx.staging, bool(extra))
            pools = {"kv": kv, **extra_links}
            link = DecodeLink(
                mapper=mapper,
                backend_peer=name,
                pairs=pairs,
                aux_rows=len(ctx.aux_regions),
                topology=topo,
                decode_tp_rank=hello.rank.tp_rank,
                sends_aux=topo.aux_sender(hello.rank.tp_rank) == self.sender_id,
                dummy=mapper.is_dummy,
                pools=pools,
                pool_problems=pool_problems,
                splits=splits,
                groups=groups,
                checksums=checksums,
                group_sums=group_sums,
                choice=choice,
                aux_in_note=hello.aux_in_note and carries_aux(ctx.aux_regions),
            )
            link.lane_problem = lane_problem(link, ctx.backend.page_lane is not None)
        except Exception as exc:  # a plugin's error included: decode must hear why, now
            if not isinstance(exc, KVWireError):
                logger.exception("%s: handshake with %s failed", ctx.agent_name, hello.agent)
            for strategy in ctx.strategies[1:]:  # unmap what link_tables may have mapped
                strategy.peer_lost(hello.session)
            self._reject(hello, f"handshake failed on prefill: {exc}", [])
            return
        with self.lock:  # a request from it is now served, or answered before the ack goes out
            ctx.add_peer(
                Peer(hello.session, hello.agent, hello.endpoint, time.monotonic(), link=link)
            )
            self.evictions.rejoined(hello.session)
        logger.info(
            "%s: handshake with %s (%s mapper%s%s); %s; staging advice %r, applied: %s; "
            "lean lane: %s",
            ctx.agent_name,
            hello.agent,
            mapper.name,
            ", dummy" if mapper.is_dummy else "",
            ", staged" if extra else "",
            choice.describe(),
            choice.staging,
            applied.why,
            "whole-request page writes" if link.lane_problem is None else link.lane_problem,
        )
        kv = link.pools["kv"]
        warm_link(ctx, link.pairs.get(kv.table), kv.mapper.page_geometry, kv.staged)
        sums = None if link.checksums is None else link.checksums.warm_up()
        if sums is not None:
            self._warmer.submit(f"KV checksums for {hello.agent}", sums)
        self._ack(hello, link)

    def _namesake_alive(self, old: Peer, arrived: float) -> bool:
        """Handshake thread: whether ``old``, a peer known under the agent name of a new
        session that says hello from another endpoint, is alive. Decided by evidence, not by
        how recently it was heard: a live rank is heard at least every heartbeat interval,
        so it is alive when heard after the hello arrived, and gone (a restart) once it has
        been quiet for 1.5 intervals. Waits for whichever comes first: a restart faster than
        that waits out the rest (at most 1.5 intervals), where judging by the last sign of
        life alone refused it as a live namesake. Its silence is judged by when it was
        heard, not by ``last_seen`` (which a stall of the liveness thread moves later). One
        hello at a time waits on a given namesake; another one meanwhile is refused at once.
        Lock contract: ``_namesake_lock`` guards the set of namesakes waited on and nothing
        else, and is never held while waiting."""
        quiet_s = self.ctx.options.heartbeat_interval_s * 1.5
        if old.heard + quiet_s <= time.monotonic():
            return old.heard > arrived
        with self._namesake_lock:
            if old.session in self._namesake_waits:
                # another hello under this name is already waiting on the same namesake: this
                # one is refused at once, so hellos under a taken name cannot hold every
                # handshake thread
                return True
            self._namesake_waits.add(old.session)
        try:
            while not self.ctx.stopping:
                heard = old.heard
                if heard > arrived:
                    return True
                left = heard + quiet_s - time.monotonic()
                if left <= 0:
                    return False
                time.sleep(min(left, NAMESAKE_POLL_S))
            return False
        finally:
            with self._namesake_lock:
                self._namesake_waits.discard(old.session)

    def _data_loopback(self, hello: Hello) -> str | None:
        """Handshake thread: why this rank could not reach the decode rank's data plane: the
        engine metadata of a backend both sides have advertises loopback while the rank
        itself is on another host (its control endpoint is not an address of this host).
        None when nothing is wrong that this can tell (engines that do not say, or one
        host)."""
        peer_host = endpoint_host(hello.endpoint)
        if is_local(peer_host):
            return None
        for name, metadata in hello.offers():
            if name not in self.ctx.backend_names:
                continue
            try:
                hosts = self.ctx.backend.advertised_hosts(metadata)
            except Exception:
                continue  # bad metadata: add_link reports it with its own words
            bad = [h for h in hosts if is_loopback(h)]
            if bad:
                return (
                    f"decode rank {hello.agent} at {peer_host} advertises its {name} data "
                    f"endpoint on loopback ({bad[0]}), which this prefill rank on another host "
                    f"cannot reach: set the backend's address on decode "
                    f"(--transfer-backend-option host=ADDR or advertise_host=ADDR)"
                )
        return None

    def _add_engine_peer(self, hello: Hello, stale: list[str]) -> LinkChoice:
        """Handshake thread: add the decode rank to the engine (over the first backend both
        sides have that can serve the link: :meth:`~kvwire.backend.TransferBackend.add_link`).
        ``stale``: the engine names of the incarnations it replaces (a restart, usually under
        the same name): what they left in the engine goes first, and the name's owner becomes
        the new session, so the old incarnation's deferred release
        (:meth:`PrefillSide._release_peer`) cannot remove the new one's state. Lock contract:
        ``ctx.engine_peers_lock`` around the engine's add and remove of peers, never with
        the room lock."""
        ctx = self.ctx
        with ctx.engine_peers_lock:
            for n in stale:
                owner = ctx.engine_peers.pop(n, hello.session)
                if owner != hello.session and n in ctx.backend.peers():
                    ctx.backend.remove_peer(n)
            kinds = frozenset(b.kind for b in hello.layout.buffers)
            choice = ctx.backend.add_link(hello.offers(), hello.host, kinds or None)
            ctx.engine_peers[choice.peer] = hello.session
            return choice

    def remove_engine_peer(self, peer: Peer) -> None:
        """Progress thread (or a handshake thread): remove an evicted decode rank's peer from
        the engine, unless a restarted incarnation owns the name by now. Takes
        ``engine_peers_lock``, never with the room lock."""
        ctx, link = self.ctx, peer.link
        with ctx.engine_peers_lock:
            if ctx.engine_peers.get(link.backend_peer) != peer.session:
                return
            del ctx.engine_peers[link.backend_peer]
            if link.backend_peer in ctx.backend.peers():
                try:
                    ctx.backend.remove_peer(link.backend_peer)
                except KVWireError as exc:
                    logger.warning("%s: remove_peer(%s): %s", ctx.agent_name, peer.agent, exc)

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
            pairs[table_name] = self.ctx.backend.prepare(peer, tp.src, tp.dst)
        if split is not None:
            splits[name] = split

    def _pool_mapper(
        self, pool: str, layout: KVLayout, hello: Hello
    ) -> tuple[IndexMapper | None, str]:
        """The mapper into a decode rank's extra pool ``pool``, or why there is none.
        Requests into its other pools work either way."""
        problems = [
            p
            for p in handshake_problems(
                self.ctx.layout, layout, self.ctx.backend_names, [n for n, _ in hello.offers()]
            )
            if not p.startswith(("page_size", "group "))  # groups move on the KV link
        ]
        if problems:
            return None, f"{pool} pool incompatible: " + "; ".join(problems)
        try:
            sel = select_pool_mapper(self.ctx.config, pool)
            mapper: IndexMapper = sel.cls(self.ctx.layout, layout, sel.options)
        except KVWireError as exc:
            return None, f"no usable {pool} pool mapper: {exc}"
        return mapper, ""

    def _ack(self, hello: Hello, link: DecodeLink) -> None:
        ctx = self.ctx
        ctx.tell(
            hello.endpoint,
            HelloAck(
                session=ctx.session,
                agent=ctx.agent_name,
                endpoint=ctx.channel.endpoint,
                rank=ctx.layout.rank,
                sender_id=self.sender_id,
                layout_hash=ctx.layout.compatibility_hash(hello.layout.model.page_size),
                dummy=link.dummy,
                peer_session=hello.session,
                layout=ctx.layout,
                staged=link.pools["kv"].staged,
                groups=link.sends_groups,
                checksum=hello.checksum and (link.dummy or link.checksums is not None),
                group_checksum=link.group_sums is not None,
                backend=link.choice.backend if link.choice is not None else "",
                fallbacks=list(link.choice.fallbacks) if link.choice is not None else [],
                local_control=ctx.channel.local_name,
            ),
        )
        # after the answer: frames that follow it may take the local socket
        ctx.channel.set_local(hello.endpoint, hello.local_control)

    def _reject(self, hello: Hello, reason: str, problems: list[str]) -> None:
        logger.warning(
            "%s: refused handshake from %s: %s %s",
            self.ctx.agent_name,
            hello.agent,
            reason,
            problems,
        )
        self.ctx.tell(
            hello.endpoint,
            HelloReject(
                session=self.ctx.session,
                peer_session=hello.session,
                reason=reason,
                problems=problems,
            ),
        )

    def close(self) -> None:
        """Manager shutdown: stop answering hellos; a checksum warm-up under way (it reads
        the KV buffers) ends first."""
        self.handshakes.shutdown(wait=False, cancel_futures=True)
        self._warmer.close(wait=True)
