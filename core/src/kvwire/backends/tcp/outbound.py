"""What the ``tcp`` backend's initiator holds per transfer and per peer, and how a transfer is
cut into parts. Owned by the backend's I/O thread once a transfer is queued; the ``cudaipc``
plugin queues its side-channel writes through :meth:`TcpBackend._queue` and reads their state."""

from __future__ import annotations

import collections
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from numpy.typing import NDArray

from kvwire.backend import XferOp, XferState
from kvwire.backends.tcp.auth import DataPlaneAuth
from kvwire.control.reach import keep_alive
from kvwire.layout import MemoryRegion

__all__ = ["OutboundPeer", "OutboundTransfer", "open_dealer", "split_rows"]

#: Per part: local rows and remote rows (addr, len) - equal lengths, row by row.
Part = tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64]]


@dataclass(eq=False)
class OutboundTransfer:
    """Initiator-side state of one transfer, owned by the I/O thread after submission."""

    xid: int
    peer: str
    op: XferOp
    parts: list[Part]
    notification: bytes | None
    #: ``time.monotonic()`` after which the initiator fails the transfer.
    deadline: float
    #: ``time.time()`` by which a write part must land on the target (the deadline less the
    #: clock guard); sent with every write part, the target drops a part that comes later.
    write_by: float | None = None
    next_part: int = 0
    replies: int = 0
    pending_frames: list[Any] | None = None
    status: XferState = XferState.PENDING
    error: str | None = None
    #: The submitter's waker (:attr:`TransferHandle.wake`), called once the status is final.
    wake: Callable[[], None] | None = None
    #: A note (:data:`~kvwire.backends.tcp.wire.NOTE`): no rows, no reply; DONE once sent.
    note_only: bool = False


@dataclass(eq=False)
class OutboundPeer:
    """A peer the initiator writes to: its DEALER socket, queued and in-flight transfers."""

    name: str
    endpoint: str
    regions: list[MemoryRegion]
    sock: zmq.Socket[Any] | None = None
    outq: collections.deque[OutboundTransfer] = field(default_factory=collections.deque)
    inflight: dict[int, OutboundTransfer] = field(default_factory=dict)
    #: A second DEALER to the same endpoint for notes alone, used by any thread under
    #: ``notes_lock`` and never polled (nothing answers a note): a note leaves from the thread
    #: that queues it instead of waiting for the I/O thread's next turn. Opened and closed by
    #: the I/O thread (closed under the lock).
    notes: zmq.Socket[Any] | None = None
    notes_lock: threading.Lock = field(default_factory=threading.Lock)
    #: The peer's local notes socket (:mod:`~kvwire.backends.tcp.local_notes`) when it runs on
    #: this host and offers one; notes go there first.
    local_notes: str | None = None

    def send_note(self, frames: list[Any]) -> bool:
        """Any thread: hand a note's frames to the notes socket without blocking; False when
        it cannot take them now (closed, or at its high-water mark): the caller queues the
        note for the I/O thread instead."""
        with self.notes_lock:
            if self.notes is None:
                return False
            try:
                self.notes.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                return False
        return True

    def close(self) -> None:
        """I/O thread (or close, after it stopped): close both sockets."""
        if self.sock is not None:
            self.sock.close(linger=0)
        with self.notes_lock:
            if self.notes is not None:
                self.notes.close(linger=0)
                self.notes = None


def open_dealer(
    ctx: zmq.Context[Any], endpoint: str, peer: str, hwm: int, auth: DataPlaneAuth | None
) -> zmq.Socket[Any]:
    """A DEALER connected to ``peer``'s data ``endpoint`` (CURVE client when ``auth``); I/O
    thread, at add_peer. ``ValueError`` naming the peer when it cannot connect (the socket is
    closed then: a leaked one would make the context's term() hang)."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        keep_alive(sock)
        if auth is not None:
            auth.secure_client(sock)
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ValueError(
            f"cannot connect to endpoint {endpoint!r} of peer {peer!r}: {exc}"
        ) from exc
    return sock


def split_rows(
    a: NDArray[np.uint64], b: NDArray[np.uint64], lens: NDArray[np.uint64], limit: int
) -> list[Part]:
    """Cut rows so that no part exceeds ``limit`` bytes (long rows are split first)."""
    pieces = ((lens + np.uint64(limit - 1)) // np.uint64(limit)).astype(np.int64)
    if (pieces > 1).any():
        rep = np.repeat(np.arange(a.size), pieces)
        first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
        k = (np.arange(rep.size) - np.repeat(first, pieces)).astype(np.uint64)
        off = k * np.uint64(limit)
        new_len = np.minimum(lens[rep] - off, np.uint64(limit))
        a, b, lens = a[rep] + off, b[rep] + off, new_len
    ends = np.cumsum(lens)
    part_of = ((ends - lens) // np.uint64(limit)).astype(np.int64)
    # Rows may straddle a limit boundary; grouping by start offset keeps parts <= 2*limit.
    cuts = np.flatnonzero(np.diff(part_of)) + 1
    return [
        (pa, pb, pl)
        for pa, pb, pl in zip(
            np.split(a, cuts), np.split(b, cuts), np.split(lens, cuts), strict=True
        )
    ]
