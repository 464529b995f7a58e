"""Page writes launched a turn at a time: the seam of prefill's lean lane.

A backend that writes decode's pages with a launch of its own (``cudaipc``) may offer a
:class:`PageLane` as its ``page_lane`` attribute. Prefill's transfer worker
(:mod:`kvwire.session.prefill.lane`) then hands it, once per turn of its loop, every chunk it
took that the lane can carry -- a request's only chunk to a decode rank, in page form, on a
prepared pair the lane :meth:`~PageLane.takes`, no checksum, no layer gate, no buffer group --
each with its note already framed. The lane launches them together (one launch and one event
per ``batch_max_bytes``), sends each note once its bytes landed, fills in which writes failed
and finishes the :class:`LaneLaunch`, which wakes the worker. No transfer handle exists per
write: the worker's bookkeeping for the whole turn is one section of the room lock before
the launch and one after it (:class:`kvwire.session.prefill.writes.WriteBook`).

What a lane keeps from :meth:`~kvwire.backend.TransferBackend.submit_pages`: the checks
(:func:`check_write`: the pair not released, the chunk's pages and geometry inside both
tables), the notification strictly after the data, a removed peer's writes refused (never
launched into memory it unmapped), a failure per write (one write's problem fails its
request alone). What it drops: the handle table, per-write polls and releases. A backend
list (:mod:`kvwire.backends.multi_lane`) offers the lane of each link's current member; a
write that fails there for its link is marked for :attr:`LaneLaunch.retry` and posted again
by the worker's general path, which fails it over.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from kvwire.page_form import PageChunk, PageGeometry, check_page_chunk
from kvwire.transfers import BackendCapabilities, PreparedPair, XferOp, check_submit


@dataclass(eq=False)
class LaneWrite:
    """One chunk of a turn: written into ``pair``'s remote pages, ``note`` (a framed
    :class:`~kvwire.control.wire.ChunkNote`) sent to the pair's peer once it landed."""

    pair: PreparedPair
    chunk: PageChunk
    note: bytes


@dataclass(eq=False)
class LaneLaunch:
    """A turn's writes as one launch (made by :meth:`PageLane.launch`, on the worker's
    thread). The lane records each write's failure in ``errors`` (None: its bytes landed and
    its note was handed to the side channel), then calls :meth:`finish` once, from whichever
    thread learns that the last write is terminal; the worker reads ``errors`` only after
    ``done``."""

    writes: Sequence[LaneWrite]
    wake: Callable[[], None] | None = None
    errors: list[str | None] = field(default_factory=list)
    #: Per write: its failure was the link's (peer gone, launch or kernel failed, note not
    #: sent), not the write's own (a check it failed); a backend list fails the member over.
    links: list[bool] = field(default_factory=list)
    #: Per write: failed here, but another backend of its link may carry it (a backend
    #: list's fallback): the worker posts it again on its general path instead of failing it.
    retry: list[bool] = field(default_factory=list)
    done: bool = False
    #: The lane's check, for the worker's polls: whatever of the launch ended is handled now
    #: on the polling thread (its notes sent, the launch finished after its last group), so
    #: a note does not wait for the lane's own thread to get the GIL. Cheap, never blocks.
    poll: Callable[[], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        n = len(self.writes)
        self.errors = self.errors or [None] * n
        self.links = self.links or [False] * n
        self.retry = self.retry or [False] * n

    @classmethod
    def refused(cls, writes: Sequence[LaneWrite], why: str) -> LaneLaunch:
        """A finished launch whose every write failed for ``why`` (a lane's launch that
        raised: the link's failure), for the caller to handle as any other."""
        launch = cls(writes)
        launch.fail(range(len(writes)), why)
        launch.finish()
        return launch

    def fail(self, indices: Sequence[int], why: str, link: bool = True) -> None:
        """The lane: writes ``indices`` failed (the first reason a write gets is kept);
        ``link``: for a reason of the link's (see :attr:`links`)."""
        with self._lock:
            for i in indices:
                if self.errors[i] is None:
                    self.errors[i] = why
                    self.links[i] = link

    def finish(self) -> None:
        """The lane, once every write is terminal: mark the launch done (its ``poll`` let
        go: a lane's poll refers back to its launch, a cycle per turn otherwise left to the
        garbage collector) and wake the worker."""
        with self._lock:
            if self.done:
                return
            self.done = True
            self.poll = None
        if self.wake is not None:
            self.wake()


class PageLane(Protocol):
    """What a backend's lane does for prefill's worker (its thread, one turn at a time)."""

    def takes(self, pair: PreparedPair, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` on ``pair`` may go through the lane (else the
        worker submits it as a transfer of its own)."""
        ...

    def launch(self, writes: Sequence[LaneWrite], wake: Callable[[], None]) -> LaneLaunch:
        """Launch ``writes`` (each checked with :func:`check_write`; one that fails its check
        or whose peer is gone fails alone) and return their launch, which calls ``wake``
        when it is done. Never waits for the GPU; raises only for a fault of the lane
        itself (the worker then fails every write of the turn)."""
        ...

    def warm(self, pair: PreparedPair, geometry: PageGeometry) -> None:
        """Prefill's handshake thread, once a link whose KV chunks move in page form over
        ``pair`` is built (whether or not the lane will carry them): prepare, off the request
        path, what writes of ``geometry`` on ``pair`` will need (``cudaipc``: its pairs'
        addresses and the page mover's compiled kernels), so a link's first requests do not
        wait for it. Returns at once (long work goes to a thread of the lane's); never
        raises for a problem of the pair: the first write reports it."""
        ...

    def warm_ahead(
        self, geometry: PageGeometry, src_addrs: NDArray[np.int64], dst_addrs: NDArray[np.int64]
    ) -> None:
        """Prefill, at its start (before any link): prepare what writes of ``geometry``
        between buffer pairs at ``src_addrs`` and ``dst_addrs`` (this rank's own addresses,
        standing in for a decode rank of its layout) will launch. Returns at once."""
        ...


def check_write(backend_name: str, caps: BackendCapabilities, write: LaneWrite) -> None:
    """The checks :meth:`~kvwire.backend.TransferBackend.submit_pages` makes of a WRITE with
    a notification, for one lane write (:class:`~kvwire.errors.KVWireError` naming the
    problem). Called by a lane's :meth:`PageLane.launch`."""
    check_submit(backend_name, caps, XferOp.WRITE, write.pair, write.note)
    check_page_chunk(write.chunk, write.pair.local_lens, write.pair.remote_lens)
