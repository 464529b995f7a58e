"""Decode side: the prefill ranks a decode rank knows — bootstrap lookups (cached per prefill
instance and DP rank) and handshakes (one per prefill rank, cached across requests).

Lock contract: :class:`SourceLinks` guards ``links``, ``pending`` and ``instances`` with its
own plain lock, held only for dictionary operations: never across a lookup, a send, a wait or
a call into the engine, and never while taking the room lock (callers may hold the room lock
when they call in: the order is the room lock -> this lock). ``lookup`` and ``handshake`` run
on the engine thread (cache hits) or a bootstrap thread; the message handlers on the liveness
thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvwire.control.bootstrap import BootstrapClient, RankInfo
from kvwire.control.wire import (
    LEGACY_POOL,
    BackendOffer,
    Hello,
    HelloAck,
    HelloReject,
    Message,
)
from kvwire.errors import HandshakeError, KVWireError
from kvwire.index.topology import Topology
from kvwire.link_choice import host_identity
from kvwire.movers.warmup import Warmer
from kvwire.session.aux_note import carries_aux
from kvwire.session.checksums import LandedSums
from kvwire.session.group_sums import LandedGroupSums
from kvwire.session.handshake import build_mapper, topology_for
from kvwire.session.peers import Peer

if TYPE_CHECKING:
    from kvwire.session.context import RankContext

logger = logging.getLogger(__name__)

#: Gone prefill sessions remembered (see ``SourceLinks._gone``).
MAX_GONE = 256


@dataclass
class PrefillLink:
    """A prefill rank this decode rank has handshaken with."""

    info: RankInfo
    sender_id: int
    dummy: bool
    #: It moves buffer-group bytes to this rank: one ``ChunkNote(what="state")`` per request.
    groups: bool = False
    #: Checks the per-layer sums its chunks carry (``ControlOptions.kv_checksum``).
    checksums: LandedSums | None = None
    #: Checks the sums its state notes carry (1.14: ``HelloAck.group_checksum``).
    group_sums: LandedGroupSums | None = None
    #: The backend prefill chose for the link and its fallbacks ("" from a 1.7 prefill).
    backend: str = ""
    fallbacks: tuple[str, ...] = ()


@dataclass
class _Pending:
    """A handshake in flight."""

    event: threading.Event = field(default_factory=threading.Event)
    link: PrefillLink | None = None
    error: str | None = None


class SourceLinks:
    """The prefill instances looked up and the prefill ranks handshaken with, for one decode
    rank (see the module docstring for the lock contract)."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        #: Sums each checked link's first page once, compiling its hasher's kernel.
        self._warmer = Warmer("checks")
        self.pending: dict[str, _Pending] = {}
        self.links: dict[str, PrefillLink] = {}
        #: (bootstrap address, prefill dp rank) -> the prefill ranks registered there.
        self.instances: dict[tuple[str, int], list[RankInfo]] = {}
        self._instance_locks: dict[tuple[str, int], threading.Lock] = {}
        #: (prefill tp, prefill pp) -> the topology (the mapper's choice, which does not
        #: change): looked up per request on the engine thread, found once.
        self._topologies: dict[tuple[int, int], Topology] = {}
        #: Prefill sessions evicted for silence, and when: they may be alive behind a
        #: partition, so their writes are not taken as ended (see
        #: :mod:`kvwire.session.decode.quiesce`).
        self._lost_silently: dict[str, float] = {}
        #: Prefill sessions known gone (connection closed, goodbye, restarted), by control
        #: endpoint, the last :data:`MAX_GONE`: bootstrap lists a dead rank until it
        #: restarts, and a handshake with one fails at once instead of at its timeout.
        self._gone: OrderedDict[str, str] = OrderedDict()

    def __contains__(self, session: object) -> bool:
        """Whether a handshake with prefill session ``session`` holds (any thread)."""
        with self._lock:
            return session in self.links

    # ---------------------------------------------------------------- lookups
    def topology(self, prefill: RankInfo) -> Topology:
        """Who sends to whom between a prefill instance (as bootstrap lists it) and us."""
        key = (prefill.tp_size, prefill.pp_size)
        topo = self._topologies.get(key)
        if topo is None:
            ctx = self.ctx
            r = ctx.layout.rank
            topo = topology_for(ctx.config, ctx.layout, *key, r.tp_size, r.pp_size)
            self._topologies[key] = topo
        return topo

    def cached_sources(self, addr: str, room_id: int, dp: int | None) -> list[PrefillLink] | None:
        """Engine thread: the links of a request's source ranks when the instance was looked
        up and every one of them handshaken before, else None."""
        with self._lock:
            ranks = self.instances.get((addr, 0 if dp is None else dp))
            if ranks is not None and dp is None and ranks[0].dp_size > 1:
                ranks = self.instances.get((addr, room_id % ranks[0].dp_size))
        if ranks is None:
            return None
        try:
            want = self.topology(ranks[0]).source_tp_ranks(self.ctx.layout.rank.tp_rank)
        except KVWireError:
            return None
        with self._lock:
            links = [self.links.get(x.session) for x in ranks if x.tp_rank in want]
        if not links or any(link is None for link in links):
            return None
        return [link for link in links if link is not None]

    def lookup(self, client: BootstrapClient, addr: str, dp: int) -> list[RankInfo]:
        """Bootstrap thread: the prefill ranks of (instance, dp rank); one lookup at a time
        per key, cached until one of them is lost."""
        key = (addr, dp)
        with self._lock:
            lock = self._instance_locks.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                cached = self.instances.get(key)
            if cached is not None:
                return cached
            ranks = client.lookup(dp, timeout_s=self.ctx.options.bootstrap_timeout_s)
            with self._lock:
                self.instances[key] = ranks
            return ranks

    # ------------------------------------------------------------- handshakes
    def handshake(self, info: RankInfo, timeout_s: float) -> PrefillLink:
        """Bootstrap thread: the link to one prefill rank, handshaking once (concurrent
        callers wait on the same hello)."""
        ctx = self.ctx
        with self._lock:
            link = self.links.get(info.session)
            if link is not None:
                return link
            if info.session in self._gone:
                raise HandshakeError(
                    f"prefill rank tp={info.tp_rank} pp={info.pp_rank} ({info.agent} at "
                    f"{info.endpoint}) is gone (this rank lost it: its control connection "
                    "closed or it left); its bootstrap service still lists it, so it has not "
                    "restarted yet"
                )
            pending = self.pending.get(info.session)
            first = pending is None
            if pending is None:
                pending = self.pending[info.session] = _Pending()
        if first:
            offers = ctx.backend.offers()
            extra = {n: lay for n, lay in ctx.pool_layouts.items() if n != "kv"}
            pool_staging: dict[str, dict[str, Any]] = {}
            for n in extra:
                described = ctx.stagings[n].describe()
                if described is not None:
                    pool_staging[n] = described
            hello = Hello(
                session=ctx.session,
                agent=ctx.agent_name,
                endpoint=ctx.channel.endpoint,
                rank=ctx.layout.rank,
                layout=ctx.layout,
                layout_hash=ctx.layout.compatibility_hash(),
                backend=offers[0][0],
                backend_metadata=offers[0][1],
                backends=[BackendOffer(name=n, metadata=b) for n, b in offers],
                host=host_identity(),
                aux_regions=ctx.aux_regions,
                staging=ctx.staging.describe(),
                pools=extra,
                pool_staging=pool_staging,
                # 1.9 prefills read only these two, for the pool they knew
                host_layout=extra.get(LEGACY_POOL),
                host_staging=pool_staging.get(LEGACY_POOL),
                checksum=ctx.options.kv_checksum,
                aux_in_note=carries_aux(ctx.aux_regions),
                local_control=ctx.channel.local_name,
            )
            ctx.tell(info.endpoint, hello)
        ok = pending.event.wait(timeout_s)
        with self._lock:
            if first:
                self.pending.pop(info.session, None)
        if not ok:
            raise HandshakeError(
                f"prefill rank tp={info.tp_rank} pp={info.pp_rank} ({info.agent} at "
                f"{info.endpoint}) did not answer the handshake within {timeout_s:.1f}s"
            )
        if pending.link is None:
            raise HandshakeError(
                f"prefill rank {info.agent} refused the handshake: {pending.error}"
            )
        return pending.link

    def on_reject(self, msg: Message) -> None:
        """Liveness thread: a prefill rank refused our handshake (every reason listed)."""
        assert isinstance(msg, HelloReject)
        with self._lock:
            pending = (
                self.pending.get(msg.session) if msg.peer_session == self.ctx.session else None
            )
        if pending is not None:
            pending.error = f"{msg.reason}: " + "; ".join(msg.problems)
            pending.event.set()

    def on_unsigned(self, msg: Message) -> None:
        """Liveness thread: an answer to our (signed) hello came without a MAC: the prefill
        rank has no shared secret. Fail that handshake at once, naming the secret (an
        unsigned frame can end a handshake early, never complete one)."""
        if not isinstance(msg, HelloAck | HelloReject) or msg.peer_session != self.ctx.session:
            return
        with self._lock:
            pending = self.pending.get(msg.session)
        if pending is not None and pending.link is None:
            pending.error = (
                "the prefill rank answers without signatures: a shared secret (KVWIRE_SECRET) "
                "is set on this decode rank but not on prefill; set the same secret on both"
            )
            pending.event.set()

    def on_ack(self, msg: Message) -> None:
        """Liveness thread: a prefill rank accepted our handshake. When it stages its chunks
        for us, our KV pool's strategy takes the link (and may refuse it)."""
        assert isinstance(msg, HelloAck)
        ctx = self.ctx
        if msg.peer_session != ctx.session:
            return  # an answer to an earlier incarnation of this rank
        with self._lock:
            pending = self.pending.get(msg.session)
            info = self._info_for(msg.session)
        if pending is None:
            return
        error = None
        if msg.layout_hash != ctx.layout.compatibility_hash():
            error = "layout compatibility hash differs"
        elif info is None:
            error = "acknowledged by a rank bootstrap does not list"
        elif msg.staged:
            try:
                if msg.layout is None:
                    raise HandshakeError("it stages but sent no layout")
                mapper = build_mapper(ctx.config, msg.layout, ctx.layout)
                ctx.staging.on_link(msg.session, msg.endpoint, mapper)
            except KVWireError as exc:
                error = f"cannot take staged chunks from {msg.agent}: {exc}"
        checksums = None
        group_sums = None
        if error is None and ctx.options.kv_checksum and not msg.dummy:
            try:
                if not msg.checksum or msg.layout is None:
                    raise HandshakeError(
                        "this decode rank checks KV checksums (kv_checksum) and that prefill "
                        "rank does not send them (kvwire older than protocol 1.7?)"
                    )
                checksums = LandedSums(ctx.config, msg.layout, ctx.layout)
                if msg.groups and msg.group_checksum:
                    group_sums = LandedGroupSums(checksums.mapper, ctx.layout)
                elif msg.groups:
                    logger.warning(
                        "%s: %s sends no checksums of its buffer groups (kvwire older than "
                        "protocol 1.14): its KV chunks are checked, its groups are not",
                        ctx.agent_name,
                        msg.agent,
                    )
            except KVWireError as exc:
                error = f"cannot check the KV of {msg.agent}: {exc}"
        if error is not None or info is None:
            pending.error = error
            pending.event.set()
            return
        link = PrefillLink(
            info,
            msg.sender_id,
            msg.dummy,
            msg.groups,
            checksums,
            group_sums,
            msg.backend,
            tuple(msg.fallbacks),
        )
        # later frames to it go over the local socket if it shares our network namespace
        local = ctx.channel.set_local(msg.endpoint, msg.local_control)
        checked = "" if checksums is None else "; checksums of its KV"
        if checksums is not None and msg.groups:
            checked += " and buffer groups" if group_sums is not None else " (not its groups)"
        logger.info(
            "%s: link from %s: backend %s%s; control frames over %s%s",
            ctx.agent_name,
            msg.agent,
            msg.backend or ctx.backend_names[0],
            f" (fallbacks: {', '.join(msg.fallbacks)})" if msg.fallbacks else "",
            "the local socket" if local else "ZeroMQ",
            checked,
        )
        warm = None if checksums is None else checksums.warm_up()
        if warm is not None:
            self._warmer.submit(f"KV checks of {msg.agent}", warm)
        with self._lock:
            self.links[msg.session] = link
        ctx.add_peer(Peer(msg.session, msg.agent, msg.endpoint, time.monotonic(), link=link))
        pending.link = link
        pending.event.set()

    def _info_for(self, session: str) -> RankInfo | None:
        """Under the lock: the bootstrap listing of prefill session ``session``."""
        for ranks in self.instances.values():
            for x in ranks:
                if x.session == session:
                    return x
        return None

    # -------------------------------------------------------------- lifetime
    def forget(self, session: str, silent: bool = False, now: float = 0.0) -> None:
        """A prefill rank was lost: drop its link and every lookup that lists it (the next
        request looks its instance up again); ``silent``: lost to silence at ``now``."""
        with self._lock:
            link = self.links.pop(session, None)
            if silent:
                self._lost_silently[session] = now
            elif link is not None:
                self._gone[session] = link.info.endpoint
                while len(self._gone) > MAX_GONE:
                    self._gone.popitem(last=False)
            for key, ranks in list(self.instances.items()):
                if any(x.session == session for x in ranks):
                    del self.instances[key]

    def gone_endpoint(self, endpoint: str) -> bool:
        """Whether ``endpoint`` is the control endpoint of a prefill rank known gone (nothing
        is sent there: a socket to it would only retry). Any thread."""
        with self._lock:
            return endpoint in self._gone.values()

    def unlink(self, session: str) -> None:
        """Liveness thread: prefill session ``session`` evicted this rank: drop its link (the
        next request handshakes again), keep its lookup (it is alive and still listed)."""
        with self._lock:
            self.links.pop(session, None)

    def lost_silently(self, session: str) -> bool:
        """Whether prefill session ``session`` was lost to silence (and not yet expired):
        it may be alive behind a partition, its writes still on the way. Any thread."""
        with self._lock:
            return session in self._lost_silently

    def expire_silent(self, now: float, limit_s: float) -> None:
        """Progress thread: forget silent losses older than ``limit_s`` (every write such a
        peer posted has hit its deadline by then)."""
        with self._lock:
            for session, t in list(self._lost_silently.items()):
                if now - t > limit_s:
                    del self._lost_silently[session]

    def pending_count(self) -> int:
        with self._lock:
            return len(self.pending)

    def close(self, why: str) -> None:
        """Manager shutdown: end every handshake wait; a checksum warm-up under way (it reads
        the KV buffers) ends first."""
        with self._lock:
            waiting = list(self.pending.values())
        for p in waiting:
            p.error = why
            p.event.set()
        self._warmer.close(wait=True)
