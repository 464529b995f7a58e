"""Decode's KV checksum checks, off the progress thread, and the counting of KV notes.

A complete KV chunk whose source sends checksums is not counted when its last note arrives:
the thread that saw it complete (the progress thread, or the liveness thread for a copy
prefill made itself) builds a :class:`~kvwire.session.decode.rooms.ChunkCheck` under the room
lock and hands it to the :class:`ChunkChecker`, whose threads sum the landed rows with no lock
held, then report the verdict through a callback that takes the room lock itself. Until that
callback counts the chunk, the request cannot reach ``Success`` (the chunk is not in
``received``), and a mismatch fails it as before, naming chunk, layers and sender.

A chunk cut in pieces (``ChunkNote.piece_layers``, protocol 1.12: each part moved every row of
some layers, and its note carries their sums) is checked piece by piece: each piece's note
starts its check as soon as it arrives (its rows landed), while the later pieces are in
flight, and the piece counts as a part of its chunk only once its check passed. The chunk is
complete, with nothing left to check, when its last piece's check passes: ``Success`` waits
only for that one.

Lock contract:

- :meth:`ChunkChecker.on_part` and :meth:`ChunkChecker.submit` are called under the room lock
  (they count parts, and queue checks and count them in flight);
- :meth:`ChunkCheck.run` reads only what the check copied out of the room (the note, the sums
  the notes carried, the link's :class:`~kvwire.session.checksums.LandedSums`, the room's
  destination pages, which are never changed once set) and the rank's KV rows; it touches no
  room, table or strategy state and takes no lock but its hasher's own;
- the verdict is applied on the checker thread by :meth:`ChunkChecker._apply`, which takes the
  room lock and applies it only to the room still live (a room cleared or failed while its
  check ran, or a later request under the same room id, is left alone: the verdict is
  dropped): a pass counts the chunk (``RecvRoom.chunk_landed``), or the piece as a part of
  its chunk, and asks the decode side whether the room is done; a mismatch fails the room
  through the decode side's ``fail``.

A link whose hasher sums on the device (:attr:`~kvwire.session.checksums.LandedSums.inline`:
a launch and a ~0.1 ms wait) is checked on the thread that saw its chunk complete instead:
:meth:`ChunkChecker.submit` keeps the check in that thread's list, and the thread runs it with
:meth:`ChunkChecker.run_deferred` once it let go of the room lock (the progress thread after
its whole drain of notifications, ``DecodeSide.notifications_drained``; the liveness thread
after a control note; a checker thread after applying a verdict that queued more). It launches
the sums of up to :data:`CHECK_BATCH` queued checks before it waits for the first
(:meth:`ChunkCheck.start <kvwire.session.decode.rooms.ChunkCheck.start>`), so chunks that
landed together share one wait. The check and its verdict are the same; only the hop to a
checker thread and back is gone.

Teardown: :meth:`ChunkChecker.close` (manager shutdown, after live rooms were failed) drops the
queued checks and waits for those running, so none reads the rank's KV buffers after they
are released.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from kvwire.control.wire import ChunkNote
from kvwire.errors import KVWireError, TransferError
from kvwire.integrity import LayerSums
from kvwire.session.decode.group_check import GroupCheck
from kvwire.session.decode.rooms import ChunkCheck, RecvRoom
from kvwire.session.report import ChunkFault, FailureCause
from kvwire.session.rooms import RoomTable
from kvwire.staging.base import ArrivedChunk, StagingStrategy

logger = logging.getLogger(__name__)

#: What a check found: None (the sums match), or the error failing the request and, for a
#: mismatch, the chunk it names.
Outcome = tuple[TransferError, ChunkFault | None] | None
#: What the checker runs: a KV chunk's (or piece's) check, or a sender's buffer groups'.
Check = ChunkCheck | GroupCheck

#: Checker threads per decode rank: a chunk's rows are summed in one vectorised pass (NumPy
#: releases the GIL on large arrays; the GPU hasher waits on its own stream), so two keep up
#: with one progress thread while leaving the process's other threads room.
CHECK_WORKERS = 2
#: Inline checks launched before the first of them is waited for: a drain of many notes at
#: once does not hold its first verdict behind every other check's launch (a GPU hasher's
#: lane keeps sums for 4 launches in flight, ``integrity_lanes.PAGE_SLOTS``).
CHECK_BATCH = 4


class ChunkChecker:
    """Runs a decode rank's chunk checks on its own threads (started on the first check).

    Built by the decode side with its room table and three of its methods, all called under
    the room lock: ``fail(room, exc, cause=...)`` fails a room once and tells its sources,
    ``done(room)`` makes a room whose every part arrived and was checked ``Success``, and
    ``strategy_of(room)`` is the staging strategy of the pool the room's KV goes to."""

    def __init__(
        self,
        agent_name: str,
        rooms: RoomTable[RecvRoom],
        fail: Callable[..., None],
        done: Callable[[RecvRoom], None],
        strategy_of: Callable[[RecvRoom], StagingStrategy],
    ) -> None:
        self._rooms = rooms
        self._fail = fail
        self._done = done
        self._strategy_of = strategy_of
        self._pool = concurrent.futures.ThreadPoolExecutor(
            CHECK_WORKERS, thread_name_prefix=f"kvwire-check-{agent_name}"
        )
        self._lock = threading.Lock()
        self._in_flight = 0
        #: Per request (room id, its pages array's id: a later request under the same room id
        #: has its own array), under the room lock: checks submitted and not yet applied, and
        #: a mismatch held back until they are (see :meth:`_apply`).
        self._pending: dict[tuple[int, int], int] = {}
        self._held: dict[tuple[int, int], TransferError] = {}
        #: Per thread: checks submitted to run on that thread (inline links), in order.
        self._deferred = threading.local()
        self._closed = False

    def on_part(self, room: RecvRoom, msg: ChunkNote) -> None:
        """Under the room lock (progress thread for a backend notification, liveness thread
        for a copy's control note): a KV segment's note arrived, its rows landed. A stale note
        is dropped; a piece's starts its check (the piece counts once it passes); any other
        counts as a part of its chunk now (:meth:`_count`)."""
        if not room.fresh_part(msg):
            return
        try:
            if self.submit(room.piece_check(msg)):
                return  # counted once its check passes
        except KVWireError as exc:
            self._fail(room, exc, cause="checksum_mismatch")
            return
        self._count(room, msg)

    def on_state(self, room: RecvRoom, msg: ChunkNote) -> bool:
        """Under the room lock, as :meth:`on_part` for a part of a sender's state note (its
        buffer groups landed): True when the groups count now (complete, and not checked on
        this link); False while a part is missing, while their check runs (it counts them),
        or when the request failed."""
        sent = room.state_part(msg)
        if sent is None:
            return False  # its sums (a part of their own) are still on their way
        try:
            if self.submit(room.group_check(msg, sent)):
                return False
        except KVWireError as exc:
            self._fail(room, exc, cause="checksum_mismatch")
            return False
        room.groups_from.add(msg.sender_id)
        return True

    def _count(self, room: RecvRoom, msg: ChunkNote) -> None:
        """Under the room lock: count one part of a chunk (a piece whose check passed, or any
        other part on arrival). A chunk complete with it goes to its strategy (a staged block
        is scattered), then, unless it came in pieces (each checked already), to its check;
        a chunk with nothing left to check counts, and the room may be done."""
        try:
            if not room.take_part(msg):
                return  # a part of the chunk is still on its way
            key = (msg.sender_id, msg.chunk_id)
            arrived = ArrivedChunk(room.room, msg.session, msg.chunk_id, msg.what, room.dst_pages)
            self._strategy_of(room).on_arrival(arrived)
        except KVWireError as exc:
            self._fail(room, exc)
            return
        try:
            sent = room.sent_sums.pop(key, {})
            if msg.piece_layers is None and self.submit(room.chunk_check(msg, sent)):
                return  # the checker counts the chunk once its check passes
        except KVWireError as exc:
            self._fail(room, exc, cause="checksum_mismatch")
            return
        room.chunk_landed(msg)
        self._done(room)

    def submit(self, check: Check | None) -> bool:
        """Under the room lock (progress or liveness thread, or a checker thread applying a
        verdict): queue one chunk's check; False when there is none (its source sends no
        checksums: the caller counts the chunk). An inline link's check waits in this
        thread's list for :meth:`run_deferred`. Raises :class:`TransferError` once the
        checker is closed."""
        if check is None:
            return False
        key = (check.room, id(check.dst_pages))
        self._pending[key] = self._pending.get(key, 0) + 1
        with self._lock:
            self._in_flight += 1
        try:
            if self._closed:
                raise RuntimeError("closed")
            if check.checksums.inline:
                mine: list[Check] | None = getattr(self._deferred, "checks", None)
                if mine is None:
                    mine = self._deferred.checks = []
                mine.append(check)
                return True
            self._pool.submit(self._run_pooled, check)
        except RuntimeError as exc:  # shut down
            with self._lock:
                self._in_flight -= 1
            self._settled(key)
            raise TransferError("decode manager closed", room=check.room) from exc
        return True

    def run_deferred(self) -> None:
        """The thread that submitted inline checks, holding no room lock: in batches of
        :data:`CHECK_BATCH`, launch every one's sums (:meth:`ChunkCheck.start`), then wait for
        and apply each verdict in order (a verdict may queue more: they run in a later batch).
        A no-op on a thread with none."""
        mine: list[Check] | None = getattr(self._deferred, "checks", None)
        while mine:
            batch = mine[:CHECK_BATCH]
            del mine[:CHECK_BATCH]  # the rest, and what verdicts queue: the next rounds
            started = [(check, check.start()) for check in batch]  # the batch's launches first
            for check, later in started:
                try:
                    self._run(check, later)
                except Exception:  # applying a verdict failed: the others still run
                    msg = check.msg
                    logger.exception("room %d: applying chunk %d's check", check.room, msg.chunk_id)

    def _run_pooled(self, check: Check) -> None:
        """A checker thread: run one check, then any inline check its verdict queued."""
        self._run(check)
        self.run_deferred()

    def _run(self, check: Check, later: Callable[[], LayerSums] | None = None) -> None:
        """A checker thread (or the submitting thread, for an inline check): run the check
        (waiting for the sums :meth:`ChunkCheck.start` launched, when ``later``), hand over
        the verdict."""
        try:
            try:
                outcome = check.run(later)
            except Exception as exc:  # a bug in the check must still fail the request
                logger.exception("room %d: checking chunk %d", check.room, check.msg.chunk_id)
                outcome = (
                    TransferError(
                        f"cannot check chunk {check.msg.chunk_id}: {exc}", room=check.room
                    ),
                    None,
                )
            self._apply(check, outcome)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _settled(self, key: tuple[int, int]) -> int:
        """Under the room lock: one of a request's checks is over; how many are left."""
        left = self._pending.get(key, 0) - 1
        if left > 0:
            self._pending[key] = left
        else:
            self._pending.pop(key, None)
        return max(left, 0)

    def _apply(self, check: Check, outcome: Outcome) -> None:
        """A checker thread, no lock held: apply a check's verdict under the room lock (see
        the module's lock contract). A mismatch fails the request only once its other checks
        in flight are over (held back until then), so the failure report counts every chunk
        that landed and passed, not only those whose checks happened to finish first."""
        mismatch: FailureCause = "checksum_mismatch"
        key = (check.room, id(check.dst_pages))
        piece = check.msg.piece_layers is not None
        with self._rooms.lock:
            self._settled(key)
            room = self._rooms.get(check.room)
            if (
                room is None
                or room.sources is None
                or self._rooms.terminal(room)
                or room.dst_pages is not check.dst_pages  # a later request under this room id
            ):
                if not self._pending.get(key):
                    self._held.pop(key, None)
                return
            if outcome is not None:
                err, fault = outcome
                if fault is not None:
                    room.chunk_mismatched(fault)
                self._held.setdefault(key, err)  # the first mismatch names the failure
            else:
                room.last_progress = time.monotonic()
                if piece:
                    self._count(room, check.msg)  # one piece of its chunk passed
                else:
                    check.landed(room)  # a whole chunk, or a sender's buffer groups
            held = self._held.get(key)
            if held is None:
                if not piece:
                    self._done(room)
                return
            if not self._pending.get(key):  # the request's last check is over: fail it now
                self._held.pop(key, None)
                self._fail(room, held, cause=mismatch)

    def in_flight(self) -> int:
        """Any thread: checks queued or running (leak checks)."""
        with self._lock:
            return self._in_flight

    def close(self) -> None:
        """Manager shutdown, no room lock held: drop queued checks, wait for running ones
        (an inline check runs on the thread that submitted it, which the manager stopped
        first)."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._in_flight = 0
        with self._rooms.lock:  # dropped checks never settle
            self._pending.clear()
            self._held.clear()
