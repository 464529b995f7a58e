"""Prefill side: handshakes with decode ranks, per-request :class:`KVSender`, transfer workers.

Flow of one request on a prefill rank:

1. The engine creates ``mgr.sender(room)`` on the façade; the room is ``Bootstrapping``.
2. Each decode rank fed by this rank sends a :class:`~kvwire.control.wire.TransferRequest`
   (destination pages and aux row). A request may arrive before the sender exists; it is kept
   for ``bootstrap_timeout_s`` at most. Once every expected decode rank has asked (``Td/Tp`` of
   them when decode is larger, else one), the room is ``WaitingForInput``.
3. The engine calls ``init(num_pages, aux_index)`` and then ``send(pages, last=...)`` once per
   chunk of chunked prefill; each call only enqueues work for the destinations' workers
   (``Transferring``). A chunk sent before step 2 completes goes at once to the decode ranks
   that asked already and is kept for the others, each of which gets every kept chunk when
   it asks: one slow decode rank does not hold back the others' KV.
4. A worker maps the chunk through the link's index mapper (via the staging strategy), submits
   one transfer tagged with a :class:`~kvwire.control.wire.ChunkNote`, waits for it, and after
   the last chunk writes the aux row (when this rank is the aux sender for that decode rank) or,
   when the last chunk carried no KV, sends a :class:`~kvwire.control.wire.Completion` marker.
5. When every destination is done the room is ``Success``. Any failure fails the room, is pushed
   to every destination, and is re-raised by ``failure_exception()``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from kvwire.backend import Notification
from kvwire.control.wire import (
    Failure,
    Message,
    TransferRequest,
    WritesDone,
    WritesQuery,
)
from kvwire.errors import (
    ConfigError,
    DescriptorError,
    KVWireError,
    TransferError,
)
from kvwire.index.base import check_pages
from kvwire.session.common import Side
from kvwire.session.context import RankContext
from kvwire.session.groups import send_groups
from kvwire.session.layers import LayerGate
from kvwire.session.peers import Peer
from kvwire.session.poll import KVPoll
from kvwire.session.prefill.dispatch import dest_jobs
from kvwire.session.prefill.early import EarlyBook, RoomIssuer
from kvwire.session.prefill.evictions import EvictionBook
from kvwire.session.prefill.links import DecodeLink, DecodeLinker
from kvwire.session.prefill.pipeline import Pipeline
from kvwire.session.prefill.registration import Registration
from kvwire.session.prefill.requests import dest_for
from kvwire.session.prefill.rooms import Dest, Job, SendRoom
from kvwire.session.prefill.warm import warm_ahead
from kvwire.session.prefill.workers import TransferWorkers, shard_for
from kvwire.session.prefill.writes import WriteBook
from kvwire.session.rooms import RoomTable
from kvwire.timer_slack import set_thread_slack

logger = logging.getLogger(__name__)


class PrefillSide(Side[SendRoom]):
    """The prefill role of a rank (built by the façade,
    :class:`~kvwire.session.manager.KVManager`, with the rank context and the room table).

    Lock contract: room tables (``rooms``, ``early``,
    ``book.inflight``) are guarded by ``self.rooms.lock``, held only for table updates and queue
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
        "evicted": "not_for_role",
    }

    def __init__(
        self,
        ctx: RankContext,
        rooms: RoomTable[SendRoom],
        bootstrap_addr: str | None,
        issuer: RoomIssuer | None = None,
    ) -> None:
        super().__init__(ctx, rooms)
        #: The engine's word on which rooms will still get a sender (None: any may).
        self.issuer = issuer
        #: Requests and failures for rooms whose sender does not exist yet, and failures of
        #: cleared rooms (see :mod:`kvwire.session.prefill.early`).
        self.early: EarlyBook[Dest] = EarlyBook(ctx.options.bootstrap_timeout_s)
        self.sender_id = ctx.layout.rank.sender_id
        #: Writes in flight and the workers' sections of the room lock (their WorkerSide).
        self.book = WriteBook(ctx, rooms, self.sender_id, self._fail)
        opts = ctx.options
        self.workers: TransferWorkers[Job] = TransferWorkers(
            ctx.num_workers,
            ctx.agent_name,
            lambda i: Pipeline(ctx, self.book, i),
            inline=opts.sync_transfers,
            thread_setup=lambda: set_thread_slack(ctx.timer_slack_us),
        )
        ctx.wake_workers = self.workers.notify_all
        #: Decode sessions this rank evicted: their later frames are answered, not dropped.
        self.evictions = EvictionBook(ctx)
        #: Answers decode ranks' hellos (handshake threads).
        self.linker = DecodeLinker(
            ctx, rooms.lock, self.sender_id, self.evictions, self._release_first
        )
        #: This rank's bootstrap registration (and the service, on prefill rank 0).
        self.registration: Registration | None = None
        try:
            self.registration = Registration(ctx, bootstrap_addr)
            self.registration.register(opts.bootstrap_timeout_s)
        except BaseException:
            self.close()  # the workers and handshake threads started above stop too
            raise
        self.bootstrap_addr: str = self.registration.address
        warm_ahead(ctx)  # compiles on the backend's thread: the engine's start overlaps it

    def queued_chunks(self) -> int:
        """Chunks queued for the transfer workers and not yet taken by one. Any thread."""
        return self.workers.queued

    # ------------------------------------------------------------ liveness thread
    def _on_hello(self, msg: Message) -> None:
        """Liveness thread: a decode rank's hello (see :class:`DecodeLinker`)."""
        self.linker.on_hello(msg)

    def on_unsigned(self, msg: Message) -> None:
        """Liveness thread: a hello without the MAC this rank requires (answered, why)."""
        self.linker.on_unsigned(msg)

    def _on_request(self, msg: TransferRequest) -> None:
        ctx = self.ctx
        with self.rooms.lock:
            peer = ctx.peers.get(msg.session)
            if peer is None:
                if not self.evictions.answer(msg.session, msg.room, time.monotonic()):
                    logger.warning(
                        "%s: transfer request for room %d from unknown session %s dropped "
                        "(never handshaken here: no endpoint to answer)",
                        ctx.agent_name,
                        msg.room,
                        msg.session,
                    )
                return
            try:
                dest = dest_for(msg, peer, ctx.aux_slots, ctx.layout.rank.tp_rank)
            except KVWireError as exc:
                ctx.tell(
                    peer.endpoint,
                    Failure(room=msg.room, session=ctx.session, reason=f"refused: {exc}"),
                )
                return
            room = self.rooms.get(msg.room)
            failed = self.early.failed_recently(msg.room)
            if room is not None and room.error is not None:
                failed = str(room.error)
            if failed is not None:  # the request already failed here: tell decode now
                ctx.tell(peer.endpoint, Failure(room=msg.room, session=ctx.session, reason=failed))
                return
            if room is None:
                never = self.issuer.never(msg.room) if self.issuer is not None else None
                if never is None:
                    self.early.add_request(msg.room, msg.session, dest, time.monotonic())
                else:
                    self._refuse_unknown(msg.room, peer.endpoint, never)
                return
            if room.ready and msg.session not in room.dests:  # e.g. replayed params
                served = "every decode rank it feeds asked for it already"
                self._refuse_unknown(msg.room, peer.endpoint, served)
                return
            self._add_dest(room, dest)

    def _refuse_unknown(self, room_id: int, endpoint: str, why: str) -> None:
        """Under the room lock: tell a decode rank this rank will never hold ``room_id``."""
        ctx = self.ctx
        reason = f"prefill rank {ctx.agent_name} does not hold room {room_id}: {why}"
        logger.warning("%s", reason)
        ctx.tell(endpoint, Failure(room=room_id, session=ctx.session, reason=reason))

    def _add_dest(self, room: SendRoom, dest: Dest) -> None:
        """Under the room lock: a decode rank's request joins its room."""
        if self.rooms.status.get(room.room, KVPoll.Bootstrapping) is KVPoll.Failed:
            return
        expected = dest.fan_out
        if room.expected is not None and room.expected != expected:
            self._fail(
                room,
                TransferError("decode ranks of one request disagree on decode TP", room=room.room),
            )
            return
        if dest.session in room.dests:  # asked again (replayed params): it has its chunks
            logger.warning(
                "%s: room %d: a repeated request from decode session %s ignored",
                self.ctx.agent_name,
                room.room,
                dest.session,
            )
            return
        room.expected = expected
        room.dests[dest.session] = dest
        for pages, start, last, gate in room.held:  # sent before this rank asked
            if not self._dispatch_to(room, dest, pages, start, last, gate):
                return
        self._maybe_ready(room)

    def _maybe_ready(self, room: SendRoom) -> None:
        """Under the lock: once every expected decode rank asked, the room waits for input
        (or is transferring, if the engine sent chunks already); kept chunks are forgotten
        (every destination has them)."""
        if room.ready or room.expected is None or len(room.dests) < room.expected:
            return
        room.ready = True
        room.metrics.marks["asked"] = time.perf_counter()
        self.rooms.advance(room, KVPoll.WaitingForInput)
        if room.held:
            self.rooms.advance(room, KVPoll.Transferring)
            room.held = []

    def on_notification(self, note: Notification) -> None:
        """Prefill receives no data-plane notifications in WRITE mode; ignore strays."""
        logger.debug("%s: unexpected notification from %s", self.ctx.agent_name, note.peer)

    def on_failure(self, msg: Message) -> None:
        """Liveness thread: a decode rank failed or aborted a room. Accepted from a room's
        destination, or, while the room still waits for its destinations, from any
        authenticated decode rank (one that failed before or during its handshake, e.g. on
        a layout mismatch). A failure for a room with no sender yet is kept (bounded, expiring
        like early requests) and fails the sender when the engine creates it."""
        assert isinstance(msg, Failure)
        what = "aborted" if msg.aborted else "failed"
        with self.rooms.lock:
            self.early.drop_request(msg.room, msg.session)
            room = self.rooms.get(msg.room)
            if room is None:
                reason = f"decode {what} the request: {msg.reason}"
                self.early.add_failure(msg.room, reason, time.monotonic())
                return
            if msg.session not in room.dests and room.ready:
                return  # not one of this room's destinations
            err = TransferError(f"decode {what} the request: {msg.reason}", room=msg.room)
            self._fail(room, err, skip=msg.session)

    def on_peer_lost(self, peer: Peer, why: str) -> None:
        """Control thread: a decode rank is dead or gone; fail its rooms, drop its tables,
        remember the eviction (:mod:`kvwire.session.prefill.evictions`)."""
        self.workers.forget(peer.session)
        with self.rooms.lock:
            early = [r for r, by in self.early.requests.items() if peer.session in by]
            self.early.drop_session(peer.session)
            failed: dict[int, str] = {}
            for room in list(self.rooms.values()):
                if peer.session in room.dests and not self.rooms.terminal(room):
                    err = TransferError(
                        f"decode peer {peer.agent} lost: {why}", room=room.room, peer=peer.agent
                    )
                    self._fail(room, err, skip=peer.session)
                    failed[room.room] = str(err)
            self.evictions.evicted(peer, why, failed, early)
        self.ctx.later(lambda: self._release_peer(peer))

    def on_stranger(self, session: str) -> None:
        """Liveness thread: a heartbeat from a session that is not a peer: an evicted decode
        rank is told so (:meth:`EvictionBook.answer`)."""
        with self.rooms.lock:
            self.evictions.answer(session, None, time.monotonic())

    def _release_first(self, session: str) -> None:
        """Handshake thread, before a decode session evicted earlier is linked again: release
        what its eviction left in the engine now (the deferred release then does nothing, so
        it cannot remove the new link's state)."""
        with self.rooms.lock:
            peer = self.evictions.unreleased(session)
        if peer is not None:
            self._release_peer(peer)

    def _release_peer(self, peer: Peer) -> None:
        """Progress thread (or a handshake thread, :meth:`_release_first`): drop an evicted
        decode rank's engine and strategy state, once."""
        ctx = self.ctx
        with self.rooms.lock:
            if not self.evictions.take_release(peer):
                return
        for strategy in ctx.strategies:
            strategy.peer_lost(peer.session)
        if peer.link is not None:
            self.linker.remove_engine_peer(peer)

    def check_deadlines(self, now: float) -> None:
        """Control thread: bootstrap timeouts and expiry of early requests."""
        limit = self.ctx.options.bootstrap_timeout_s
        with self.rooms.lock:
            self.early.expire(now)
            for room in list(self.rooms.values()):
                if not room.ready and now - room.created > limit and not self.rooms.terminal(room):
                    got = len(room.dests)
                    want = "?" if room.expected is None else str(room.expected)
                    hint = ""
                    unsigned = self.ctx.channel.dropped.get("unauthenticated", 0)
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

    # --------------------------------------------------------------- engine thread
    def create_room(self, room_id: int) -> SendRoom:
        """Engine thread (KVSender creation): a new room, picking up early requests. The
        first room wakes the progress thread, which ticks slowly while the table is empty
        (``IDLE_TICK_S`` in the manager)."""
        with self.rooms.lock:
            room = self.rooms.create(SendRoom(room_id))
            if len(self.rooms) == 1:
                self.ctx.wake.set()
            early_failure, requests = self.early.take(room_id)
            if early_failure is not None:
                self._fail(room, TransferError(early_failure, room=room_id))
            for s, dest in requests:
                if s in self.ctx.peers:
                    self._add_dest(room, dest)
            if self.issuer is not None:
                self.issuer.created(room_id)
                for other, _s, dest, why in self.early.refuse(self.issuer):
                    self._refuse_unknown(other, dest.endpoint, why)
            return room

    def init(self, room: SendRoom, num_pages: int, aux_index: int) -> None:
        """Engine thread: the request's page count and aux row are known."""
        if num_pages < 0:
            raise ConfigError(f"num_pages must be >= 0, got {num_pages}")
        if not 0 <= aux_index < self.ctx.aux_slots:
            raise DescriptorError(
                f"aux_index {aux_index} is outside [0, {self.ctx.aux_slots}) (the aux rows "
                "this manager was built with)"
            )
        with self.rooms.lock:  # plain ints: notes pack them as they are (an engine's NumPy)
            room.num_pages = int(num_pages)
            room.aux_index = int(aux_index)

    def send(
        self,
        room: SendRoom,
        pages: Any,
        last: bool,
        state_indices: Any = None,
        layerwise: bool = False,
    ) -> None:
        """Engine thread: queue one chunk; never blocks on the transfer. ``state_indices``
        (this rank's buffer-group slots) come with the last chunk. ``layerwise``: the chunk's
        layers are computed after this call and marked with :meth:`layer_ready`
        (:mod:`kvwire.session.layers`)."""
        ctx = self.ctx
        if last:
            room.metrics.marks["sent"] = time.perf_counter()
        with self.rooms.lock:
            status = self.rooms.status.get(room.room, KVPoll.Failed)
            if status is KVPoll.Success:
                raise ConfigError(
                    f"room {room.room}: send() after the request succeeded (every chunk was "
                    "already delivered); the chunk is not sent"
                )
        what = "pages"
        try:
            arr = check_pages(pages, ctx.layout.num_slots, "page indices")
            what = "state_indices"
            groups = send_groups(ctx.layout, state_indices, last)
        except KVWireError as exc:
            with self.rooms.lock:
                self._fail(room, TransferError(f"bad {what} in send(): {exc}", room=room.room))
            raise
        with self.rooms.lock:
            if self.rooms.terminal(room):
                return
            problem = room.send_problem(arr.size, last)
            if problem is not None:
                err = ConfigError(f"room {room.room}: {problem}")
                self._fail(room, err)
                raise err
            room.last_queued = last
            room.pages_queued += arr.size
            room.group_src = groups or room.group_src
            room.sent_pages.append(arr)
            gate = None
            if layerwise:
                lay = ctx.layout
                gate = room.gate = LayerGate(
                    lay.start_layer, lay.layer_end, ctx.options.layerwise_groups
                )
                if self.workers.inline:  # a synchronous send cannot wait for the layers
                    room.deferred = (arr, last)
                    return
            self._queue(room, arr, last, gate)

    def _queue(
        self, room: SendRoom, arr: NDArray[np.int64], last: bool, gate: LayerGate | None
    ) -> None:
        """Under the lock: dispatch a chunk to the destinations that asked; until every one
        has, keep it for those still to ask (:meth:`_add_dest`)."""
        assert room.num_pages is not None
        start = room.pages_dispatched
        room.pages_dispatched = start + arr.size
        if room.ready:
            self.rooms.advance(room, KVPoll.Transferring)
        else:
            room.held.append((arr, start, last, gate))
        for dest in list(room.dests.values()):
            if not self._dispatch_to(room, dest, arr, start, last, gate):
                return

    def layer_ready(self, room: SendRoom, layer: int | None, event: Any = None) -> None:
        """Engine thread: layers up to ``layer`` of the open layer-wise chunk are computed
        (once ``event`` completes, when given). Raises ``ConfigError`` without an open
        layer-wise chunk or for a layer out of order."""
        with self.rooms.lock:
            gate = room.gate
            if self.rooms.terminal(room):
                return
            if gate is None:
                raise ConfigError(
                    f"room {room.room}: layer_ready() without a layer-wise chunk "
                    "(send(pages, layerwise=True) first)"
                )
            gate.mark(layer, event)
            if not gate.fully_marked:
                return
            room.gate = None
            if room.deferred is not None:
                (arr, last), room.deferred = room.deferred, None
                self._queue(room, arr, last, None)

    def _dispatch_to(
        self,
        room: SendRoom,
        dest: Dest,
        pages: NDArray[np.int64],
        start: int,
        last: bool,
        gate: LayerGate | None,
    ) -> bool:
        """Under the lock: a chunk (request pages from ``start``) as one destination's jobs,
        handed to its worker. False when the chunk cannot be mapped (the room is failed)."""
        ctx = self.ctx
        peer = ctx.peers.get(dest.session)
        if peer is None:
            return True
        link: DecodeLink = peer.link
        try:
            jobs = dest_jobs(ctx, room, dest, link, pages, start, last, gate, self.sender_id)
        except KVWireError as exc:
            self._fail(room, exc)
            return False
        if dest.shard is None:  # at its first chunk (see shard_for)
            one = ctx.one_worker(link.backend_peer)
            dest.shard = shard_for(dest.session, room.room, link.pools[dest.pool].staged, one)
        for job in jobs:
            self.workers.submit(dest.shard, job, sticky=job.target.staged)
        return True

    def _on_writes_query(self, msg: WritesQuery) -> None:
        """Control thread: decode asks whether it may reuse a failed request's pages (or a
        cleared request's ring space): answer once no write of ours is in flight."""
        with self.rooms.lock:
            room = self.rooms.get(msg.room)
            if room is not None and not self.rooms.terminal(room):
                return  # still live here: its tail releases the space when it ends
            if self.book.inflight.get((msg.room, msg.session), 0):
                return  # a write is still in flight; decode asks again
            peer = self.ctx.peers.get(msg.session)
            # an evicted decode rank still waits for the answer before reusing the pages
            endpoint = peer.endpoint if peer else self.evictions.endpoint(msg.session)
        if endpoint is not None:
            self.ctx.tell(
                endpoint,
                WritesDone(room=msg.room, sender_id=self.sender_id, session=self.ctx.session),
            )

    # ---------------------------------------------------------------- failures
    def _fail(
        self, room: SendRoom, exc: BaseException, skip: str | None = None, aborted: bool = False
    ) -> None:
        """Under the lock: fail a room once, record why, tell every other destination."""
        ctx = self.ctx
        if not self.rooms.fail(room, exc):
            return
        logger.warning("%s: room %d failed: %s", ctx.agent_name, room.room, exc)
        msg = Failure(room=room.room, session=ctx.session, reason=str(exc), aborted=aborted)
        for d in room.dests.values():
            if d.session != skip:
                ctx.tell(d.endpoint, msg)

    def clear(self, room: SendRoom) -> None:
        """Engine thread: forget the room (every terminal path ends here)."""
        with self.rooms.lock:
            if self.rooms.forget(room) and room.error is not None:
                self.early.remember_failed(room.room, str(room.error), time.monotonic())
            self.early.drop_room(room.room)
        for strategy in self.ctx.strategies:
            strategy.release(room.room)

    def room_tables(self) -> dict[str, int]:
        """Per-room table sizes (leak check)."""
        with self.rooms.lock:
            return {
                "send_rooms": len(self.rooms),
                "early_requests": len(self.early),
                "writes_inflight": len(self.book.inflight),
                **{k: v for st in self.ctx.strategies for k, v in st.room_tables().items()},
            }

    def close(self) -> None:
        """Manager shutdown: fail live rooms, stop workers and the bootstrap service."""
        with self.rooms.lock:
            self._fail_live("prefill manager closed")
        self.workers.stop()
        self.linker.close()
        if self.registration is not None:
            self.registration.close()
