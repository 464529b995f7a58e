"""What one transfer is, on both sides of the :class:`~kvwire.backend.TransferBackend` seam:
its direction and state, the prepared pair of descriptor tables it indexes, the handle a
submit returns, the notification the target receives, the checks a submit's index arrays
pass before a backend sees them, and which transfers a backend can do at all
(:class:`BackendCapabilities`).

These are values: the backend template creates pairs and handles and owns their lifetimes
(:mod:`kvwire.backend`); a plugin keeps its engine state on them (``state``). They are
importable from :mod:`kvwire.backend` too, the public path of the plugin seam.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict

from kvwire.descriptors import LEN, DescTable, check_indices
from kvwire.errors import CapabilityError, DescriptorError, HandleError
from kvwire.layout import MemKind


class XferOp(enum.Enum):
    """Direction of a transfer, seen from the initiator."""

    WRITE = "write"
    READ = "read"


class XferState(enum.IntEnum):
    """State of a transfer handle. ``DONE`` and ``FAILED`` are terminal."""

    PENDING = 0
    DONE = 1
    FAILED = 2


class Notification(NamedTuple):
    """A notification delivered to the target after the data of its transfer landed."""

    peer: str
    payload: bytes


class LaterNote:
    """A notification whose bytes are made when they are needed, not at submit: prefill's
    first note of a checksummed chunk on a GPU, whose sums are still being computed on the
    device while the chunk's write is launched (:mod:`kvwire.session.prefill.pipeline`).

    ``make`` runs at most once, on the first call (whichever thread: the backend's, after
    the data landed, or the template's at submit for a backend without
    :attr:`BackendCapabilities.later_notes`); later calls return its bytes, or raise its
    error again. It may block until what it reads is ready (a device event).
    """

    __slots__ = ("_done", "_error", "_lock", "_make", "_value", "sums")

    def __init__(self, make: Callable[[], bytes], sums: WriteSums | None = None) -> None:
        #: The chunk's sums that ``make`` reads, for a writer to compute in its own launch
        #: (:attr:`BackendCapabilities.summed_writes`) or to start beside it.
        self.sums = sums
        self._make: Callable[[], bytes] | None = make
        self._lock = threading.Lock()
        self._done = False
        self._value = b""
        self._error: BaseException | None = None

    def __call__(self) -> bytes:
        with self._lock:
            if not self._done:
                make, self._make = self._make, None
                assert make is not None
                try:
                    self._value = make()
                except Exception as exc:
                    self._error = exc
                self._done = True
            if self._error is not None:
                raise self._error
            return self._value


#: A transfer's notification as a submit takes it: its bytes, or bytes made later.
Note = bytes | LaterNote


class WriteSums(Protocol):
    """A chunk's checksums that its note waits for (:class:`kvwire.integrity_orders.SumsOrder`
    on a GPU), as a backend sees them: a writer that declares
    :attr:`BackendCapabilities.summed_writes` may :meth:`take` them into the launch of its
    copy (then :meth:`launched` or :meth:`abandon`); any writer that does not sum them starts
    them beside its write (:meth:`start`, the template does it at submit)."""

    #: Pages of the chunk; the device the sums run on.
    pages: int
    device: Any

    def take(self) -> Any:
        """The launch's arguments (:class:`kvwire.integrity_orders.FusedSums`), or None."""

    def launched(self, stream: Any) -> None:
        """The taken sums were enqueued with the write on ``stream``."""

    def abandon(self) -> None:
        """The taken sums were not launched."""

    def start(self) -> None:
        """Launch the sums on their own now (nothing if taken, launched or started)."""


def note_sums(note: Note | None) -> WriteSums | None:
    """The sums a notification waits for (a :class:`LaterNote`'s), or None. A backend's
    submitting thread, before it launches the write."""
    return note.sums if isinstance(note, LaterNote) else None


def start_sums(note: Note | None) -> None:
    """Start the sums ``note`` waits for beside the write (no-op without any): the template's
    submit for a backend that does not declare :attr:`BackendCapabilities.summed_writes`,
    and such a backend for a write it does not sum."""
    sums = note_sums(note)
    if sums is not None:
        sums.start()


def note_bytes(note: Note | None) -> bytes | None:
    """The bytes of ``note`` (made now if it is a :class:`LaterNote`). Called where a
    notification is posted: by the backend template at submit for a backend without
    :attr:`BackendCapabilities.later_notes`, and by one with it once the data landed."""
    return note() if isinstance(note, LaterNote) else note


