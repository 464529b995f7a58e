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
   notification arrives. Every sender complete and aux arrived: ``Success``.
4. Failures pushed by prefill, a dead prefill rank (heartbeats), or the waiting deadline fail the
   room; the engine calls ``clear()`` on every path.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

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
    DescriptorError,
    HandshakeError,
    KVWireError,
    ProtocolError,
    TransferError,
)
from kvwire.index.base import check_pages
from kvwire.integrity import add_sums, layer_ranges, mismatched_layers
from kvwire.session import metrics as m
from kvwire.session.common import Side
from kvwire.session.decode_links import PrefillLink, SourceLinks
from kvwire.session.groups import check_state_indices, to_wire
from kvwire.session.manager import KVManager
from kvwire.session.metrics import RequestMetrics
from kvwire.session.peers import Peer
from kvwire.session.poll import KVPoll
from kvwire.session.quiesce import WriteQuarantine
from kvwire.session.rejoin import Rejoin
from kvwire.session.report import (
    ChunkFault,
    FailureCause,
    FailureReport,
    LandedChunks,
    SourceState,
    build_report,
)
from kvwire.staging.base import ArrivedChunk, StagingStrategy

logger = logging.getLogger(__name__)


@dataclass
class RecvRoom:
    """State of one request on this decode rank; removed on clear()."""

    room: int
    bootstrap_addr: str
    t0: float = field(default_factory=time.perf_counter)
    sources: list[PrefillLink] | None = None
    aux_sender: int = -1
    dst_pages: NDArray[np.int64] | None = None
    aux_index: int = -1
    requested: bool = False
    #: When the room last advanced (requested, or a part of it landed).
    last_progress: float = 0.0
    #: Control endpoints of the prefill ranks this room needs, known from the bootstrap
    #: lookup before (or without) a handshake: a failure is pushed there when the room has
    #: no handshaken sources (e.g. the handshake was refused).
    contacts: list[str] = field(default_factory=list)
    received: dict[int, int] = field(default_factory=dict)
    expected: dict[int, int] = field(default_factory=dict)
    #: Segments of chunks still missing some: (sender id, chunk id) -> segments arrived.
    partial: dict[tuple[int, int], int] = field(default_factory=dict)
    #: Notes of KV segments counted: (what, sender id, chunk id, part). A segment resent
    #: over a fallback backend after failover is counted once (docs/failover.md).
    notes_seen: set[tuple[str, int, int, int]] = field(default_factory=set)
    #: With checksums: per-layer sums the parts of a chunk carried so far, by (sender id,
    #: chunk id); dropped once the chunk is checked.
    sent_sums: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)
    aux_done: bool = False
    #: Buffer groups: this rank's slots for the request, and the senders whose group
    #: transfer landed.
    group_dst: dict[str, NDArray[np.int64]] = field(default_factory=dict)
    groups_from: set[int] = field(default_factory=set)
    #: Source sessions that confirmed (or are gone) that none of their writes for this failed
    #: request is in flight; and when they were last asked.
    quiet: set[str] = field(default_factory=set)
    queried_at: float = 0.0
    failed_at: float = 0.0
    #: The pool the KV goes to ("kv" or "host"); for "host", whether the engine hooks ran.
    pool: str = "kv"
    hooked: bool = False
    #: Prompt tokens decode keeps cached (``send_metadata(cached_tokens=)``), if given.
    cached_tokens: int | None = None
    error: BaseException | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    #: What complete chunks wrote, per sender (the failure report's evidence).
    landed: LandedChunks = field(default_factory=LandedChunks)
    #: Why the room failed (set with ``error``), the peer it names, the chunk a checksum
    #: mismatch names.
    cause: FailureCause = "protocol"
    fault_peer: str | None = None
    fault_chunk: ChunkFault | None = None
    #: The failure report, built once (the room stops listening when it fails).
    report: FailureReport | None = None
    #: Prefill sessions asked again after they dropped the request unread (:mod:`.rejoin`).
    asked_again: set[str] = field(default_factory=set)


