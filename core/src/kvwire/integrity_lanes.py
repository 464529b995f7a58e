"""The per-thread state of :class:`~kvwire.integrity_device.DeviceRowHasher`: a calling
thread's lane (its stream and buffers, :class:`Lane`) and a lane's page sums not waited for
yet (:class:`LaterSums`, :meth:`DeviceRowHasher.page_sums_later
<kvwire.integrity_device.DeviceRowHasher.page_sums_later>`).

Imported only where the hasher runs (torch installed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from kvwire import cuda_events
from kvwire.integrity import LayerSums

#: Rows a call's buffers hold at first (they grow to the largest call).
MIN_ROWS = 4096
#: Page launches a lane keeps buffers for, used in turn: a later result (prefill's sums,
#: taken when the chunk's note is made) holds its slot until taken, and the lane's calls go
#: on in the others (py-spy, 2 x H200, C=8: with one slot the worker waited for the previous
#: chunk's sums in 5.5% of its time).
PAGE_SLOTS = 4


def layer_range(layers: Sequence[int] | None, num_layers: int) -> tuple[int, int]:
    """Layers ``[lo, hi)`` a call selects on the device: all (``layers`` None) or a
    ``range`` of step 1; (-1, -1) for any other sequence (selected on the host)."""
    if layers is None:
        return 0, num_layers
    if isinstance(layers, range) and layers.step == 1:
        return max(layers.start, 0), min(max(layers.stop, 0), num_layers)
    return -1, -1


class LaterSums:
    """A page launch's sums not waited for yet (:meth:`DeviceRowHasher.page_sums_later`):
    ``settle`` waits for the launch's event and keeps a copy of the result, once, on
    whichever thread comes first (the caller of the result, or the lane's own thread before
    it reuses the launch's :class:`PageSlot`)."""

    def __init__(
        self, slot: PageSlot, event: Any, finish: Callable[[NDArray[np.int64]], LayerSums]
    ) -> None:
        self._slot: PageSlot | None = slot
        self._event = event
        self._finish = finish
        self._lock = threading.Lock()
        self._got: NDArray[np.int64] | None = None

    def settle(self) -> NDArray[np.int64]:
        with self._lock:
            if self._got is None:
                slot, self._slot = self._slot, None
                assert slot is not None
                if self._event is not None:  # None: Triton's interpreter, already computed
                    self._event.synchronize()
                self._got = slot.result.numpy().copy()
            return self._got

    def __call__(self) -> LayerSums:
        return self._finish(self.settle())


class PageSlot:
    """One page launch's buffers on a lane: its two page lists (pinned: the kernel reads them
    over the bus), the kernel's own sums (device; zero between launches, its last program
    zeroes them), where that program leaves the result (pinned), the event a later result
    waits for, and that result while nobody took it. Used by its lane's thread, and by the
    taker of its result (through :class:`LaterSums`' lock)."""

    def __init__(self, device: Any, cuda: bool, out_elems: int) -> None:
        self.device, self.cuda = device, cuda
        self.cap = 0
        self.call: Any = None
        self.grow(64)
        self.out = torch.zeros(out_elems + 1, dtype=torch.int64, device=device)
        self.result = torch.zeros(out_elems, dtype=torch.int64, pin_memory=cuda)
        self.event: Any = None
        self.pending: LaterSums | None = None

    def grow(self, pages: int) -> None:
        """Page lists for ``pages`` pages (two lists)."""
        if pages > self.cap:
            self.cap = max(pages, 2 * self.cap)
            self.call = torch.empty(2 * self.cap, dtype=torch.int64, pin_memory=self.cuda)

    def settle(self) -> None:
        """Before this slot is reused: wait for its result if nobody took it yet."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.settle()


class Lane:
    """One calling thread's stream and buffers (a hasher keeps one per thread that calls it,
    in a ``threading.local``): the call's rows or page lists (pinned on a GPU, and their
    device copy), and the per-layer sums and counts (device and pinned host). Used by its
    thread only, so no lock; grown to the largest call."""

    def __init__(self, device: Any, out_elems: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.rows_cap = 0
        self.call_host: Any = None
        self.call_dev: Any = None
        self.grow(MIN_ROWS)
        self.out_dev = torch.zeros(out_elems, dtype=torch.int64, device=device)
        self.out_host = torch.empty(out_elems, dtype=torch.int64, pin_memory=self.cuda)
        #: The page kernel's buffers, one set per launch in flight (:data:`PAGE_SLOTS`).
        self.page_slots = [PageSlot(device, self.cuda, out_elems) for _ in range(PAGE_SLOTS)]
        self._next_slot = 0
        if self.cuda:  # zeroed on the current stream, read on this lane's: wait for it
            torch.cuda.current_stream(device).synchronize()

    def grow(self, rows: int) -> None:
        """Call buffers for ``rows`` rows of 5 columns."""
        if rows <= self.rows_cap:
            return
        self.rows_cap = max(rows, 2 * self.rows_cap)
        self.call_host = torch.empty(5 * self.rows_cap, dtype=torch.int64, pin_memory=self.cuda)
        self.call_dev = (
            torch.empty(5 * self.rows_cap, dtype=torch.int64, device=self.device)
            if self.cuda
            else self.call_host
        )

    def page_slot(self, pages: int) -> PageSlot:
        """The next page launch's buffers, for ``pages`` pages: the slots in turn, each
        waited for first if its last result was not taken yet."""
        slot = self.page_slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self.page_slots)
        slot.settle()
        slot.grow(pages)
        return slot

    def later(
        self,
        slot: PageSlot,
        finish: Callable[[NDArray[np.int64]], LayerSums],
        stream: Any = None,
    ) -> LaterSums:
        """The page kernel just enqueued with ``slot``'s buffers (on this lane's stream, or
        on ``stream``: a page mover's launch that sums what it copies), as a result waited
        for later: the slot's event recorded after it (none in Triton's interpreter, where
        the kernel already ran)."""
        stream = stream if stream is not None else self.stream
        event = None
        if stream is not None:
            if slot.event is None:
                slot.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            cuda_events.record(slot.event, stream)
            event = slot.event
        slot.pending = LaterSums(slot, event, finish)
        return slot.pending

    def page_wait(self, slot: PageSlot) -> NDArray[np.int64]:
        """The result of the page kernel just enqueued with ``slot``, once it ended (one
        wait on this lane's stream, no copy)."""
        if self.stream is not None:
            self.stream.synchronize()
        out: NDArray[np.int64] = slot.result.numpy().copy()
        return out

    def wait(self) -> NDArray[np.int64]:
        """The per-layer sums, row counts and rows outside of the launch just enqueued on
        this lane, waited for (this lane's stream only)."""
        if self.stream is None:
            return self.out_dev.numpy().copy()
        with torch.cuda.stream(self.stream):
            self.out_host.copy_(self.out_dev, non_blocking=True)
        self.stream.synchronize()
        out: NDArray[np.int64] = self.out_host.numpy().copy()
        return out
