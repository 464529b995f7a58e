"""Page writes held back by a prefill worker's turn and launched together (``cudaipc``'s
:meth:`~kvwire_cudaipc.backend.CudaIpcBackend.post_batch`).

A worker that takes several chunks in one turn of its loop (C > 1, or heterogeneous TP whose
request has a chunk per decode rank) would launch the page mover once per chunk and record an
event for each: on the GPU hosts a launch is 33 us warm and 90-130 us after the thread slept
(docs/benchmarks.md, "What one step costs on the GPU hosts"), and the kernel watcher wakes per
event. Held, a turn's chunks go out as one launch of the batch kernel per shape
(:meth:`kvwire.movers.triton_pool_pages.PoolPageCopier.copy_batch`) and one event that every
transfer of the batch waits for. Only small chunks are held, and a batch goes out once it
holds ``batch_max_bytes`` (the backend's option): a held chunk completes when its whole batch
does, so a batch of large chunks would delay every one of them (4 x H100, 128 MiB chunks at
C=8 held eight at a time: 0.67x the GB/s, ``land`` 4.9-5.3 ms instead of 1.0-1.1).

Thread contract: a held list belongs to the thread that holds it (a ``threading.local``); it
is flushed by that thread when its outermost :meth:`HeldWrites.hold` block ends, by the
backend's ``flush`` callback, which takes the peers' locks itself.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.page_form import PageChunk
from kvwire_cudaipc.state import IpcPair, IpcXfer, locked

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Held:
    """One page write held until its turn ends: the transfer, its pair's state, the chunk
    and each buffer pair's two addresses (as the page mover takes them)."""

    x: IpcXfer
    st: IpcPair
    chunk: PageChunk
    src: NDArray[np.int64]
    dst: NDArray[np.int64]


class HeldWrites:
    """The per-thread lists of held page writes of one backend."""

    def __init__(self, flush: Callable[[list[Held]], None]) -> None:
        self._flush = flush
        self._local = threading.local()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold this thread's page writes until the outermost block ends, then flush them
        (a flush that fails fails its transfers; it never raises out of the block)."""
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._local.items, self._local.bytes = [], 0
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                items: list[Held] = self._local.items
                self._local.items = None
                if items:
                    self._flush_safely(items)

    def holding(self) -> bool:
        """Whether this thread is inside :meth:`hold` (its page writes are held)."""
        return getattr(self._local, "items", None) is not None

    def add(self, held: Held, limit: int) -> None:
        """Hold a page write (this thread is inside :meth:`hold`); once the writes held
        reach ``limit`` bytes they go out now, and holding goes on for the rest of the turn."""
        held.x.held = True
        items: list[Held] = self._local.items
        items.append(held)
        self._local.bytes += held.chunk.nbytes  # set by hold()
        if self._local.bytes >= limit:
            self._local.items, self._local.bytes = [], 0
            self._flush_safely(items)

    def _flush_safely(self, items: list[Held]) -> None:
        try:
            self._flush(items)
        except Exception as exc:  # a launch that failed: its transfers fail, nothing hangs
            logger.exception("cudaipc: launching %d held page writes failed", len(items))
            fail(items, f"cudaipc: the batched mover launch failed: {exc}")


def fail(items: list[Held], why: str) -> None:
    """Fail held transfers that were never launched, and wake their submitters."""
    for h in items:
        with h.x.lock:
            h.x.failed = h.x.failed or why
            h.x.held = False
        if h.x.wake is not None:
            h.x.wake()


def launch_held(
    items: list[Held],
    enqueue: Callable[[list[Held]], Any],
    watch: Callable[[IpcXfer, Any, bool], None],
) -> None:
    """Launch held page writes: under every involved peer's lock (taken in one order),
    writes to a closed peer fail, the others are enqueued together (``enqueue`` returns the
    event recorded after them) and each is handed to the kernel watcher with that event
    (``watch``, told which one is the last to wait for it), in submission order."""
    with locked(h.st.peer for h in items):
        dead = [h for h in items if h.st.peer.closed]
        live = [h for h in items if not h.st.peer.closed]
        if dead:
            fail(dead, "the peer was removed before the write was launched")
        if not live:
            return
        event = enqueue(live)
        for i, h in enumerate(live):
            watch(h.x, event, i == len(live) - 1)
