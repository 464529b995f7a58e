"""Checksums a page writer computes in its own launch: a chunk's page sums ordered by prefill
and either summed by the write's kernel or launched beside it.

Prefill's transfer worker makes a :class:`SumsOrder` for a checksummed chunk in page form
whose sums a GPU hasher computes (:meth:`DeviceRowHasher.sums_order
<kvwire.integrity_device.DeviceRowHasher.sums_order>`) and hands it to the backend with the
chunk's first note (:attr:`LaterNote.sums <kvwire.transfers.LaterNote.sums>`). A backend
that declares :attr:`~kvwire.transfers.BackendCapabilities.summed_writes` (``cudaipc``)
takes it (:meth:`SumsOrder.take`) and launches the chunk's copy and its sums as one kernel
(:class:`FusedSums`: what the page mover's summed kernel reads, in
:mod:`kvwire.movers.triton_pool_pages`); any other backend, or one that cannot fuse this
chunk (head-major pages), starts it as a launch of its own beside the write
(:meth:`SumsOrder.start`, the template does it at submit). Whoever makes the note calls the
order for the sums, once the write ended.

A py-spy profile of a checked chunk on 2 x H200 put the separate sums launch at a third of
prefill's worker time (its page lists, its stream, Triton's launcher, its event); fused, the
copy's table carries the page lists and one launch and one event serve both.

Imported only where the hasher runs (torch installed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.integrity import LayerSums
from kvwire.integrity_lanes import Lane, PageSlot

__all__ = ["FusedSums", "SumsOrder"]


@dataclass(eq=False, slots=True)
class FusedSums:
    """The arguments of one page-sums launch (``hash_pages``' in
    :mod:`kvwire.integrity_kernels`) for a kernel that runs it with its copy: the device's
    pairs (``int64 [3, num_pairs]``: read base, key base, layer) and constants, the slot's
    sums buffer and result (zeroed by the kernel's last program, which leaves the result in
    ``result``), the two page lists and the geometry scalars; ``block``, ``inline_weights``
    and ``mode`` are compile-time. The tensors are held here while the launch may read
    them. Made per chunk by the hasher's calling thread (prefill's worker, decode's checker)
    and never changed after (slots, not frozen: a frozen dataclass sets each of its 19
    fields through ``object.__setattr__``, on the path of every page-sums call)."""

    pairs: Any
    consts: Any
    out: Any
    result: Any
    read_pages: NDArray[np.int64]
    key_pages: NDArray[np.int64]
    num_pairs: int
    tokens: int
    cells: int
    read_slot: int
    read_row: int
    key_slot: int
    key_row: int
    num_layers: int
    lo: int
    hi: int
    block: int
    inline_weights: bool
    mode: int

    @property
    def pages(self) -> int:
        """Pages of the chunk (the copy's page lists must be as many)."""
        return int(self.read_pages.size)

    def scalars(self) -> tuple[int, ...]:
        """The run-time arguments after the copy's, in the summed kernel's order."""
        return (
            self.pairs.data_ptr(),
            self.consts.data_ptr(),
            self.out.data_ptr(),
            self.result.data_ptr(),
            self.num_pairs,
            self.tokens,
            self.cells,
            self.read_slot,
            self.read_row,
            self.key_slot,
            self.key_row,
            self.num_layers,
            self.lo,
            self.hi,
        )


#: What a hasher plans for an order on the calling thread: its lane, the slot taken and the
#: launch's arguments (None: nothing to sum).
Planned = tuple[Lane, PageSlot, FusedSums] | None

_NEW, _TAKEN, _LAUNCHED, _STARTED = range(4)


class SumsOrder:
    """One chunk's page sums, ordered by prefill's transfer worker (see the module
    docstring). ``plan`` reserves a slot on the calling thread's lane and gives the launch's
    arguments; ``start`` launches the sums on their own (the hasher's
    ``page_sums_later``); ``finish`` turns a result into per-layer sums.

    States: new, taken by a writer (between :meth:`take` and :meth:`launched` or
    :meth:`abandon`, on the submitting thread), launched with the write, or started on its
    own. Thread contract: every method under the order's lock; calling it (the note's maker,
    any thread) waits for the device outside the lock (:class:`LaterSums
    <kvwire.integrity_lanes.LaterSums>` waits once)."""

    def __init__(
        self,
        pages: int,
        device: Any,
        plan: Callable[[], Planned],
        start: Callable[[], Callable[[], LayerSums]],
        finish: Callable[[NDArray[np.int64]], LayerSums],
    ) -> None:
        #: Pages of the chunk; the device the sums run on.
        self.pages, self.device = pages, device
        self._plan, self._start, self._finish = plan, start, finish
        self._lock = threading.Lock()
        self._state = _NEW
        self._taken: tuple[Lane, PageSlot] | None = None
        self._result: Callable[[], LayerSums] | None = None

    def take(self) -> FusedSums | None:
        """A writer that sums in its own launch, on its submitting thread, before it
        enqueues the chunk's copy: the launch's arguments (a slot of this thread's lane
        reserved), or None if the order was taken or started already or has nothing to
        sum. The writer calls :meth:`launched` after enqueueing, or :meth:`abandon`."""
        with self._lock:
            if self._state != _NEW:
                return None
            planned = self._plan()
            if planned is None:
                return None
            lane, slot, args = planned
            self._taken, self._state = (lane, slot), _TAKEN
            return args

    def launched(self, stream: Any) -> None:
        """The writer enqueued its summed launch on ``stream`` (None: Triton's interpreter,
        already run): the sums are read once an event recorded after it ends."""
        with self._lock:
            assert self._state == _TAKEN and self._taken is not None
            lane, slot = self._taken
            self._result = lane.later(slot, self._finish, stream)
            self._taken, self._state = None, _LAUNCHED

    def abandon(self) -> None:
        """The writer took the order but launched nothing (a refused or failed launch): the
        order is new again (its slot unused), for a fallback to start."""
        with self._lock:
            if self._state == _TAKEN:
                self._taken, self._state = None, _NEW

    def start(self) -> None:
        """Sum beside the write, in a launch of the sums' own (the submitting thread of a
        backend that does not sum in its write, before it posts); nothing if the order was
        launched or started already."""
        with self._lock:
            if self._state == _NEW:
                self._result, self._state = self._start(), _STARTED

    def __call__(self) -> LayerSums:
        """The chunk's per-layer sums, waited for (the note's maker, once the write ended;
        started now if nobody did). Raises if the device failed, or if a writer took the
        order and neither launched nor abandoned it (a bug)."""
        self.start()
        with self._lock:
            if self._state == _TAKEN:
                raise RuntimeError("the chunk's sums were taken by a write never launched")
            result = self._result
        assert result is not None
        return result()
