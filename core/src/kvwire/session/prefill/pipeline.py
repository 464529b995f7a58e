"""The transfer pipeline each prefill worker thread owns.

A worker keeps up to ``max_inflight`` chunk transfers posted at once instead of waiting for
each: it submits every job it takes from its queue (in queue order, so a destination's chunks are
posted in order) and polls the posted handles between jobs. For one (request, destination) the
destination counts as done only after every KV chunk and the aux row completed. The aux row
rides in the last chunk's final note where decode takes it so (protocol 1.11,
:mod:`kvwire.session.aux_note`), else it is posted right after the last KV chunk is posted,
staged or not (decode accepts the notes in any order); the "no more KV" marker only after
every KV chunk of that destination completed. One :class:`Pipeline` per worker thread; it is
not shared, so it needs no lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from kvwire.backend import Note, PreparedPair, TransferHandle, XferOp, XferState
from kvwire.control.wire import ChunkNote, Completion
from kvwire.errors import KVWireError, TransferError
from kvwire.integrity import LayerSums
from kvwire.session import metrics as m
from kvwire.session.context import RankContext
from kvwire.session.metrics import ChunkDone
from kvwire.session.prefill import late_sums, pace, posting
from kvwire.session.prefill.groups import GROUPS_TABLE, group_rows, state_note
from kvwire.session.prefill.lane import Lane
from kvwire.session.prefill.layerwise import LayerPosting
from kvwire.session.prefill.notes import NoteFrames
from kvwire.session.prefill.pace import PollPace
from kvwire.session.prefill.posting import (
    PlanRef,
    Posted,
    SegmentPost,
    Tail,
    WorkerSide,
    summed_pieces,
)
from kvwire.session.prefill.rooms import Job, SendRoom
from kvwire.staging.base import ChunkPlan, LocalCopy, Segment

logger = logging.getLogger(__name__)


class Pipeline:
    """Posts chunk transfers, polls them, and finishes each destination in order.

    Built by the prefill side per worker thread with the rank context and the side's
    worker-facing interface (:class:`~kvwire.session.prefill.posting.WorkerSide`); composes a
    :class:`~kvwire.session.prefill.layerwise.LayerPosting` for layer-wise chunks and a
    :class:`~kvwire.session.prefill.lane.Lane` for a turn's whole-request page writes."""

    def __init__(self, ctx: RankContext, side: WorkerSide, index: int = 0) -> None:
        self.side = side
        self.index = index
        self.ctx = ctx
        self.max_inflight = ctx.options.max_inflight_chunks
        #: The backend calls a write's ``wake`` when it ends (see :meth:`idle`).
        self.evented = ctx.backend.pushes_events
        #: Posts layer-wise chunks group by group through this pipeline's primitives.
        self.layers = LayerPosting(self, index, ctx.options.transfer_timeout_s)
        #: This worker's note frames (a chunk's only note, an aux row's).
        self.notes = NoteFrames(ctx.codec, side.sender_id, ctx.session, ctx.layout.model.page_size)
        #: Set by a layer-wise chunk's gate when the engine marks layers (see :meth:`idle`).
        self.wake = threading.Event()
        #: Whole-request page writes launched a turn at a time (:mod:`.lane`).
        self.lane = Lane(ctx, side, self.notes, self.wake, self.accept)
        self.posted: list[Posted] = []
        self.tails: dict[tuple[int, str], Tail] = {}
        #: When to poll unannounced writes first (:mod:`~kvwire.session.prefill.pace`).
        self.pace = PollPace()
        #: Requests a write of which this turn posted (marked ``turn_end`` when it ends;
        #: none kept outside a turn: the synchronous mode has no turns).
        self._posted_rooms: list[SendRoom] = []
        self._in_turn = False

    @property
    def busy(self) -> bool:
        """Transfers are in flight, or jobs wait (for staging space)."""
        return bool(self.posted) or self.lane.busy or any(t.queue for t in self.tails.values())

    @property
    def full(self) -> bool:
        """As many transfers in flight as allowed: poll before taking another job."""
        return len(self.posted) + self.lane.inflight >= self.max_inflight

    # ------------------------------------------------------------------ jobs
    def accept(self, job: Job) -> None:
        """Queue a job behind its destination's earlier ones and post what can be posted
        (a turn's job that no earlier one precedes may take the lean lane instead)."""
        key = (job.room.room, job.dest.session)
        tail = self.tails.get(key)
        if tail is None and self._in_turn and self.lane.take(job, self.plan):
            return
        if tail is None:
            tail = self.tails[key] = Tail(job.room, job.dest, job.target)
        tail.queue.append(job)
        if job.last:
            job.room.metrics.marks["taken"] = time.perf_counter()
        tail.staged |= job.target.staged
        self._advance(key, tail)

    def _advance(self, key: tuple[int, str], tail: Tail) -> bool:
        """Post the tail's queued jobs in order until one must wait; True if any was posted."""
        moved = False
        while tail.queue:
            if self.side.is_dead(tail.room):
                self._drop(key, tail)
                return moved
            job = tail.queue[0]
            room = job.room
            t_start = time.perf_counter()
            try:
                if job.gate is not None and job.chunk_id is None:
                    if self.layers.gate_ready(job) < job.gate.end:
                        return moved  # no KV here, but the aux row follows the last layer
                elif job.gate is not None:
                    if not self.layers.post(tail, job, t_start):
                        return moved  # later layers are not computed yet
                elif job.chunk_id is not None:
                    plan = self.plan(job)
                    if plan is None:
                        return moved  # waiting for staging space; asked again on progress()
                    if job.last:
                        room.metrics.marks["planned"] = time.perf_counter()
                    if not plan.empty:
                        self.post_plan(tail, job, plan, t_start)
                tail.queue.popleft()
                moved = True
                if job.last:
                    tail.last = job
                    self._finish_tail(key)
            except Exception as exc:
                self._failed(room, exc, "write")
                self._drop(key, tail)
                return moved
        return moved

    def plan(self, job: Job) -> ChunkPlan | None:
        """The strategy's plan for a job's chunk (None: wait for staging space), or the one
        the lean lane made already."""
        if job.planned is not None:
            plan, job.planned = job.planned, None
            return plan
        return job.target.strategy.plan(job.plan_request(self.index))

    def segments(self, job: Job, plan: ChunkPlan) -> list[Segment]:
        """A plan's parts: the strategy's own segments, or its one row set; rows of a pair
        that mixes memory kinds split into one segment per (source kind, destination kind).
        Copies the strategy already started come first (they are running)."""
        if plan.segments is not None:
            base = plan.segments
        else:
            # "kv" names the mapper's own table of the job's pool
            table = job.target.table if plan.table == "kv" else plan.table
            base = [plan.segment(table)]
        out: list[Segment] = []
        for seg in base:
            split = job.link.splits.get(seg.table) if seg.copy is None else None
            out.extend(split.segments(seg.src_idx, seg.dst_idx) if split else [seg])
        out.sort(key=lambda sg: sg.copy is None)
        return out

    def post_plan(self, tail: Tail, job: Job, plan: ChunkPlan, t_start: float) -> None:
        """Post every segment of one chunk, each with its own note (``parts`` of them); a
        chunk that moves as one segment of one prepared pair with no checksum (the common
        case) as :meth:`_post_whole` posts it."""
        if plan.segments is None and (job.pool != "kv" or job.link.checksums is None):
            table = job.target.table if plan.table == "kv" else plan.table
            if table not in job.link.splits:
                self._post_whole(tail, job, plan, table, t_start)
                return
        segs = self.segments(job, plan)
        ref = PlanRef(job.target.strategy, plan, job.room.room)
        segs, pieces = summed_pieces(job, plan, segs, self.evented)
        late = late_sums.sums_after(job, segs, pieces)
        n = len(segs) + late
        post = SegmentPost(tail, job, ref, plan.what, segs, n, 0, t_start, None, pieces, late)
        self.post_segments(post)

    def _post_whole(
        self, tail: Tail, job: Job, plan: ChunkPlan, table: str, t_start: float
    ) -> None:
        """:meth:`post_segments` of a chunk of one segment and part, no checksum: the same
        write and note (packed by :attr:`notes`), none of the per-part bookkeeping."""
        pair, room = job.link.pairs.get(table), job.room
        if pair is None:
            raise TransferError(f"no prepared table {table!r}", room=room.room)
        assert job.chunk_id is not None
        ref = PlanRef(job.target.strategy, plan, room.room)
        try:
            aux = posting.carried_aux(self.ctx, tail, job)
            note = self.notes.chunk(
                room.room, plan.what, job.chunk_id, job.last, job.span, room.num_pages, aux
            )
            seg = plan.segment(table)
            self._post(tail, tail.key, pair, ref, seg, note, plan.what, t_start, job.t_enqueued)
        except BaseException:
            ref.seal(ok=False)  # nothing in flight: the strategy gets its buffer back now
            raise
        ref.remaining += 1

    def post_segments(self, post: SegmentPost) -> None:
        """Post ``post.segs`` (parts ``first_part...`` of a chunk of ``parts``; the rows of
        layers ``[a, b)`` when ``layers`` is given), each with its note; on a failure the
        posted ones end first and the strategy hears after the last. With checksums, the first note
        carries the per-layer sums of those layers (computed before any row is posted); a
        call with no segment (a staged layer group whose bytes a later group's block units
        carry) leaves its sums to the next note of the chunk. A chunk cut in ``pieces``: each
        note carries its piece's layers and rows' sums instead, summed just before posting. A
        whole chunk with ``late_sums``: summed while its rows are posted and fly, its sums
        told as its last part once computed (:mod:`~kvwire.session.prefill.late_sums`)."""
        tail, job, ref, what, segs = post.tail, post.job, post.ref, post.what, post.segs
        key, t_start, layers = tail.key, post.t_start, post.layers
        room = job.room.room
        assert job.chunk_id is not None
        check = job.link.checksums if job.pool == "kv" else None
        try:
            sums: dict[int, int] = {}
            later = late_sums.start(job) if post.late_sums else None
            pending = None  # or the first note's sums, computed beside the write (a GPU's)
            if check is not None and post.pieces is None and later is None:
                sums, pending = posting.first_sums(self.ctx, check, job, segs, layers)
            # where the chunk goes, on every note: decode's checksum check and its failure
            # report (which tokens landed) read it
            where = {
                "span": job.span,
                "num_pages": job.room.num_pages,
                "page_size": self.ctx.layout.model.page_size,
            }
            fields: dict[str, Any] = dict(room=room, sender_id=self.side.sender_id)
            fields.update(session=self.ctx.session, what=what, chunk_id=job.chunk_id)
            fields.update(last=job.last, parts=post.parts)
            for i, seg in enumerate(segs):
                extra: dict[str, Any] = dict(where)
                if post.pieces is not None:
                    extra.update(post.piece_fields(i))
                elif sums and i == 0:
                    extra.update(sum_layers=list(sums), sums=list(sums.values()))
                part = post.first_part + i
                if part == post.parts - 1 - post.late_sums:
                    extra["aux"] = posting.carried_aux(self.ctx, tail, job)
                note = ChunkNote(**fields, part=part, **extra)
                if seg.copy is not None:
                    self._post_copy(
                        tail, key, seg.copy, note, job.dest.endpoint, ref, t_start, job.t_enqueued
                    )
                else:
                    pair = job.link.pairs.get(seg.table)
                    if pair is None:
                        raise TransferError(f"no prepared table {seg.table!r}", room=room)
                    self._post(
                        tail,
                        key,
                        pair,
                        ref,
                        seg,
                        posting.encode_note(self.ctx.codec, note, pending if i == 0 else None),
                        what,
                        t_start,
                        job.t_enqueued,
                    )
                ref.remaining += 1
        except BaseException:
            ref.seal(ok=False)  # nothing in flight: the strategy gets its buffer back now
            raise
        if later is not None:  # the chunk's last part: its sums, told once computed
            self._post_sums(tail, later, {**fields, **where, "part": post.parts - 1})

    def _drop(self, key: tuple[int, str], tail: Tail) -> None:
        """A dead request's tail: forget its queued jobs; once nothing is in flight, tell a
        staging destination that no write will come. A queued job's plan made already (by
        the lean lane) goes back to its strategy unsent."""
        for job in tail.queue:
            if job.planned is not None:
                job.target.strategy.on_sent(job.room.room, job.planned, False)
                job.planned = None
        tail.queue.clear()
        if tail.layered is not None:  # later layer groups will not be posted
            tail.layered.ref.seal(ok=False)
            tail.layered = None
        if tail.inflight:
            return  # the posted transfers end first (success or failure), then this again
        self.tails.pop(key, None)
        if tail.staged:
            d = tail.dest
            self.side.abandon(tail.room, d, tail.target)

    def progress(self) -> int:
        """Poll every posted transfer once, then post what waited; returns how many moved."""
        moved = self.lane.progress()
        for p in list(self.posted):
            state = self._state(p)
            if state is XferState.PENDING:
                continue
            moved += 1
            self.posted.remove(p)
            self._complete(p, state)
        for key, tail in list(self.tails.items()):
            if tail.queue and not self.full and self._advance(key, tail):
                moved += 1
        return moved

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Worker thread, around one turn of its loop: the backend may hold the turn's
        submits and post them together when it ends (:meth:`TransferBackend.post_batch
        <kvwire.backend.TransferBackend.post_batch>`). A request whose write the turn posted
        is marked ``turn_end`` once it ended (a held write was launched by then)."""
        self._in_turn = True
        try:
            with self.ctx.backend.post_batch():
                try:
                    yield
                finally:
                    self.lane.launch()
        finally:
            self._in_turn = False
            if self._posted_rooms:
                now = time.perf_counter()
                for room in self._posted_rooms:
                    room.metrics.marks["turn_end"] = now
                self._posted_rooms.clear()

    def idle(self, sleep_s: float) -> None:
        """Worker thread, when :meth:`progress` moved nothing: wait as
        :func:`~kvwire.session.prefill.pace.idle` says for what is in flight and waiting."""
        gates = [t.queue[0].gate for t in self.tails.values() if t.queue]
        pace.idle(self.posted, gates, self.wake, self.pace, sleep_s, self.lane.busy)

    def notify(self) -> None:
        """Any thread (a job was queued for this worker): end an :meth:`idle` wait now."""
        self.wake.set()

    def drain(self, poll_sleep_s: float) -> None:
        """Poll until nothing is in flight or waiting (synchronous mode)."""
        while self.busy:
            if not self.progress():
                time.sleep(poll_sleep_s)

    # --------------------------------------------------------------- internals
    def _post_copy(
        self,
        tail: Tail,
        key: tuple[int, str],
        copy: LocalCopy,
        note: ChunkNote | None,
        endpoint: str,
        ref: PlanRef | None,
        t_start: float,
        t_enqueued: float | None,
        sums_of: str = "",
    ) -> None:
        """Track a copy the strategy started; its note goes out once it is done. A note's sums
        part (:class:`~kvwire.session.prefill.late_sums.SumsPart`, ``sums_of`` its note's
        ``what``) sends its own and moves no bytes (not counted as a transfer)."""
        session = self.ctx.session
        handle = TransferHandle(-1, session, XferOp.WRITE, copy.num_rows, copy.nbytes)
        self._track(
            Posted(
                handle,
                key,
                tail.room,
                ref,
                t_start,
                time.perf_counter(),
                t_enqueued,
                time.monotonic() + self.ctx.options.transfer_timeout_s,
                f"{sums_of} sums" if note is None else note.what,
                copy=copy,
                note=note,
                endpoint=endpoint,
                counted=not sums_of,
            ),
            tail,
        )

    def _track(self, p: Posted, tail: Tail) -> None:
        self.posted.append(p)
        tail.inflight += 1
        self.side.writes_posted(p.key[0], p.key[1], +1)

    def _post(
        self,
        tail: Tail,
        key: tuple[int, str],
        pair: PreparedPair,
        ref: PlanRef | None,
        rows: Segment,
        note: Note,
        what: str,
        t_start: float,
        t_enqueued: float | None,
    ) -> None:
        # stamped before the submit: a backend that sends on its own thread may have the note
        # handled on decode before the call returns (stage marks must stay in causal order)
        tail.room.metrics.marks["posted"] = time.perf_counter()
        if self._in_turn:
            self._posted_rooms.append(tail.room)
        handle = posting.submit_rows(self.ctx.backend, pair, rows, note, self.wake.set)
        deadline = time.monotonic() + self.ctx.options.transfer_timeout_s
        now = time.perf_counter()
        self._track(Posted(handle, key, tail.room, ref, t_start, now, t_enqueued, deadline, what),
                    tail)  # fmt: skip

    def _copy_state(self, p: Posted) -> XferState:
        assert p.copy is not None
        try:
            if p.copy.done():
                return XferState.DONE
        except Exception as exc:
            p.handle.error = f"{type(exc).__name__}: {exc}"
            return XferState.FAILED
        if not p.overdue and time.monotonic() > p.deadline:
            # Fail the request now, but keep polling: the copy is still writing decode's pages.
            p.overdue = True
            self._failed(
                p.room,
                TransferError(
                    f"{p.what} copy not done within transfer_timeout_s="
                    f"{self.ctx.options.transfer_timeout_s}",
                    room=p.room.room,
                    operation=f"{p.what} copy",
                ),
                p.what,
            )
        return XferState.PENDING

    def _state(self, p: Posted) -> XferState:
        if p.copy is not None:
            return self._copy_state(p)
        state = self.ctx.backend.poll(p.handle)
        if state is not XferState.PENDING:
            return state
        # A write of a failed request is not abandoned early: decode reuses the destination
        # pages (and ring space) only once this side says nothing is in flight (WritesDone).
        if time.monotonic() > p.deadline:
            p.handle.error = (
                f"no completion within transfer_timeout_s={self.ctx.options.transfer_timeout_s}"
            )
            return XferState.FAILED
        return XferState.PENDING

    def _complete(self, p: Posted, state: XferState) -> None:
        ctx, h = self.ctx, p.handle
        t_done = time.perf_counter()
        if p.copy is None:
            ctx.backend.release(h)
        elif (
            state is XferState.DONE
            and p.note is not None
            and not self.side.is_dead(p.room)
            and not ctx.tell(p.endpoint, p.note)
        ):
            h.error = "the control channel to decode is full (note not sent)"
            state = XferState.FAILED
        error = h.error
        if p.ref is not None:
            p.ref.ended(state is XferState.DONE)
        tail = self.tails.get(p.key)
        if tail is not None:
            tail.inflight -= 1
        done = None
        if state is XferState.DONE and p.counted:
            if p.copy is None and not h.pushes:
                self.pace.ended(h.num_bytes, t_done - p.t_posted)
            p.room.metrics.marks["done"] = t_done
            done = ChunkDone(h.num_bytes, h.num_descs, p.t_start, p.t_posted, t_done, p.t_enqueued)
        live = self.side.ended(p.room, p.key[1], done)  # no longer in flight, accounted
        if state is not XferState.DONE:
            m.chunk_failed(ctx.labels)
            self._failed(
                p.room,
                TransferError(
                    f"{p.what} transfer failed: {error or 'no reason given'}",
                    room=p.room.room,
                    peer=h.peer,
                    operation=f"{p.what} write",
                ),
                p.what,
            )
            live = False
        if tail is not None and not live:
            self._drop(p.key, tail)
            return
        self._finish_tail(p.key, live)

    def _finish_tail(self, key: tuple[int, str], live: bool = False) -> None:
        """After the last job: marker, aux row, then done once nothing is in flight.

        The aux row of a tail whose last chunk carried KV is posted as soon as that chunk is
        posted, concurrently with it (unless it rode in the chunk's note): decode counts the
        KV notes and the aux note in any order, and the request saves a completion poll and a
        round trip. Otherwise (the last chunk moved no KV) it waits for every chunk. ``live``:
        the caller just found the request live (not asked again)."""
        tail = self.tails.get(key)
        if tail is None or tail.last is None:
            return
        room, dest, job = tail.room, tail.dest, tail.last
        early = job.chunk_id is not None
        if tail.inflight and (tail.aux_posted or not early):
            return
        if not live and self.side.is_dead(room):
            self._drop(key, tail)
            return
        if not tail.groups_done:
            tail.groups_done = True
            if self._post_groups(tail, key, job):
                return  # back here once the group transfer is terminal
        if not tail.aux_posted:
            ctx = self.ctx
            if job.chunk_id is None:  # the last chunk moved no KV: say how many did
                ctx.tell(
                    dest.endpoint,
                    Completion(
                        room=room.room,
                        sender_id=self.side.sender_id,
                        session=ctx.session,
                        data_chunks=dest.next_chunk,
                        dummy=job.link.dummy,
                    ),
                )
            tail.aux_posted = True
            link = job.link
            aux_pair = link.pairs.get("aux")
            if link.sends_aux and aux_pair is not None and room.aux_index is not None:
                ctx.stamps[room.aux_index, 0] = room.room
                rows = posting.aux_segment(
                    link.aux_rows, ctx.aux_slots, room.aux_index, dest.aux_index
                )
                try:
                    self._post(
                        tail,
                        key,
                        aux_pair,
                        None,
                        rows,
                        self.notes.plain(room.room, "aux"),
                        "aux",
                        time.perf_counter(),
                        None,
                    )
                except Exception as exc:  # refused at submit: the request fails, not hangs
                    self._failed(room, exc, "aux")
                    self._drop(key, tail)
                    return
                return
        if tail.inflight:
            return
        del self.tails[key]
        self.side.dest_done(room, dest)

    def _post_groups(self, tail: Tail, key: tuple[int, str], job: Job) -> bool:
        """After the last KV chunk, before the aux row: the request's buffer groups in one
        transfer (``groups.state_note``); True when one was posted (or failed)."""
        room = tail.room
        try:
            rows = group_rows(room, tail.dest, job.link)
            if rows is None:
                return False
            fields: dict[str, Any] = dict(room=room.room, what="state", session=self.ctx.session)
            fields["sender_id"] = self.side.sender_id
            if rows[0].size == 0:  # nothing to move: decode still counts the group note
                self.ctx.tell(tail.dest.endpoint, ChunkNote(**fields))
                return False
            note, later = state_note(self.ctx.codec, fields, job.link, rows)
            seg, now = Segment("", "", *rows), time.perf_counter()
            self._post(tail, key, job.link.pairs[GROUPS_TABLE], None, seg, note, "state", now, None)
            if later is not None:
                self._post_sums(tail, later, {**fields, "parts": 2, "part": 1})
        except Exception as exc:  # refused at map or submit: the request fails, not hangs
            self._failed(room, exc, "state")
            self._drop(key, tail)
        return True

    def _post_sums(self, tail: Tail, later: Future[LayerSums], fields: dict[str, Any]) -> None:
        """Track a note's last part: its sums, computed while its rows fly, then told."""
        dest, room, now = tail.dest.endpoint, tail.room, time.perf_counter()
        tell = lambda note: self.ctx.tell(dest, note)  # noqa: E731
        part = late_sums.SumsPart(later, fields, tell, lambda: not self.side.is_dead(room))
        self._post_copy(tail, tail.key, part, None, dest, None, now, None, fields["what"])

    def _failed(self, room: SendRoom, exc: BaseException, what: str) -> None:
        if not isinstance(exc, KVWireError):
            exc = TransferError(
                f"{type(exc).__name__}: {exc}", room=room.room, operation=f"{what} write"
            ).with_traceback(exc.__traceback__)
        self.side.fail(room, exc)