class BackendCapabilities(BaseModel):
    """What a backend can do; checked once, when the backend is selected."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    write: bool = True
    read: bool = False
    notifications: bool = True
    dram: bool = True
    vram: bool = False
    cross_host: bool = True
    #: Takes chunks in page form (:meth:`~kvwire.backend.TransferBackend.submit_pages`,
    #: :mod:`kvwire.page_form`): page lists and a geometry instead of one row per run.
    page_writes: bool = False
    #: Takes a :class:`LaterNote` as a transfer's notification and makes its bytes only when
    #: it posts the notification, after the data (a backend whose own thread sends it once
    #: the data landed: ``cudaipc``). The template makes the bytes at submit for any other.
    later_notes: bool = False
    #: Computes the checksums a :class:`LaterNote` waits for (:attr:`LaterNote.sums`) in the
    #: launch of the write itself where it can (``cudaipc``'s page mover), and starts them
    #: beside the write where it cannot. The template starts them at submit for any other.
    summed_writes: bool = False

    def supports_kind(self, kind: MemKind) -> bool:
        """Whether regions of memory ``kind`` can be registered."""
        return self.vram if kind == MemKind.VRAM else self.dram


@dataclass(eq=False)
class PreparedPair:
    """A local and a remote descriptor table prepared once for one peer.

    Created by :meth:`TransferBackend.prepare` on the initiating side; ``state`` belongs to the
    backend. Invalid after :meth:`TransferBackend.release_prepared` or peer removal.
    """

    id: int
    peer: str
    local_rows: int
    remote_rows: int
    local_lens: np.ndarray = field(repr=False)
    remote_lens: np.ndarray = field(repr=False)
    state: Any = field(default=None, repr=False)
    released: bool = False

    @classmethod
    def of_tables(cls, id: int, peer: str, local: DescTable, remote: DescTable) -> PreparedPair:
        """A pair for two checked tables (rows and row lengths kept for submits' checks)."""
        return cls(
            id, peer, local.shape[0], remote.shape[0], local[:, LEN].copy(), remote[:, LEN].copy()
        )


@dataclass(eq=False)
class TransferHandle:
    """One submitted transfer. Poll until terminal, then release exactly once."""

    id: int
    peer: str
    op: XferOp
    num_descs: int
    num_bytes: int
    state: Any = field(default=None, repr=False)
    released: bool = False
    #: Why the transfer failed, set by the backend when it reports FAILED.
    error: str | None = None
    #: Given to :meth:`TransferBackend.submit` by the submitter: a backend that
    #: :attr:`~TransferBackend.pushes_events` calls it (any thread, once) when the transfer
    #: becomes terminal, so the submitter may sleep until then instead of polling on a timer.
    wake: Callable[[], None] | None = field(default=None, repr=False)
    #: The backend will call ``wake`` when this transfer is terminal (its class
    #: :attr:`~TransferBackend.pushes_events`; a backend list: the member it is on now), so
    #: the submitter may sleep until then. Set at submit; a list's failover may change it.
    pushes: bool = False


def check_rows(
    pair: PreparedPair, local_idx: Any, remote_idx: Any
) -> tuple[np.ndarray, np.ndarray, int]:
    """The index arrays of a submit into ``pair``, checked (vectorised): ``int64`` rows inside
    both tables, equally many, at least one, and each local row as long as its remote row.
    Returns both arrays and the bytes they move; :class:`DescriptorError` naming the first
    problem. Called by :meth:`TransferBackend.submit <kvwire.backend.TransferBackend.submit>`
    on the submitting worker's thread, without a lock."""
    li = check_indices(local_idx, pair.local_rows, "local index array")
    ri = check_indices(remote_idx, pair.remote_rows, "remote index array")
    if li.shape != ri.shape:
        raise DescriptorError(
            f"local and remote index arrays differ in length ({li.size} vs {ri.size})"
        )
    if li.size == 0:
        raise DescriptorError("empty transfer: index arrays hold no rows")
    llen, rlen = pair.local_lens[li], pair.remote_lens[ri]
    if not np.array_equal(llen, rlen):
        i = int(np.argmax(llen != rlen))
        raise DescriptorError(
            f"row lengths differ at position {i}: local row {int(li[i])} has "
            f"{int(llen[i])} bytes, remote row {int(ri[i])} has {int(rlen[i])}"
        )
    return li, ri, int(llen.sum())


def check_submit(
    name: str,
    caps: BackendCapabilities,
    op: XferOp,
    pair: PreparedPair,
    notification: Note | None,
) -> None:
    """What a submit (rows or pages) asks of backend ``name`` (capabilities ``caps``) and of
    ``pair``: the direction and notifications supported, the pair not released. Called by
    the backend template's submits, on the submitting worker's thread, without a lock."""
    if op is XferOp.READ and not caps.read:
        raise CapabilityError(f"backend {name!r} does not support READ")
    if op is XferOp.WRITE and not caps.write:
        raise CapabilityError(f"backend {name!r} does not support WRITE")
    if notification is not None and not caps.notifications:
        raise CapabilityError(f"backend {name!r} does not deliver notifications")
    if pair.released:
        raise HandleError(
            f"prepared pair {pair.id} for peer {pair.peer!r} was released "
            "(peer removed or tables rebuilt); prepare again"
        )
