"""Layer-wise streaming: a chunk's KV moves layer group by layer group while prefill computes.

A prefill forward pass over ``L`` layers produces layer ``i``'s KV long before layer ``L-1``'s.
The engine declares such a chunk with ``tx.send(pages, layerwise=True)`` before (or while) it
computes it, and then calls ``tx.layer_ready(layer, event)`` after each layer (or a run of
layers); the transfer worker posts a layer *group* as soon as every layer of it is marked and
its CUDA event (if any) has completed. Only the last group's transfer is left once the pass
ends.

Cost is bounded: the rank's layers are cut into ``layerwise_groups`` contiguous groups (a
control option), and each group is one transfer with one note per memory-kind segment
(:attr:`~kvwire.control.wire.ChunkNote.parts` counts all of them), so notes grow with the
number of groups, never with the number of layers or with the engine's ``layer_ready`` calls.
Decode's completion rules do not change: it counts a chunk once every part arrived.

Threads: :class:`LayerGate` is written by the engine thread (:meth:`LayerGate.mark`) and read
by one transfer worker per destination (:meth:`LayerGate.ready_until`); its own lock guards
its marks, held only for list updates and never across an event query.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import ConfigError, TransferError
from kvwire.staging.base import ChunkPlan, Segment

R = TypeVar("R")


class ReadyEvent(Protocol):
    """What the engine may pass with a mark: ``torch.cuda.Event`` (recorded on the compute
    stream after the layer's KV writes) or anything with the same ``query()``."""

    def query(self) -> bool: ...


def group_edges(start: int, end: int, groups: int) -> NDArray[np.int64]:
    """Boundaries (model layer ids) of ``groups`` contiguous layer groups covering
    ``[start, end)``, as even as possible; fewer groups when there are fewer layers."""
    n = max(1, min(groups, end - start))
    return np.linspace(start, end, n + 1).round().astype(np.int64)


class LayerGate:
    """Which layers of one layer-wise chunk are computed (marked, and their events done).

    Created by the engine thread in ``send(..., layerwise=True)``; shared by the chunk's jobs
    (one per destination). Layers are model layer ids in ``[start, end)``, the rank's PP
    stage. Marks must increase; marking layer ``i`` says every layer up to ``i`` is computed.
    """

    def __init__(self, start: int, end: int, groups: int) -> None:
        self.start = start
        self.end = end
        #: Boundaries of the layer groups posted one by one (see :func:`group_edges`).
        self.edges = group_edges(start, end, groups)
        self.created = time.monotonic()
        self._lock = threading.Lock()
        #: Marks not yet known to be complete: (first layer not covered, event or None).
        self._marks: deque[tuple[int, ReadyEvent | None]] = deque()
        #: First layer not marked by the engine (engine thread's view).
        self._marked = start
        #: First layer not ready (marks whose events completed; worker view).
        self._ready = start
        #: Idle workers waiting for this gate (set by :meth:`mark`).
        self._wakers: set[threading.Event] = set()

    @property
    def fully_marked(self) -> bool:
        """Every layer was marked by the engine (its events may still be running)."""
        with self._lock:
            return self._marked >= self.end

    def mark(self, layer: int | None, event: Any | None = None) -> None:
        """Engine thread: layers up to ``layer`` (inclusive; None: every layer) are computed,
        or will be once ``event`` completes. Raises ``ConfigError`` for a layer outside the
        rank's range or not after the previous mark."""
        if event is not None and not callable(getattr(event, "query", None)):
            raise ConfigError(
                f"layer_ready(event=...) takes an object with query() (a torch.cuda.Event "
                f"recorded after the layer's KV writes), not {type(event).__name__}"
            )
        with self._lock:
            upto = self.end if layer is None else layer + 1
            if not self.start < upto <= self.end:
                raise ConfigError(
                    f"layer_ready({layer}): this rank holds layers [{self.start}, {self.end})"
                )
            if upto <= self._marked:
                raise ConfigError(
                    f"layer_ready({layer}): layers up to {self._marked - 1} were already "
                    "marked; mark each layer once, in order"
                )
            self._marked = upto
            self._marks.append((upto, event))
            wakers = list(self._wakers)
        for w in wakers:
            w.set()

    def watch(self, waker: threading.Event) -> bool:
        """Transfer worker, before it idles on this gate: :meth:`mark` sets ``waker``.
        Returns True when a marked layer still waits for its event (poll it soon)."""
        with self._lock:
            self._wakers.add(waker)
            return any(ev is not None for _, ev in self._marks)

    def ready_until(self) -> int:
        """Transfer worker: the first layer not computed yet (``end`` when all are). Queries
        the pending events in order (they are recorded on one stream), without blocking."""
        while True:
            with self._lock:
                if not self._marks:
                    return self._ready
                upto, event = self._marks[0]
            if event is not None and not event.query():
                return self._ready
            with self._lock:
                if self._marks and self._marks[0][0] == upto:
                    self._marks.popleft()
                    self._ready = max(self._ready, upto)

    def ready_by(self, limit_s: float, room: int) -> int:
        """Transfer worker: :meth:`ready_until`, raising ``TransferError`` when layers are
        still unmarked ``limit_s`` after the chunk was sent (the engine forgot them)."""
        ready = self.ready_until()
        if ready < self.end and time.monotonic() - self.created > limit_s:
            raise TransferError(
                f"layer-wise chunk: {self.missing()} were never marked computed "
                f"(tx.layer_ready) within transfer_timeout_s={limit_s}",
                room=room,
            )
        return ready

    def missing(self) -> str:
        """The layers not marked yet, for an error message. Any thread."""
        with self._lock:
            return f"layers [{self._marked}, {self.end})" if self._marked < self.end else "none"


@dataclass(eq=False)
class LayeredChunk(Generic[R]):
    """A layer-wise chunk being posted group by group by one transfer worker: ``groups[g]``
    are the segments of layer group ``g`` (rows of layers ``[edges[g], edges[g+1])``), or
    None when the chunk cannot be cut by layer and moves whole once every layer is computed.
    ``ref`` is the worker's completion record of the plan."""

    plan: ChunkPlan
    ref: R
    edges: NDArray[np.int64]
    groups: list[list[Segment]] | None
    #: Stages group ``g``'s bytes before its rows are posted (a staging strategy's
    #: :attr:`~kvwire.staging.base.LayerPlan.fill`); called for every group, in order.
    fill: Callable[[int], None] | None = None
    next: int = 0
    part: int = 0

    @property
    def parts(self) -> int:
        """Notes decode counts for the chunk: one per segment of every group."""
        return sum(len(g) for g in self.groups or ())

    @property
    def posted(self) -> bool:
        """Every group was handed out by :meth:`due`."""
        return self.groups is not None and self.next >= len(self.groups)

    def due(self, ready: int) -> Iterator[tuple[list[Segment], int, tuple[int, int]]]:
        """The groups whose layers are all computed (layers below ``ready``) and not handed
        out yet, in order (each staged first, by :attr:`fill`), each with the part number of
        its first segment and its layers ``[a, b)``."""
        groups = self.groups or []
        while self.next < len(groups) and self.edges[self.next + 1] <= ready:
            g = self.next
            self.next += 1
            if self.fill is not None:
                self.fill(g)
            segs = groups[g]
            first, self.part = self.part, self.part + len(segs)
            yield segs, first, (int(self.edges[g]), int(self.edges[g + 1]))
