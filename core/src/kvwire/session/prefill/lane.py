"""A prefill worker's lean lane: a turn's whole-request page writes launched together, with
the request bookkeeping done once per turn instead of once per write.

The general path (:class:`~kvwire.session.prefill.pipeline.Pipeline`) keeps, per write, a
tail, a plan reference, a transfer handle polled and released, and three sections of the
room lock; at C=8 and heterogeneous TP 1 -> 2 that bookkeeping, not the GPU, bounds how many
requests a prefill rank moves a second (docs/architecture.md, "The lean lane"). A job takes
the lane when its backend offers one (``TransferBackend.page_lane``,
:mod:`kvwire.page_lane`), its link allows it (``DecodeLink.lane_problem``, decided at the
handshake and logged: no checksum, no buffer group, not staged, its aux row (if any) riding
in its note) and it is the simplest case: the request's only chunk to that decode rank
(chunk 0 and the last), of the KV pool, not layer-wise, its plan in page form on one
prepared pair the backend's lane takes. Every other job, and every job outside a turn (the
synchronous mode), takes the general path, which gets the plan already made.

Per job (:meth:`Lane.take`, worker thread): the plan, the note framed from the worker's
template. Per turn (:meth:`Lane.launch`, at the turn's end): one room-lock section says which
requests are live and counts their writes in flight (``WriteBook.start_turn``), one call
launches the live ones. Per launch (:meth:`Lane.progress`, once the backend finished it and
woke the worker): the strategy hears of each plan, then one room-lock section ends every
write, accounts it and completes its destination or fails its request
(``WriteBook.end_turn``). A launch not done within ``transfer_timeout_s`` fails its
requests at once but stays counted in flight until it ends (decode reuses pages only then).

One :class:`Lane` per pipeline, used by its worker thread alone (no lock); the launch it
waits for is finished by the backend's thread (:class:`~kvwire.page_lane.LaneLaunch`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvwire.errors import TransferError
from kvwire.page_form import PageChunk
from kvwire.page_lane import LaneLaunch, LaneWrite
from kvwire.session.context import RankContext
from kvwire.session.metrics import ChunkDone
from kvwire.session.prefill.notes import NoteFrames
from kvwire.session.prefill.posting import WorkerSide, aux_row
from kvwire.session.prefill.rooms import Job
from kvwire.session.prefill.writes import Ended
from kvwire.staging.base import ChunkPlan
from kvwire.transfers import PreparedPair

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Taken:
    """A job the lane took this turn: its plan, pair and framed note."""

    job: Job
    plan: ChunkPlan
    #: The plan's chunk in page form, on prepared pair ``pair``.
    chunk: PageChunk
    pair: PreparedPair
    note: bytes
    t_start: float


@dataclass(eq=False)
class _Flight:
    """A launched turn: its jobs (in write order), the backend's launch, when it went out
    and when it is overdue."""

    taken: list[_Taken]
    launch: LaneLaunch
    t_posted: float
    deadline: float
    overdue: bool = False


class Lane:
    """The lean lane of one worker's pipeline (built by it with the rank context, its
    worker side, note frames and wake-up event)."""

    def __init__(
        self,
        ctx: RankContext,
        side: WorkerSide,
        notes: NoteFrames,
        wake: threading.Event,
        fallback: Callable[[Job], None],
    ) -> None:
        self.ctx = ctx
        #: Posts a job on the general path (a write the lane's backend says another member
        #: of its link may carry: ``LaneLaunch.retry``).
        self._fallback = fallback
        self.side = side
        self.notes = notes
        self._wake = wake
        self._timeout = ctx.options.transfer_timeout_s
        self._turn: list[_Taken] = []
        self._flights: list[_Flight] = []
        #: Writes taken or launched and not ended (the pipeline's in-flight budget counts them).
        self.inflight = 0

    @property
    def busy(self) -> bool:
        """Writes are taken or in flight."""
        return self.inflight > 0

    def take(self, job: Job, plan_of: Callable[[Job], ChunkPlan | None]) -> bool:
        """Worker thread, inside a turn, for a job that no earlier job of its request and
        destination precedes: take it into this turn (True), or leave it to the general path
        (False; a plan made here rides on ``job.planned``)."""
        lane, link = self.ctx.backend.page_lane, job.link
        if lane is None or link.lane_problem is not None or job.pool != "kv":
            return False  # the link's reason is in its handshake's log line
        if job.gate is not None or job.chunk_id != 0 or not job.last:
            return False
        if job.planned is not None:  # planned already: one the lane left or gave back
            return False
        pair = link.pairs[job.target.table]
        room, t_start = job.room, time.perf_counter()
        room.metrics.marks["taken"] = t_start
        try:
            plan = plan_of(job)
        except Exception:
            return False  # the general path plans again and fails the request, naming why
        if plan is None:
            return False
        pages = plan.pages
        if plan.segments is not None or plan.table != "kv" or pages is None:
            job.planned = plan
            return False
        if not lane.takes(pair, pages.nbytes):
            job.planned = plan
            return False
        room.metrics.marks["planned"] = time.perf_counter()
        aux = aux_row(self.ctx, room) if link.sends_aux else None
        note = self.notes.chunk(room.room, plan.what, 0, True, job.span, room.num_pages, aux)
        self._turn.append(_Taken(job, plan, pages, pair, note, t_start))
        self.inflight += 1
        return True

    def launch(self) -> None:
        """Worker thread, at the end of its turn: the turn's live requests counted in flight
        in one room-lock section, their writes launched together; a dead request's plan is
        given back. Never raises (a launch that raises fails the turn's writes)."""
        if not self._turn:
            return
        taken, self._turn = self._turn, []
        live = self.side.start_turn([(t.job.room, t.job.dest) for t in taken])
        go = []
        for t, ok in zip(taken, live, strict=True):
            if ok:
                go.append(t)
            else:
                self.inflight -= 1
                t.job.target.strategy.on_sent(t.job.room.room, t.plan, False)
        if not go:
            return
        now = time.perf_counter()
        for t in go:
            t.job.room.metrics.marks["posted"] = now
        writes = [LaneWrite(t.pair, t.chunk, t.note) for t in go]
        lane = self.ctx.backend.page_lane
        assert lane is not None
        try:
            launch = lane.launch(writes, self._wake.set)
        except Exception as exc:
            logger.exception("%s: the lane's launch failed", self.ctx.agent_name)
            launch = LaneLaunch.refused(writes, f"the lane's launch failed: {exc}")
        end = time.perf_counter()
        for t in go:
            t.job.room.metrics.marks["turn_end"] = end
        self._flights.append(_Flight(go, launch, now, time.monotonic() + self._timeout))

    def progress(self) -> int:
        """Worker thread, each poll: end every launch the backend finished; fail the
        requests of one overdue (still counted in flight until it ends). Returns how many
        launches ended."""
        if not self._flights:
            return 0
        for f in self._flights:
            poll = f.launch.poll  # read once: the lane lets go of it when it finishes
            if poll is not None:
                poll()
        ended: list[_Flight] = []
        left: list[_Flight] = []
        for f in self._flights:  # one read of ``done`` each: the lane's thread may finish one
            (ended if f.launch.done else left).append(f)  # between two reads
        self._flights = left
        for f in ended:
            self._end(f)
        now = time.monotonic()
        for f in self._flights:
            if not f.overdue and now > f.deadline:
                f.overdue = True
                for t in f.taken:
                    why = f"no completion within transfer_timeout_s={self._timeout}"
                    err = TransferError(why, room=t.job.room.room, operation="kv write")
                    self.side.fail(t.job.room, err)
        return len(ended)

    def _end(self, f: _Flight) -> None:
        """A finished launch: each plan back to its strategy, then every write ended in one
        room-lock section."""
        t_done = time.perf_counter()
        out: list[Ended] = []
        launch = f.launch
        for t, error, retry in zip(f.taken, launch.errors, launch.retry, strict=True):
            job, room = t.job, t.job.room
            if error is not None and retry:  # its link's other backend carries it
                logger.info("%s: room %d: %s; posted again", self.ctx.agent_name, room.room, error)
                job.planned = t.plan
                self._fallback(job)  # counted again before this write is uncounted
                out.append((room, job.dest, None, None))
                continue
            job.target.strategy.on_sent(room.room, t.plan, error is None)
            if error is None:
                room.metrics.marks["done"] = t_done
                c, t0 = t.chunk, t.t_start
                done = ChunkDone(c.nbytes, c.num_rows, t0, f.t_posted, t_done, job.t_enqueued)
                out.append((room, job.dest, done, None))
            else:
                exc = TransferError(
                    f"{t.plan.what} transfer failed: {error}",
                    room=room.room,
                    peer=t.pair.peer,
                    operation=f"{t.plan.what} write",
                )
                out.append((room, job.dest, None, exc))
        self.inflight -= len(f.taken)
        self.side.end_turn(out)
