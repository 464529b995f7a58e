"""Decode side: bootstrap lookups, handshakes, per-request :class:`KVReceiver`, completion.

Flow of one request on a decode rank:

1. The engine creates ``mgr.receiver(room, bootstrap_addr)`` and calls ``init()``: the room is
   ``Bootstrapping`` while a background thread looks the prefill instance up in its bootstrap
   service (retrying while registration is incomplete) and handshakes once with every prefill
   rank that feeds this rank (cached across requests). Then ``WaitingForInput``.
2. The engine calls ``send_metadata(dst_pages, aux_index)``: a
   :class:`~kvwire.control.wire.TransferRequest` goes to every source rank; ``Transferring``.
3. The control thread drains the backend's notifications: per sender it counts KV chunks until
   the count equals the last chunk id + 1 (or a :class:`~kvwire.control.wire.Completion` marker
   says how many chunks carried data), and checks the aux row's room stamp when the aux
   notification arrives (a checksummed chunk counts once checked, :mod:`.checker`). Every
   sender complete and aux arrived: ``Success``.
4. Failures pushed by prefill, a dead prefill rank (heartbeats), or the waiting deadline fail the
   room; the engine calls ``clear()`` on every path.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from typing import Any, ClassVar

from kvwire.backend import Notification
from kvwire.control.bootstrap import BootstrapClient
from kvwire.control.reach import loopback_problem
from kvwire.control.wire import (
    ChunkNote,
    Completion,
    Evicted,
    Failure,
    Message,
    TransferRequest,
    WritesDone,
    WritesQuery,
    pages_to_bytes,
)
from kvwire.errors import (
    BootstrapError,
    ConfigError,
    HandshakeError,
    KVWireError,
    ProtocolError,
    TransferError,
)
from kvwire.session import metrics as m
from kvwire.session.common import Side
from kvwire.session.context import RankContext
from kvwire.session.decode.aux import take_aux
from kvwire.session.decode.checker import ChunkChecker
from kvwire.session.decode.links import PrefillLink, SourceLinks
from kvwire.session.decode.metadata import check_metadata, check_pool, offer_ahead
from kvwire.session.decode.quiesce import WriteQuarantine
from kvwire.session.decode.rejoin import Rejoin
from kvwire.session.decode.rooms import RecvRoom
from kvwire.session.groups import to_wire
from kvwire.session.peers import Peer
from kvwire.session.poll import KVPoll
from kvwire.session.report import (
    FailureCause,
    FailureReport,
)
from kvwire.session.rooms import RoomTable
from kvwire.staging.base import StagingStrategy

logger = logging.getLogger(__name__)


class DecodeSide(Side[RecvRoom]):
    """The decode role of a rank (built by the façade,
    :class:`~kvwire.session.manager.KVManager`, with the rank context and the room table).

    Lock contract: room tables, the quarantine and source progress are guarded by
    ``self.rooms.lock``, held for table updates (and a staged chunk's placement by the strategy),
    never across an engine call, a wait or a chunk's checksum check (:mod:`.checker`). The
    prefill ranks known (lookups, handshakes) are :attr:`sources`' (its own lock, taken after
    ``self.rooms.lock`` when both are held). Message handlers run on the liveness thread,
    notification handling and deadlines on the progress thread.
    """

    #: The handler of every wire message kind on decode (kind -> method).
    HANDLERS: ClassVar[dict[str, str]] = {
        "hello_ack": "_on_ack",
        "hello_reject": "_on_reject",
        "failure": "on_failure",
        "note": "_on_note",
        "completion": "_on_completion",
        "writes_done": "_on_writes_done",
        "evicted": "_on_evicted",
        "hello": "not_for_role",
        "transfer_request": "not_for_role",
        "writes_query": "not_for_role",
    }

    def __init__(self, ctx: RankContext, rooms: RoomTable[RecvRoom]) -> None:
        super().__init__(ctx, rooms)
        #: The prefill ranks looked up and handshaken with.
        self.sources = SourceLinks(ctx)
        #: Failed rooms whose sources may still be writing (see
        #: :mod:`kvwire.session.decode.quiesce`).
        self.quarantine = WriteQuarantine(
            self.sources, ctx.options.transfer_timeout_s, ctx.agent_name
        )
        #: When each prefill session last delivered anything (deadlines are on progress: a
        #: request queued behind others lives while its sources advance).
        self.source_progress: dict[str, float] = {}
        self.checker = ChunkChecker(
            ctx.agent_name, rooms, self._fail, self._check_done, self._strategy
        )
        self.bootstraps = concurrent.futures.ThreadPoolExecutor(
            4, thread_name_prefix=f"kvwire-bs-{ctx.agent_name}"
        )
        #: Prefill ranks that evicted this rank: links dropped, unheard requests repeated.
        self.rejoin = Rejoin(
            ctx, rooms, self.sources, self.bootstraps.submit, self._fail, self.request_message
        )

    # ------------------------------------------------------------ bootstrapping
    def create_room(self, room_id: int, bootstrap_addr: str) -> RecvRoom:
        """Engine thread (KVReceiver creation). The first room wakes the progress thread,
        which ticks slowly while the table is empty (``IDLE_TICK_S`` in the manager)."""
        with self.rooms.lock:
            room = self.rooms.create(RecvRoom(room_id, bootstrap_addr))
            first = len(self.rooms) == 1
        if first:
            self.ctx.wake.set()
        return room

    def start(self, room: RecvRoom, prefill_dp_rank: int | None) -> None:
        """Engine thread (``init``): resolve and handshake. When the prefill instance was looked
        up and every source rank handshaken before (the common case), that is a few dict
        lookups done right here; otherwise it runs on a bootstrap thread."""
        cached = self.sources.cached_sources(room.bootstrap_addr, room.room, prefill_dp_rank)
        if cached is not None:
            self._resolved(room, cached)
        else:
            self.bootstraps.submit(self._bootstrap, room, prefill_dp_rank)

    def _bootstrap(self, room: RecvRoom, dp: int | None) -> None:
        """Bootstrap thread: find the source ranks and handshake with each."""
        try:
            sources = self._sources(room, dp)
        except KVWireError as exc:
            with self.rooms.lock:
                if not self.rooms.terminal(room):  # pushed to the contacts bootstrap listed
                    self._fail(room, exc, cause="bootstrap")
            return
        self._resolved(room, sources)

    def _resolved(self, room: RecvRoom, sources: list[PrefillLink]) -> None:
        """The room's source ranks are known and handshaken: WaitingForInput."""
        r = self.ctx.layout.rank
        aux = self.sources.topology(sources[0].info).aux_sender(r.tp_rank)
        with self.rooms.lock:
            if self.rooms.terminal(room):
                if room.error is not None and not room.contacts:
                    # failed before its sources were known: they learn of it now
                    room.sources = sources
                    self._push_failure(room, room.error, None, False)
                return
            room.sources = sources
            room.aux_sender = aux
            self.rooms.advance(room, KVPoll.WaitingForInput)
            if room.dst_pages is not None:
                self._request(room)

    def _sources(self, room: RecvRoom, dp: int | None) -> list[PrefillLink]:
        addr, room_id = room.bootstrap_addr, room.room
        opts = self.ctx.options
        client = BootstrapClient(addr, self.ctx.config.secret_bytes)
        ranks = self.sources.lookup(client, addr, 0 if dp is None else dp)
        if dp is None and ranks[0].dp_size > 1:
            ranks = self.sources.lookup(client, addr, room_id % ranks[0].dp_size)
        r = self.ctx.layout.rank
        try:
            wanted = set(self.sources.topology(ranks[0]).sources(r.tp_rank))
        except KVWireError as exc:
            raise HandshakeError(f"cannot pair with the prefill instance at {addr}: {exc}") from exc
        chosen = [x for x in ranks if (x.tp_rank, x.pp_rank) in wanted]
        with self.rooms.lock:  # the ranks found hear of a failure from here on
            room.contacts = [x.endpoint for x in chosen]
            if room.error is not None:  # failed while we looked its sources up
                self._push_failure(room, room.error, None, False)
                raise TransferError("request failed during bootstrap", room=room_id)
        if len(chosen) != len(wanted):
            raise BootstrapError(
                f"bootstrap at {addr} lists {len(chosen)} of the {len(wanted)} prefill ranks "
                "this decode rank needs"
            )
        own = self.ctx.channel.endpoint
        for x in chosen:  # a loopback address across hosts would wait for the timeout
            problem = loopback_problem(own, x.endpoint, x.agent, addr)
            if problem is not None:
                raise HandshakeError(problem)
        return [self.sources.handshake(x, opts.handshake_timeout_s) for x in chosen]

    # ------------------------------------------------------------ liveness thread
    def _on_ack(self, msg: Message) -> None:
        """Liveness thread: a prefill rank accepted our handshake (see :class:`SourceLinks`)."""
        self.sources.on_ack(msg)

    def _on_reject(self, msg: Message) -> None:
        """Liveness thread: a prefill rank refused our handshake."""
        self.sources.on_reject(msg)

    def on_unsigned(self, msg: Message) -> None:
        """Liveness thread: an unsigned answer to our signed hello (names the secret)."""
        self.sources.on_unsigned(msg)

    def _on_evicted(self, msg: Message) -> None:
        """Liveness thread: a prefill rank evicted this rank (see :mod:`.rejoin`)."""
        assert isinstance(msg, Evicted)
        self.rejoin.on_evicted(msg)

    def _on_writes_done(self, msg: Message) -> None:
        """Liveness thread: a source confirms none of its writes for a failed room remains."""
        assert isinstance(msg, WritesDone)
        with self.rooms.lock:
            self.quarantine.confirmed(self.rooms.get(msg.room), msg.room, msg.session)
        for strategy in self.ctx.strategies:
            strategy.writes_ended(msg.room, msg.session)

    def _on_completion(self, msg: Message) -> None:
        """Liveness thread: a sender's last chunk moved no KV; it says how many did."""
        assert isinstance(msg, Completion)
        with self.rooms.lock:
            room = self._room_for(msg.room, msg.session, msg.sender_id)
            if room is not None:
                room.expected[msg.sender_id] = msg.data_chunks
                room.last_progress = time.monotonic()
                self._check_done(room)

    def on_notification(self, note: Notification) -> None:
        """Control thread: a data-plane notification (data already landed)."""
        ctx = self.ctx
        try:
            msg = ctx.codec.decode(note.payload)
        except ProtocolError as exc:
            ctx.channel.dropped[
                "note_" + ("unauthenticated" if "authentic" in str(exc) else "malformed")
            ] += 1
            logger.warning("%s: dropped a notification from %s: %s", ctx.agent_name, note.peer, exc)
            return
        if isinstance(msg, ChunkNote):
            ctx.peers.touch(msg.session)
            self._note_landed(msg)  # a device sum's check waits for notifications_drained

    def notifications_drained(self) -> None:
        """Progress thread, no lock held, after a drain of notifications: run the device
        sums' checks their notes completed, a batch's launches before its first wait
        (:meth:`ChunkChecker.run_deferred
        <kvwire.session.decode.checker.ChunkChecker.run_deferred>`)."""
        self.checker.run_deferred()

    def _on_note(self, msg: Message) -> None:
        """Liveness thread: the control message of a copy prefill made itself (one chunk
        segment, or the aux row, landed)."""
        assert isinstance(msg, ChunkNote)
        try:
            self._note_landed(msg)
        finally:  # a device sum's check runs here, with the room lock let go
            self.checker.run_deferred()

    def _note_landed(self, msg: ChunkNote) -> None:
        """A note's work, under the room lock (progress thread for a backend notification,
        liveness thread for a control message)."""
        ctx = self.ctx
        now = time.monotonic()
        with self.rooms.lock:
            self.source_progress[msg.session] = now
            room = self._room_for(msg.room, msg.session, msg.sender_id)
            if room is None:
                return
            room.last_progress = now
            room.metrics.marks["noted"] = time.perf_counter()
            if msg.what == "aux" or msg.aux is not None:  # its own, or carried (1.11)
                error = take_aux(ctx, room, msg)
                if error is not None:
                    self._fail(room, error)
                    return
                room.aux_done = True
            if msg.what == "aux":
                pass
            elif msg.what == "state":  # the sender's buffer groups landed (after its KV)
                if not self.checker.on_state(room, msg):
                    return  # a part of its note, or their check, is still on its way
            else:
                self.checker.on_part(room, msg)  # counted now, or once its piece is checked
                return
            self._check_done(room)

    def awaiting_data(self) -> bool:
        """Control thread: some request asked for its KV and is not complete yet."""
        status = self.rooms.status
        return any(
            status.get(r.room, KVPoll.Failed) is KVPoll.Transferring
            for r in list(self.rooms.values())
        )

    def _strategy(self, room: RecvRoom) -> StagingStrategy:
        """The strategy of the pool the room's KV goes to."""
        return self.ctx.stagings[room.pool]

    def _room_for(self, room_id: int, session: str, sender_id: int) -> RecvRoom | None:
        """The live room a message is for, if it comes from one of the room's sources."""
        room = self.rooms.get(room_id)
        if room is None or room.sources is None or self.rooms.terminal(room):
            return None
        if not any(s.info.session == session and s.sender_id == sender_id for s in room.sources):
            logger.warning(
                "%s: room %d: message from a non-source (%s, sender %d) dropped",
                self.ctx.agent_name,
                room_id,
                session,
                sender_id,
            )
            return None
        return room

    def _check_done(self, room: RecvRoom) -> None:
        assert room.sources is not None
        if not room.requested or not room.aux_done:
            return
        for s in room.sources:
            if s.groups and s.sender_id not in room.groups_from:
                return
            want = room.expected.get(s.sender_id)
            got = room.received.get(s.sender_id, 0)
            if want is None or got < want:
                return
            if got > want:
                self._fail(
                    room,
                    TransferError(
                        f"sender {s.sender_id} delivered {got} chunks but announced {want}",
                        room=room.room,
                    ),
                )
                return
        room.metrics.chunks = sum(room.received.values())
        self.rooms.succeed(room)

    def on_failure(self, msg: Message) -> None:
        """Liveness thread: a prefill rank failed or aborted a room (or did not accept its
        request: it evicted this rank, :mod:`.rejoin`)."""
        assert isinstance(msg, Failure)
        if msg.unheard:
            self.rejoin.on_unheard(msg)
            return
        with self.rooms.lock:
            room = self.rooms.get(msg.room)
            if room is None or self.rooms.terminal(room):
                return
            if room.sources is not None and not any(
                s.info.session == msg.session for s in room.sources
            ):
                return
            what = "aborted" if msg.aborted else "failed"
            self._fail(
                room,
                TransferError(f"prefill {what} the request: {msg.reason}", room=room.room),
                skip=msg.session,
                cause="prefill_aborted" if msg.aborted else "prefill_failed",
            )

    def _query_failed_writers(self, now: float) -> None:
        """Progress thread: ask the sources of failed requests, until each answers, whether
        any of their writes is still in flight (the engine must not reuse the pages before)."""
        with self.rooms.lock:
            asks = self.quarantine.due_queries(now, list(self.rooms.values()))
        for endpoint, room_id in asks:
            self.ctx.tell(endpoint, WritesQuery(room=room_id, session=self.ctx.session))

    def run_hooks(self, room: RecvRoom, status: KVPoll) -> None:
        """Engine thread, the first time a request into an extra pool is seen terminal (poll
        or clear): admit it with its token count, or abandon it — exactly once per request."""
        hooks = self.ctx.hooks
        with self.rooms.lock:
            if room.pool == "kv" or room.hooked or hooks is None:
                return
            room.hooked = True
        if status is KVPoll.Success:
            assert room.dst_pages is not None
            page_size = self.ctx.pool_layouts[room.pool].model.page_size
            hooks.on_admit(room.room, int(room.dst_pages.size) * page_size)
        else:
            hooks.on_abandon(room.room)

    def writes_quiesced(self, room: RecvRoom) -> bool:
        """Engine thread: whether no source can still write into this request's pages."""
        with self.rooms.lock:
            if room.sources is None or not room.requested:
                return True  # no source was ever told where to write
            if room.error is None:
                return self.rooms.status.get(room.room, KVPoll.Failed) is KVPoll.Success
            return self.quarantine.quiesced(room, room.room in self.rooms, time.monotonic())

    def on_peer_lost(self, peer: Peer, why: str) -> None:
        """Control thread: a prefill rank is dead or gone; fail the rooms it feeds and free the
        ring space it held."""
        for strategy in self.ctx.strategies:
            self.ctx.later(functools.partial(strategy.peer_lost, peer.session))
        with self.rooms.lock:
            self.source_progress.pop(peer.session, None)
            self.sources.forget(peer.session, peer.silent_loss, time.monotonic())
            for room in list(self.rooms.values()):
                if room.sources and any(s.info.session == peer.session for s in room.sources):
                    self._fail(
                        room,
                        TransferError(
                            f"prefill peer {peer.agent} lost: {why}",
                            room=room.room,
                            peer=peer.agent,
                        ),
                        skip=peer.session,
                        cause="sender_lost",
                    )
                    room.fault_peer = room.fault_peer or peer.agent

    def check_deadlines(self, now: float) -> None:
        """Progress thread (after draining notifications): ask the sources of failed requests
        whether their writes ended, and the waiting timeout (on progress)."""
        self._query_failed_writers(now)
        limit = self.ctx.options.waiting_timeout_s
        with self.rooms.lock:
            for room in list(self.rooms.values()):
                if not room.requested or room.sources is None or self.rooms.terminal(room):
                    continue
                last = max(
                    room.last_progress,
                    *(self.source_progress.get(s.info.session, 0.0) for s in room.sources),
                )
                if now - last > limit:
                    got = {s: room.received.get(s, 0) for s in room.expected}
                    self._fail(
                        room,
                        TransferError(
                            f"waiting timeout: no progress for {limit:.1f}s, neither on this "
                            f"request nor on any other from its prefill ranks (chunks received "
                            f"per sender {got or dict(room.received)}, aux "
                            f"{'arrived' if room.aux_done else 'missing'}{room.incomplete()})",
                            room=room.room,
                        ),
                        cause="timeout",
                    )

    # --------------------------------------------------------------- engine thread
    def send_metadata(
        self,
        room: RecvRoom,
        pages: Any,
        aux_index: int,
        pool: str = "kv",
        state_indices: Any = None,
        cached_tokens: int | None = None,
    ) -> None:
        """Engine thread: where the request's KV goes on this rank (the KV pool, or with
        ``pool=name`` an extra pool, in its page units), its buffer-group slots, and the
        prompt tokens kept cached here."""
        ctx = self.ctx
        check_pool(ctx, pool)
        try:
            md = check_metadata(ctx, pages, aux_index, pool, state_indices, cached_tokens)
        except KVWireError as exc:
            with self.rooms.lock:
                self._fail(
                    room,
                    TransferError(f"bad input to send_metadata(): {exc}", room=room.room),
                    cause="bad_input",
                )
            raise
        with self.rooms.lock:
            if room.dst_pages is not None:
                raise ConfigError(f"room {room.room}: send_metadata() was already called")
            if self.rooms.terminal(room):
                return
            ctx.stamps[aux_index, 0] = 0
            room.dst_pages = md.pages
            room.aux_index = md.aux_index
            room.pool = md.pool
            room.group_dst = md.groups
            room.cached_tokens = md.cached_tokens
            if room.sources is not None:
                self._request(room)
        if pool != "kv" and ctx.hooks is not None:
            ctx.hooks.on_prealloc(room.room, int(md.pages.size))

    def _request(self, room: RecvRoom) -> None:
        """Under the lock: send the transfer request to every source rank, right after the
        room's staging strategy consented ahead (bulk staging's offers of ring space go first,
        so a prefill engine that sends as soon as it sees the request finds them there)."""
        assert room.sources is not None and room.dst_pages is not None
        ctx = self.ctx
        offer_ahead(ctx, room.room, room.pool, room.dst_pages.size, room.sources)
        msg = self.request_message(room)
        room.metrics.marks["requested"] = time.perf_counter()
        for s in room.sources:
            ctx.tell(s.info.endpoint, msg)
        room.requested = True
        room.last_progress = time.monotonic()
        self.rooms.advance(room, KVPoll.Transferring)

    def request_message(self, room: RecvRoom) -> TransferRequest:
        """Under the lock: the room's transfer request (the same to every source rank)."""
        assert room.dst_pages is not None
        return TransferRequest(
            room=room.room,
            session=self.ctx.session,
            dst_pages=pages_to_bytes(room.dst_pages),
            aux_index=room.aux_index,
            pool=room.pool,
            group_indices=to_wire(room.group_dst),
            cached_tokens=room.cached_tokens,
        )

    def _fail(
        self,
        room: RecvRoom,
        exc: BaseException,
        skip: str | None = None,
        aborted: bool = False,
        cause: FailureCause = "protocol",
    ) -> None:
        """Under the lock: fail the room once, record why (``cause``: for its failure report),
        tell its sources (but ``skip``, the one that reported it or is gone)."""
        if not self.rooms.fail(room, exc):
            return
        room.cause = "aborted" if aborted else cause
        m.RECEIVE_FAILURES.labels(**self.ctx.labels, cause=room.cause).inc()
        logger.warning("%s: room %d failed: %s", self.ctx.agent_name, room.room, exc)
        self._push_failure(room, exc, skip, aborted)

    def _push_failure(
        self, room: RecvRoom, exc: BaseException, skip: str | None, aborted: bool
    ) -> None:
        """Under the lock: tell the room's prefill ranks it failed: its handshaken sources,
        or, before (or without) a handshake, the control endpoints bootstrap listed."""
        ctx = self.ctx
        msg = Failure(room=room.room, session=ctx.session, reason=str(exc), aborted=aborted)
        if room.sources is not None:
            endpoints = [s.info.endpoint for s in room.sources if s.info.session != skip]
        else:  # the ranks bootstrap listed, but those known dead
            endpoints = [ep for ep in room.contacts if not self.sources.gone_endpoint(ep)]
        for ep in endpoints:
            ctx.tell(ep, msg)

    def clear(self, room: RecvRoom) -> None:
        """Engine thread: forget the room. A failed room whose sources have not all confirmed
        that their writes ended stays in ``quarantine`` (asked again until they do)."""
        with self.rooms.lock:
            if self.rooms.forget(room) and room.aux_index >= 0:
                self.ctx.stamps[room.aux_index, 0] = 0
            self.quarantine.hold(room)
        for strategy in self.ctx.strategies:
            strategy.release(room.room)

    def failure_report(self, room: RecvRoom) -> FailureReport | None:
        """Engine thread (``KVReceiver.failure_report``): what of a failed request landed on
        this rank and what is missing (:mod:`kvwire.session.report`); None unless it failed.
        Chunks arriving after the failure are not counted (the room stopped listening)."""
        with self.rooms.lock:
            if room.error is None or room.report is not None:
                return room.report
            room.report = room.build_report(self.ctx.layout.model.page_size)
        kept, lost = int(room.report.good_pages.size), int(room.report.missing_pages.size)
        m.FAILED_PAGES.labels(**self.ctx.labels, result="kept").inc(kept)
        m.FAILED_PAGES.labels(**self.ctx.labels, result="missing").inc(lost)
        return room.report

    def room_tables(self) -> dict[str, int]:
        """Per-room table sizes (leak check)."""
        with self.rooms.lock:
            return {
                "recv_rooms": len(self.rooms),
                "quarantine": len(self.quarantine),
                "handshakes_pending": self.sources.pending_count(),
                "checks_in_flight": self.checker.in_flight(),
                **{k: v for st in self.ctx.strategies for k, v in st.room_tables().items()},
            }

    def close(self) -> None:
        """Manager shutdown: fail live rooms and stop the bootstrap threads."""
        with self.rooms.lock:
            for room in list(self.rooms.values()):
                if not self.rooms.terminal(room):
                    err = TransferError("decode manager closed", room=room.room)
                    self._fail(room, err, cause="closed")
        self.checker.close()
        self.sources.close("decode manager closed")
        self.bootstraps.shutdown(wait=False, cancel_futures=True)
