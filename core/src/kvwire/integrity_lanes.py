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

from kvwire.integrity import LayerSums

#: Rows a call's buffers hold at first (they grow to the largest call).
MIN_ROWS = 4096


def layer_range(layers: Sequence[int] | None, num_layers: int) -> tuple[int, int]:
    """Layers ``[lo, hi)`` a call selects on the device: all (``layers`` None) or a
    ``range`` of step 1; (-1, -1) for any other sequence (selected on the host)."""
    if layers is None:
        return 0, num_layers
    if isinstance(layers, range) and layers.step == 1:
        return max(layers.start, 0), min(max(layers.stop, 0), num_layers)
    return -1, -1


class LaterSums:
    """A lane's page sums not waited for yet (:meth:`DeviceRowHasher.page_sums_later`):
    ``settle`` waits for the launch's event and keeps a copy of the result, once, on
    whichever thread comes first (the caller of the result, or the lane's own thread before
    its next call reuses the buffers)."""

    def __init__(self, lane: Lane, event: Any, finish: Callable[[NDArray[np.int64]], LayerSums]):
        self._lane: Lane | None = lane
        self._event = event
        self._finish = finish
        self._lock = threading.Lock()
        self._got: NDArray[np.int64] | None = None

    def settle(self) -> NDArray[np.int64]:
        with self._lock:
            if self._got is None:
                lane, self._lane = self._lane, None
                assert lane is not None
                self._event.synchronize()
                self._got = lane.page_result.numpy().copy()
            return self._got

    def __call__(self) -> LayerSums:
        return self._finish(self.settle())


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
        #: The page kernel's own sums (zero between launches: its last program zeroes
        #: them) and where that program leaves the result (pinned: the host reads it after
        #: the wait, with no download).
        self.page_out = torch.zeros(out_elems + 1, dtype=torch.int64, device=device)
        self.page_result = torch.zeros(out_elems, dtype=torch.int64, pin_memory=self.cuda)
        #: The page sums of this lane's last launch while nobody waited for them yet, and
        #: the event its launches record (one at a time: the next call settles it first).
        self.pending: LaterSums | None = None
        self._event: Any = None
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

    def settle(self) -> None:
        """Before this lane's buffers are reused: wait for its result still pending."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.settle()

    def later(self, finish: Callable[[NDArray[np.int64]], LayerSums]) -> LaterSums:
        """The page kernel just enqueued on this lane, as a result waited for later: an
        event recorded after it (this lane's one event, free again once settled)."""
        assert self.stream is not None
        if self._event is None:
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(self.stream)
        self.pending = LaterSums(self, self._event, finish)
        return self.pending

    def page_wait(self) -> NDArray[np.int64]:
        """The page kernel's result, once the launch just enqueued on this lane ended (one
        wait on this lane's stream, no copy)."""
        if self.stream is not None:
            self.stream.synchronize()
        out: NDArray[np.int64] = self.page_result.numpy().copy()
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