class DecodeSide(Side[RecvRoom]):
    """The decode role of a :class:`~kvwire.session.manager.KVManager`.

    Lock contract: room tables, the quarantine and source progress are guarded by
    ``mgr.lock``, held for table updates (and a staged chunk's placement by the strategy),
    never across an engine call or a wait. The prefill ranks known (lookups, handshakes) are
    :attr:`sources`' (its own lock, taken after ``mgr.lock`` when both are held). Message
    handlers run on the liveness thread, notification handling and deadlines on the progress
    thread.
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

    def __init__(self, mgr: KVManager) -> None:
        super().__init__(mgr)
        #: The prefill ranks looked up and handshaken with.
        self.sources = SourceLinks(mgr)
        #: Failed rooms whose sources may still be writing (see :mod:`kvwire.session.quiesce`).
        self.quarantine = WriteQuarantine(
            self.sources, mgr.options.transfer_timeout_s, mgr.agent_name
        )
        #: When each prefill session last delivered anything (deadlines are on progress: a
        #: request queued behind others lives while its sources advance).
        self.source_progress: dict[str, float] = {}
        self.bootstraps = concurrent.futures.ThreadPoolExecutor(
            4, thread_name_prefix=f"kvwire-bs-{mgr.agent_name}"
        )
        #: Prefill ranks that evicted this rank: links dropped, unheard requests repeated.
        self.rejoin = Rejoin(self)

    # ------------------------------------------------------------ bootstrapping
    def create_room(self, room_id: int, bootstrap_addr: str) -> RecvRoom:
        """Engine thread (KVReceiver creation)."""
        with self.mgr.lock:
            return self._add_room(RecvRoom(room_id, bootstrap_addr))

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
            with self.mgr.lock:
                if not self._terminal(room):  # pushed to the contacts bootstrap listed
                    self._fail(room, exc, cause="bootstrap")
            return
        self._resolved(room, sources)

    def _resolved(self, room: RecvRoom, sources: list[PrefillLink]) -> None:
        """The room's source ranks are known and handshaken: WaitingForInput."""
        r = self.mgr.layout.rank
        aux = self.sources.topology(sources[0].info).aux_sender(r.tp_rank)
        with self.mgr.lock:
            if self._terminal(room):
                if room.error is not None and not room.contacts:
                    # failed before its sources were known: they learn of it now
                    room.sources = sources
                    self._push_failure(room, room.error, None, False)
                return
            room.sources = sources
            room.aux_sender = aux
            self.mgr.status.update(room.room, KVPoll.WaitingForInput)
            if room.dst_pages is not None:
                self._request(room)

    def _sources(self, room: RecvRoom, dp: int | None) -> list[PrefillLink]:
        addr, room_id = room.bootstrap_addr, room.room
        opts = self.mgr.options
        client = BootstrapClient(addr, self.mgr.config.secret_bytes)
        ranks = self.sources.lookup(client, addr, 0 if dp is None else dp)
        if dp is None and ranks[0].dp_size > 1:
            ranks = self.sources.lookup(client, addr, room_id % ranks[0].dp_size)
        r = self.mgr.layout.rank
        try:
            wanted = set(self.sources.topology(ranks[0]).sources(r.tp_rank))
        except KVWireError as exc:
            raise HandshakeError(f"cannot pair with the prefill instance at {addr}: {exc}") from exc
        chosen = [x for x in ranks if (x.tp_rank, x.pp_rank) in wanted]
        with self.mgr.lock:  # the ranks found hear of a failure from here on
            room.contacts = [x.endpoint for x in chosen]
            if room.error is not None:  # failed while we looked its sources up
                self._push_failure(room, room.error, None, False)
                raise TransferError("request failed during bootstrap", room=room_id)
        if len(chosen) != len(wanted):
            raise BootstrapError(
                f"bootstrap at {addr} lists {len(chosen)} of the {len(wanted)} prefill ranks "
                "this decode rank needs"
            )
        own = self.mgr.channel.endpoint
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
        with self.mgr.lock:
            self.quarantine.confirmed(self.rooms.get(msg.room), msg.room, msg.session)
        for strategy in self.mgr.strategies:
            strategy.writes_ended(msg.room, msg.session)

    def _on_completion(self, msg: Message) -> None:
        """Liveness thread: a sender's last chunk moved no KV; it says how many did."""
        assert isinstance(msg, Completion)
        with self.mgr.lock:
            room = self._room_for(msg.room, msg.session, msg.sender_id)
            if room is not None:
                room.expected[msg.sender_id] = msg.data_chunks
                room.last_progress = time.monotonic()
                self._check_done(room)

    def on_notification(self, note: Notification) -> None:
        """Control thread: a data-plane notification (data already landed)."""
        mgr = self.mgr
        try:
            msg = mgr.codec.decode(note.payload)
        except ProtocolError as exc:
            mgr.channel.dropped[
                "note_" + ("unauthenticated" if "authentic" in str(exc) else "malformed")
            ] += 1
            logger.warning("%s: dropped a notification from %s: %s", mgr.agent_name, note.peer, exc)
            return
        if isinstance(msg, ChunkNote):
            mgr.peers.touch(msg.session)
            self._on_note(msg)

    def _on_note(self, msg: Message) -> None:
        """Progress thread (a backend notification) or liveness thread (the control message
        of a copy prefill made itself): one chunk segment, or the aux row, landed."""
        assert isinstance(msg, ChunkNote)
        mgr = self.mgr
        now = time.monotonic()
        with mgr.lock:
            self.source_progress[msg.session] = now
            room = self._room_for(msg.room, msg.session, msg.sender_id)
            if room is None:
                return
            room.last_progress = now
            room.metrics.marks["noted"] = time.perf_counter()
            if msg.what == "aux":
                if room.aux_sender != msg.sender_id:
                    self._fail(
                        room,
                        TransferError(
                            f"aux row written by sender {msg.sender_id}, "
                            f"expected {room.aux_sender}",
                            room=room.room,
                        ),
                    )
                    return
                stamp = int(mgr.stamps[room.aux_index, 0])
                if stamp != room.room:
                    self._fail(
                        room,
                        TransferError(
                            f"aux row {room.aux_index} carries room stamp {stamp}, not {room.room} "
                            "(aux row reused while a transfer was in flight?)",
                            room=room.room,
                        ),
                    )
                    return
                room.aux_done = True
            elif msg.what == "state":  # the sender's buffer groups landed (after its KV)
                room.groups_from.add(msg.sender_id)
            else:
                key = (msg.sender_id, msg.chunk_id)
                if msg.parts > 1 and msg.part >= msg.parts:
                    logger.warning(
                        "%s: room %d: dropped a note for segment %d of %d",
                        mgr.agent_name,
                        room.room,
                        msg.part,
                        msg.parts,
                    )
                    return
                seen = (msg.what, msg.sender_id, msg.chunk_id, msg.part)
                if seen in room.notes_seen:  # resent after failover: its data landed again
                    return
                room.notes_seen.add(seen)
                if msg.sums:  # after the check above: a dropped note adds nothing
                    add_sums(
                        room.sent_sums.setdefault(key, {}),
                        dict(zip(msg.sum_layers, msg.sums, strict=True)),
                    )
                if msg.parts > 1:
                    got = room.partial.get(key, 0) + 1
                    if got < msg.parts:
                        room.partial[key] = got
                        return
                    room.partial.pop(key, None)
                arrived = ArrivedChunk(
                    room.room, msg.session, msg.chunk_id, msg.what, room.dst_pages
                )
                try:
                    self._strategy(room).on_arrival(arrived)
                except KVWireError as exc:
                    self._fail(room, exc)
                    return
                try:
                    self._check_sums(room, msg, room.sent_sums.pop(key, {}))
                except KVWireError as exc:
                    self._fail(room, exc, cause="checksum_mismatch")
                    return
                room.received[msg.sender_id] = room.received.get(msg.sender_id, 0) + 1
                if room.pool == "kv":
                    room.landed.add(msg.sender_id, msg.span, msg.num_pages, msg.page_size)
                if msg.last:
                    room.expected[msg.sender_id] = msg.chunk_id + 1
            self._check_done(room)

    def _check_sums(self, room: RecvRoom, msg: ChunkNote, sent: dict[int, int]) -> None:
        """Progress thread, under the lock, once a KV chunk is complete (every part arrived,
        staged blocks scattered): when its source sends checksums, compare the sums its
        notes carried with those of the rows that landed; raise naming the chunk, the layers
        and the peer when they differ."""
        assert room.sources is not None and room.dst_pages is not None
        link = next(
            s
            for s in room.sources
            if s.info.session == msg.session and s.sender_id == msg.sender_id
        )
        if link.checksums is None or room.pool != "kv":
            return
        if msg.span is None or msg.num_pages is None:
            raise TransferError(
                f"chunk {msg.chunk_id} from {link.info.agent} (sender {msg.sender_id}) came "
                "without its checksum, which this rank asked for",
                room=room.room,
            )
        try:
            landed = link.checksums.chunk(
                msg.num_pages, room.dst_pages, room.cached_tokens, msg.span
            )
        except Exception as exc:  # a note that names no chunk of this request
            raise TransferError(
                f"cannot check chunk {msg.chunk_id} from {link.info.agent}: {exc}", room=room.room
            ) from exc
        bad = mismatched_layers(sent, landed)
        if bad:
            room.fault_peer = link.info.agent
            room.fault_chunk = ChunkFault(
                link.info.agent, msg.sender_id, msg.chunk_id, msg.span, layer_ranges(bad)
            )
            raise TransferError(
                f"KV checksum mismatch in chunk {msg.chunk_id} (request pages "
                f"[{msg.span[0]}, {msg.span[1]})) from {link.info.agent} (sender "
                f"{msg.sender_id}): layers {layer_ranges(bad)} differ from what it sent",
                room=room.room,
            )

    def awaiting_data(self) -> bool:
        """Control thread: some request asked for its KV and is not complete yet."""
        status = self.mgr.status
        return any(
            status.get(r.room, KVPoll.Failed) is KVPoll.Transferring
            for r in list(self.rooms.values())
        )

    def _strategy(self, room: RecvRoom) -> StagingStrategy:
        """The strategy of the pool the room's KV goes to."""
        return self.mgr.host_staging if room.pool == "host" else self.mgr.staging

    def room_pages(self, room_id: int, pool: str) -> Any:
        """Any thread (strategies, through ``StagingContext.room_pages``): the destination
        pages of a live request whose KV goes to ``pool``, else None."""
        with self.mgr.lock:
            room = self.rooms.get(room_id)
            if room is None or room.dst_pages is None or self._terminal(room):
                return None
            return room.dst_pages if room.pool == pool else None

    def _room_for(self, room_id: int, session: str, sender_id: int) -> RecvRoom | None:
        """The live room a message is for, if it comes from one of the room's sources."""
        room = self.rooms.get(room_id)
        if room is None or room.sources is None or self._terminal(room):
            return None
        if not any(s.info.session == session and s.sender_id == sender_id for s in room.sources):
            logger.warning(
                "%s: room %d: message from a non-source (%s, sender %d) dropped",
                self.mgr.agent_name,
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
        self.succeed(room)

    def on_failure(self, msg: Message) -> None:
        """Liveness thread: a prefill rank failed or aborted a room (or did not accept its
        request: it evicted this rank, :mod:`.rejoin`)."""
        assert isinstance(msg, Failure)
        if msg.unheard:
            self.rejoin.on_unheard(msg)
            return
        with self.mgr.lock:
            room = self.rooms.get(msg.room)
            if room is None or self._terminal(room):
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
        with self.mgr.lock:
            asks = self.quarantine.due_queries(now, list(self.rooms.values()))
        for endpoint, room_id in asks:
            self.mgr.tell(endpoint, WritesQuery(room=room_id, session=self.mgr.session))

    def run_hooks(self, room: RecvRoom, status: KVPoll) -> None:
        """Engine thread, the first time a host-pool request is seen terminal (poll or clear):
        admit it with its token count, or abandon it — exactly once per request."""
        hooks = self.mgr.hooks
        with self.mgr.lock:
            if room.pool != "host" or room.hooked or hooks is None:
                return
            room.hooked = True
        if status is KVPoll.Success:
            assert self.mgr.host_layout is not None and room.dst_pages is not None
            hooks.on_admit(
                room.room, int(room.dst_pages.size) * self.mgr.host_layout.model.page_size
            )
        else:
            hooks.on_abandon(room.room)

    def writes_quiesced(self, room: RecvRoom) -> bool:
        """Engine thread: whether no source can still write into this request's pages."""
        with self.mgr.lock:
            if room.sources is None or not room.requested:
                return True  # no source was ever told where to write
            if room.error is None:
                return self.mgr.status.get(room.room, KVPoll.Failed) is KVPoll.Success
            return self.quarantine.quiesced(room, room.room in self.rooms, time.monotonic())

    def on_peer_lost(self, peer: Peer, why: str) -> None:
        """Control thread: a prefill rank is dead or gone; fail the rooms it feeds and free the
        ring space it held."""
        for strategy in self.mgr.strategies:
            self.mgr.later(functools.partial(strategy.peer_lost, peer.session))
        with self.mgr.lock:
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
        limit = self.mgr.options.waiting_timeout_s
        with self.mgr.lock:
            for room in list(self.rooms.values()):
                if not room.requested or room.sources is None or self._terminal(room):
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
                            f"{'arrived' if room.aux_done else 'missing'})",
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
        ``pool="host"`` the host pool, in its page units), its buffer-group slots, and the
        prompt tokens kept cached here."""
        mgr = self.mgr
        target = mgr.layout
        if pool not in ("kv", "host"):
            raise ConfigError(f"pool must be 'kv' or 'host', not {pool!r}")
        if pool == "host":
            if mgr.host_layout is None:
                raise ConfigError(
                    "pool='host' needs a host pool: build the decode manager with "
                    "KVManager(..., host_layout=<the host KV pool's layout>)"
                )
            target = mgr.host_layout
        try:
            arr = check_pages(pages, target.num_slots, "destination page indices")
            if np.unique(arr).size != arr.size:
                raise DescriptorError(
                    "destination page indices repeat a slot; each page needs its own slot"
                )
            if not 0 <= aux_index < mgr.aux_slots:
                raise DescriptorError(f"aux_index {aux_index} is outside [0, {mgr.aux_slots})")
            groups = check_state_indices(mgr.layout, state_indices, "send_metadata()")
            if cached_tokens is not None and (
                isinstance(cached_tokens, bool)
                or not isinstance(cached_tokens, int | np.integer)
                or cached_tokens < 0
            ):
                raise DescriptorError(
                    f"cached_tokens must be a non-negative int, not {cached_tokens!r}"
                )
        except KVWireError as exc:
            with mgr.lock:
                self._fail(
                    room,
                    TransferError(f"bad input to send_metadata(): {exc}", room=room.room),
                    cause="bad_input",
                )
            raise
        with mgr.lock:
            if room.dst_pages is not None:
                raise ConfigError(f"room {room.room}: send_metadata() was already called")
            if self._terminal(room):
                return
            mgr.stamps[aux_index, 0] = 0
            room.dst_pages = arr
            room.aux_index = aux_index
            room.pool = pool
            room.group_dst = groups
            room.cached_tokens = None if cached_tokens is None else int(cached_tokens)
            if room.sources is not None:
                self._request(room)
        if pool == "host" and mgr.hooks is not None:
            mgr.hooks.on_prealloc(room.room, int(arr.size))

    def _request(self, room: RecvRoom) -> None:
        """Under the lock: send the transfer request to every source rank."""
        assert room.sources is not None
        mgr = self.mgr
        msg = self.request_message(room)
        room.metrics.marks["requested"] = time.perf_counter()
        for s in room.sources:
            mgr.tell(s.info.endpoint, msg)
        room.requested = True
        room.last_progress = time.monotonic()
        mgr.status.update(room.room, KVPoll.Transferring)

    def request_message(self, room: RecvRoom) -> TransferRequest:
        """Under the lock: the room's transfer request (the same to every source rank)."""
        assert room.dst_pages is not None
        return TransferRequest(
            room=room.room,
            session=self.mgr.session,
            dst_pages=pages_to_bytes(room.dst_pages),
            aux_index=room.aux_index,
            pool="host" if room.pool == "host" else "kv",  # typed Literal on the wire
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
        if not self._mark_failed(room, exc):
            return
        room.cause = "aborted" if aborted else cause
        logger.warning("%s: room %d failed: %s", self.mgr.agent_name, room.room, exc)
        self._push_failure(room, exc, skip, aborted)

    def _push_failure(
        self, room: RecvRoom, exc: BaseException, skip: str | None, aborted: bool
    ) -> None:
        """Under the lock: tell the room's prefill ranks it failed: its handshaken sources,
        or, before (or without) a handshake, the control endpoints bootstrap listed."""
        mgr = self.mgr
        msg = Failure(room=room.room, session=mgr.session, reason=str(exc), aborted=aborted)
        if room.sources is not None:
            endpoints = [s.info.endpoint for s in room.sources if s.info.session != skip]
        else:  # the ranks bootstrap listed, but those known dead
            endpoints = [ep for ep in room.contacts if not self.sources.gone_endpoint(ep)]
        for ep in endpoints:
            mgr.tell(ep, msg)

    def clear(self, room: RecvRoom) -> None:
        """Engine thread: forget the room. A failed room whose sources have not all confirmed
        that their writes ended stays in ``quarantine`` (asked again until they do)."""
        with self.mgr.lock:
            if self._forget(room) and room.aux_index >= 0:
                self.mgr.stamps[room.aux_index, 0] = 0
            self.quarantine.hold(room)
        for strategy in self.mgr.strategies:
            strategy.release(room.room)

    def failure_report(self, room: RecvRoom) -> FailureReport | None:
        """Engine thread (``KVReceiver.failure_report``): what of a failed request landed on
        this rank and what is missing (:mod:`kvwire.session.report`); None unless it failed.
        Chunks arriving after the failure are not counted (the room stopped listening)."""
        with self.mgr.lock:
            if room.error is None or room.report is not None:
                return room.report
            states = [
                SourceState(
                    s.sender_id,
                    s.dummy,
                    s.sender_id in room.expected
                    and room.received.get(s.sender_id, 0) == room.expected[s.sender_id],
                    not s.groups or s.sender_id in room.groups_from,
                )
                for s in room.sources or ()
            ]
            room.report = build_report(
                room.room,
                room.cause,
                str(room.error),
                room.dst_pages,
                room.landed,
                states,
                self.mgr.layout.model.page_size,
                room.cached_tokens,
                room.aux_done,
                judged=room.pool == "kv" and room.requested,
                peer=room.fault_peer,
                chunk=room.fault_chunk,
            )
        kept, lost = int(room.report.good_pages.size), int(room.report.missing_pages.size)
        m.FAILED_PAGES.labels(**self.mgr.labels, result="kept").inc(kept)
        m.FAILED_PAGES.labels(**self.mgr.labels, result="missing").inc(lost)
        return room.report

    def room_tables(self) -> dict[str, int]:
        """Per-room table sizes (leak check)."""
        with self.mgr.lock:
            return {
                "recv_rooms": len(self.rooms),
                "quarantine": len(self.quarantine),
                "handshakes_pending": self.sources.pending_count(),
                **{k: v for st in self.mgr.strategies for k, v in st.room_tables().items()},
            }

    def close(self) -> None:
        """Manager shutdown: fail live rooms and stop the bootstrap threads."""
        with self.mgr.lock:
            for room in list(self.rooms.values()):
                if not self._terminal(room):
                    err = TransferError("decode manager closed", room=room.room)
                    self._fail(room, err, cause="closed")
        self.sources.close("decode manager closed")
        self.bootstraps.shutdown(wait=False, cancel_futures=True)
