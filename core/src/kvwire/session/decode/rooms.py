"""Decode's per-request record (:class:`RecvRoom`): what one request expects and has
received on this rank, and the checks made on it (a chunk's checksums, the failure report).

Plain data with methods that read and update only the record: every one is called under the
room lock (:class:`~kvwire.session.rooms.RoomTable`) by the decode side; a chunk's checksum
check (:class:`ChunkCheck`) is built under it and run off it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.control.wire import ChunkNote
from kvwire.errors import TransferError
from kvwire.integrity import LayerSums, add_sums, layer_ranges, mismatched_layers
from kvwire.session.checksums import LandedSums
from kvwire.session.decode.group_check import GroupCheck
from kvwire.session.decode.links import PrefillLink
from kvwire.session.metrics import RequestMetrics
from kvwire.session.report import (
    ChunkFault,
    FailureCause,
    FailureReport,
    LandedChunks,
    SourceState,
    build_report,
)

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
    #: Pieces counted (their checks passed) of chunks still missing parts (1.12).
    pieces: dict[tuple[int, int], int] = field(default_factory=dict)
    aux_done: bool = False
    #: Buffer groups: this rank's slots for the request, and the senders whose group
    #: transfer landed.
    group_dst: dict[str, NDArray[np.int64]] = field(default_factory=dict)
    groups_from: set[int] = field(default_factory=set)
    #: State notes in parts (1.14: the transfer's, then its late sums): per sender, the
    #: parts arrived and the sums they carried so far.
    state_parts: dict[int, tuple[int, dict[int, int]]] = field(default_factory=dict)
    #: Source sessions that confirmed (or are gone) that none of their writes for this failed
    #: request is in flight; and when they were last asked.
    quiet: set[str] = field(default_factory=set)
    queried_at: float = 0.0
    failed_at: float = 0.0
    #: The pool the KV goes to ("kv" or an extra pool); for an extra pool, whether the
    #: engine hooks ran.
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
    #: Prefill sessions asked again after they dropped the request unread
    #: (:mod:`kvwire.session.decode.rejoin`).
    asked_again: set[str] = field(default_factory=set)

    def pages_in(self, pool: str) -> Any:
        """Under the room lock (strategies, through ``StagingContext.room_pages``): the
        destination pages of this request when its KV goes to ``pool``, else None."""
        return self.dst_pages if self.pool == pool else None

    def build_report(self, page_size: int) -> FailureReport:
        """Under the room lock, engine thread, once the room failed: what of it landed on
        this rank and what is missing (:mod:`kvwire.session.report`)."""
        states = [
            SourceState(
                s.sender_id,
                s.dummy,
                s.sender_id in self.expected
                and self.received.get(s.sender_id, 0) == self.expected[s.sender_id],
                not s.groups or s.sender_id in self.groups_from,
            )
            for s in self.sources or ()
        ]
        return build_report(
            self.room,
            self.cause,
            str(self.error),
            self.dst_pages,
            self.landed,
            states,
            page_size,
            self.cached_tokens,
            self.aux_done,
            judged=self.pool == "kv" and self.requested,
            peer=self.fault_peer,
            chunk=self.fault_chunk,
        )

    def fresh_part(self, msg: ChunkNote) -> bool:
        """Progress or liveness thread, under the lock: whether a KV segment's note is new (it
        names a part the chunk has, and was not counted before: a segment resent after
        failover landed again, and is counted once). Marks it seen; the sums a whole chunk's
        part carries are kept for :meth:`chunk_check` (a piece's are checked alone)."""
        if msg.parts > 1 and msg.part >= msg.parts:
            logger.warning(
                "room %d: dropped a note for segment %d of %d", self.room, msg.part, msg.parts
            )
            return False
        seen = (msg.what, msg.sender_id, msg.chunk_id, msg.part)
        if seen in self.notes_seen:
            return False
        self.notes_seen.add(seen)
        if msg.sums and msg.piece_layers is None:  # after the checks above
            add_sums(
                self.sent_sums.setdefault((msg.sender_id, msg.chunk_id), {}),
                dict(zip(msg.sum_layers, msg.sums, strict=True)),
            )
        return True

    def take_part(self, msg: ChunkNote) -> bool:
        """Under the lock, once a fresh part's note (:meth:`fresh_part`) is counted (a piece's
        once its check passed): True when it completes its chunk (every part counted). Raises
        when a chunk mixes pieces and whole parts."""
        key = (msg.sender_id, msg.chunk_id)
        pieces = self.pieces.get(key, 0) + (msg.piece_layers is not None)
        if msg.parts > 1:
            got = self.partial.get(key, 0) + 1
            if got < msg.parts:
                self.partial[key] = got
                if pieces:
                    self.pieces[key] = pieces
                return False
            self.partial.pop(key, None)
        self.pieces.pop(key, None)
        if pieces not in (0, msg.parts):
            raise TransferError(
                f"chunk {msg.chunk_id} from sender {msg.sender_id} came in {pieces} pieces "
                f"and {msg.parts - pieces} whole parts (a chunk is cut in pieces or not at all)",
                room=self.room,
            )
        return True

    def incomplete(self) -> str:
        """Under the lock (the waiting timeout's error): the chunks some of whose parts
        arrived and not all, by sender, naming a checked chunk none of whose arrived parts
        carried checksums (a whole chunk's sums come as its last part, over the control
        channel: :mod:`kvwire.session.prefill.late_sums`); "" when there is none."""
        checked = {s.sender_id for s in self.sources or () if s.checksums is not None}
        out = []
        for (sender, chunk), got in sorted(self.partial.items()):
            key = (sender, chunk)
            sums = sender not in checked or key in self.sent_sums or key in self.pieces
            what = "others missing" if sums else "none with its checksums"
            out.append(f"chunk {chunk} from sender {sender}: {got} parts arrived, {what}")
        return f"; incomplete chunks: {'; '.join(out)}" if out else ""

    def chunk_landed(self, msg: ChunkNote) -> None:
        """Under the lock: a complete chunk passed its checks; count it (and, for the KV
        pool, what it wrote: the failure report's evidence)."""
        self.received[msg.sender_id] = self.received.get(msg.sender_id, 0) + 1
        if self.pool == "kv":
            self.landed.add(msg.sender_id, msg.span, msg.num_pages, msg.page_size)
        if msg.last:
            self.expected[msg.sender_id] = msg.chunk_id + 1

    def chunk_check(self, msg: ChunkNote, sent: dict[int, int]) -> ChunkCheck | None:
        """Progress or liveness thread, under the lock, once a KV chunk is complete (every
        part arrived, staged blocks scattered), or once a piece's note arrived (``sent``: the
        note's own sums): the check to run on it (off the lock, by the decode side's
        :class:`~kvwire.session.decode.checker.ChunkChecker`), or None when its source sends
        no checksums (or the KV goes to the host pool). Raise when the source should have
        sent sums and the note carries no chunk span."""
        assert self.sources is not None and self.dst_pages is not None
        link = next(
            s
            for s in self.sources
            if s.info.session == msg.session and s.sender_id == msg.sender_id
        )
        if link.checksums is None or self.pool != "kv":
            return None
        if msg.span is None or msg.num_pages is None:
            raise TransferError(
                f"chunk {msg.chunk_id} from {link.info.agent} (sender {msg.sender_id}) came "
                "without its checksum, which this rank asked for",
                room=self.room,
            )
        return ChunkCheck(
            self.room, msg, sent, link, link.checksums, self.dst_pages, self.cached_tokens
        )

    def state_part(self, msg: ChunkNote) -> dict[int, int] | None:
        """Progress or liveness thread, under the lock, when a part of a sender's state note
        arrived: the sums its parts carried once every part is here, else None (a part is
        missing, or this one was seen before: a resend after failover, or a part number the
        note does not have). A note of one part is complete at once."""
        seen = (msg.what, msg.sender_id, msg.chunk_id, msg.part)
        if msg.part >= msg.parts or seen in self.notes_seen:
            return None
        self.notes_seen.add(seen)
        got, sums = self.state_parts.pop(msg.sender_id, (0, {}))
        add_sums(sums, dict(zip(msg.sum_layers, msg.sums, strict=True)))
        if got + 1 < msg.parts:
            self.state_parts[msg.sender_id] = (got + 1, sums)
            return None
        return sums

    def group_check(self, msg: ChunkNote, sent: dict[int, int]) -> GroupCheck | None:
        """Progress or liveness thread, under the lock, once a sender's state note is
        complete (its buffer groups landed; ``sent``: the sums its parts carried): their
        check, or None when that link's groups are not checked (no ``kv_checksum``, or a
        prefill older than protocol 1.14)."""
        assert self.sources is not None and self.dst_pages is not None
        link = next(
            s
            for s in self.sources
            if s.info.session == msg.session and s.sender_id == msg.sender_id
        )
        if link.group_sums is None:
            return None
        return GroupCheck(
            self.room, msg, sent, link, link.group_sums, self.group_dst, self.dst_pages
        )

    def piece_check(self, msg: ChunkNote) -> ChunkCheck | None:
        """Under the lock, when a fresh piece's note arrived (``ChunkNote.piece_layers``,
        1.12; its rows landed): the check of its layers alone, or None when the note is no
        piece or nothing is checked here (the piece then counts as a part at once)."""
        if msg.piece_layers is None:
            return None
        return self.chunk_check(msg, dict(zip(msg.sum_layers, msg.sums, strict=True)))

    def chunk_mismatched(self, fault: ChunkFault) -> None:
        """Under the lock: a chunk failed its checksum; name it in the failure report."""
        self.fault_peer = fault.peer
        self.fault_chunk = fault


@dataclass(frozen=True)
class ChunkCheck:
    """One complete chunk's checksum check, or one piece's (``msg.piece_layers``): everything
    it reads, copied out of the room under the lock, so that :meth:`run` needs no lock (the
    room may be cleared meanwhile:
    ``dst_pages`` is the room's array, never changed after ``send_metadata``, and the link's
    :class:`~kvwire.session.checksums.LandedSums` only reads its own tables and the rank's
    KV rows)."""

    room: int
    msg: ChunkNote
    #: The per-layer sums the chunk's notes carried.
    sent: dict[int, int]
    link: PrefillLink
    checksums: LandedSums
    dst_pages: NDArray[np.int64]
    cached_tokens: int | None

    def start(self) -> Callable[[], LayerSums] | None:
        """The thread that will :meth:`run` the check, no lock held: launch the sums now
        where the link's hasher computes beside the caller (a GPU's), for :meth:`run` to wait
        for (:meth:`LandedSums.chunk_later <kvwire.session.checksums.LandedSums.chunk_later>`);
        None when it sums in :meth:`run` (or could not launch: :meth:`run` then finds and
        reports why)."""
        msg = self.msg
        assert msg.span is not None and msg.num_pages is not None
        try:
            return self.checksums.chunk_later(
                msg.num_pages, self.dst_pages, self.cached_tokens, msg.span, msg.piece_layers
            )
        except Exception:  # run() sums it again and names the error
            return None

    def run(
        self, later: Callable[[], LayerSums] | None = None
    ) -> tuple[TransferError, ChunkFault | None] | None:
        """A checker thread (or the thread that saw the chunk complete), no lock held: sum
        the rows the chunk wrote (only its piece's layers for a piece's note), or wait for
        the sums :meth:`start` launched (``later``), and compare. None when they match;
        else the error failing the request (naming the chunk, the layers and the peer) and,
        for a mismatch, the chunk fault for the failure report."""
        msg, link = self.msg, self.link
        assert msg.span is not None and msg.num_pages is not None
        try:
            if later is not None:
                landed = later()
            else:
                landed = self.checksums.chunk(
                    msg.num_pages, self.dst_pages, self.cached_tokens, msg.span, msg.piece_layers
                )
        except Exception as exc:  # a note that names no chunk of this request
            err = TransferError(
                f"cannot check chunk {msg.chunk_id} from {link.info.agent}: {exc}", room=self.room
            )
            return err, None
        bad = mismatched_layers(self.sent, landed)
        if not bad:
            return None
        fault = ChunkFault(
            link.info.agent, msg.sender_id, msg.chunk_id, msg.span, layer_ranges(bad)
        )
        err = TransferError(
            f"KV checksum mismatch in chunk {msg.chunk_id} (request pages "
            f"[{msg.span[0]}, {msg.span[1]})) from {link.info.agent} (sender "
            f"{msg.sender_id}): layers {layer_ranges(bad)} differ from what it sent",
            room=self.room,
        )
        return err, fault

    def landed(self, room: RecvRoom) -> None:
        """Under the room lock, the check of a whole chunk passed: count it."""
        room.chunk_landed(self.msg)
