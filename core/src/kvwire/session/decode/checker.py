"""Decode's KV checksum checks, off the progress thread.

A complete KV chunk whose source sends checksums is not counted when its last note arrives:
the thread that saw it complete (the progress thread, or the liveness thread for a copy
prefill made itself) builds a :class:`~kvwire.session.decode.rooms.ChunkCheck` under the room
lock and hands it to the :class:`ChunkChecker`, whose threads sum the landed rows with no lock
held, then report the verdict through a callback that takes the room lock itself. Until that
callback counts the chunk, the request cannot reach ``Success`` (the chunk is not in
``received``), and a mismatch fails it as before, naming chunk, layers and sender.

Lock contract:

- :meth:`ChunkChecker.submit` is called under the room lock (it only queues the check and
  counts it in flight);
- :meth:`ChunkCheck.run` reads only what the check copied out of the room (the note, the sums
  the notes carried, the link's :class:`~kvwire.session.checksums.LandedSums`, the room's
  destination pages, which are never changed once set) and the rank's KV rows; it touches no
  room, table or strategy state and takes no lock but its hasher's own;
- the verdict is applied on the checker thread by :meth:`ChunkChecker._apply`, which takes the
  room lock and applies it only to the room still live (a room cleared or failed while its
  check ran, or a later request under the same room id, is left alone: the verdict is
  dropped): a pass counts the chunk (``RecvRoom.chunk_landed``) and asks the decode side
  whether the room is done, a mismatch fails the room through the decode side's ``fail``.

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

from kvwire.errors import TransferError
from kvwire.session.decode.rooms import ChunkCheck, RecvRoom
from kvwire.session.report import ChunkFault, FailureCause
from kvwire.session.rooms import RoomTable

logger = logging.getLogger(__name__)

#: What a check found: None (the sums match), or the error failing the request and, for a
#: mismatch, the chunk it names.
Outcome = tuple[TransferError, ChunkFault | None] | None

#: Checker threads per decode rank: a chunk's rows are summed in one vectorised pass (NumPy
#: releases the GIL on large arrays; the GPU hasher waits on its own stream), so two keep up
#: with one progress thread while leaving the process's other threads room.
CHECK_WORKERS = 2


class ChunkChecker:
    """Runs a decode rank's chunk checks on its own threads (started on the first check).

    Built by the decode side with its room table and two of its methods, both called under
    the room lock: ``fail(room, exc, cause=...)`` fails a room once and tells its sources, and
    ``done(room)`` makes a room whose every part arrived and was checked ``Success``."""

    def __init__(
        self,
        agent_name: str,
        rooms: RoomTable[RecvRoom],
        fail: Callable[..., None],
        done: Callable[[RecvRoom], None],
    ) -> None:
        self._rooms = rooms
        self._fail = fail
        self._done = done
        self._pool = concurrent.futures.ThreadPoolExecutor(
            CHECK_WORKERS, thread_name_prefix=f"kvwire-check-{agent_name}"
        )
        self._lock = threading.Lock()
        self._in_flight = 0

    def submit(self, check: ChunkCheck | None) -> bool:
        """Under the room lock (progress or liveness thread): queue one chunk's check; False
        when there is none (its source sends no checksums: the caller counts the chunk).
        Raises :class:`TransferError` once the checker is closed."""
        if check is None:
            return False
        with self._lock:
            self._in_flight += 1
        try:
            self._pool.submit(self._run, check)
        except RuntimeError as exc:  # shut down
            with self._lock:
                self._in_flight -= 1
            raise TransferError("decode manager closed", room=check.room) from exc
        return True

    def _run(self, check: ChunkCheck) -> None:
        """A checker thread: run the check, hand over the verdict."""
        try:
            try:
                outcome = check.run()
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

    def _apply(self, check: ChunkCheck, outcome: Outcome) -> None:
        """A checker thread, no lock held: apply a check's verdict under the room lock (see
        the module's lock contract)."""
        mismatch: FailureCause = "checksum_mismatch"
        with self._rooms.lock:
            room = self._rooms.get(check.room)
            if room is None or room.sources is None or self._rooms.terminal(room):
                return
            if room.dst_pages is not check.dst_pages:
                return  # a later request under the same room id (its own pages array)
            if outcome is not None:
                err, fault = outcome
                if fault is not None:
                    room.chunk_mismatched(fault)
                self._fail(room, err, cause=mismatch)
                return
            room.last_progress = time.monotonic()
            room.chunk_landed(check.msg)
            self._done(room)

    def in_flight(self) -> int:
        """Any thread: checks queued or running (leak checks)."""
        with self._lock:
            return self._in_flight

    def close(self) -> None:
        """Manager shutdown, no room lock held: drop queued checks, wait for running ones."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._in_flight = 0
