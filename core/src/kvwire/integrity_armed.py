"""Decode's checksum checks armed before the KV lands (issue 26 item 1).

A check launched when a chunk's note arrives costs decode's progress thread a launch (0.24 ms
of host time in a rank process on an H200, where the GPU sums 16 MiB in 0.03 ms) between the
note and ``Success``. An armed check is enqueued ahead, while the request's KV is still on
its way: on a stream of its own, a ``cuStreamWaitValue32`` on a flag in pinned host memory,
then the page-sums kernel over every destination page of the request, then an event. When
the note of a chunk that covers exactly those pages arrives, one store to the flag releases
it (the device starts the sums at once, no launch), and the check waits for the event. A
chunk of other pages drops it (released unused, its result never read) and is checked as
before; so does a room that ends without such a chunk.

Why a stream memory wait: it holds a stream without a kernel on the GPU (no SM is busy while
it waits) and is released by a plain store from the host; ``cuda-bindings`` (NVIDIA's driver
binding, a dependency of CUDA builds of torch) exposes it. Without it (or on Triton's
interpreter) nothing is armed and every check is launched at its note.

A pool per hasher (:class:`ArmedPool`): up to :data:`SLOTS` armed checks at once, each with its
own stream, flag, page slot (:class:`~kvwire.integrity_lanes.PageSlot`) and event; a slot
is reused once its check was read or, dropped, once its event completed. A stream held by a
flag nobody releases would hold only that slot's later checks: every armed check is released
by its use, its drop (the room's end, the manager's close) or :meth:`ArmedPool.close`.

Imported only where the hasher runs on a GPU (torch installed).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from kvwire.descriptors import IndexArray
from kvwire.integrity import LayerSums
from kvwire.integrity_lanes import PageSlot
from kvwire.page_form import PageSide

logger = logging.getLogger(__name__)

__all__ = ["SLOTS", "ArmedCheck", "ArmedPool"]

#: Checks armed at once per hasher (a link): more requests in flight are checked at their
#: notes.
SLOTS = 16


class ArmedCheck:
    """One armed check (see the module docstring). ``release``/``drop`` from any thread;
    calling it (the check's thread) waits for the sums once."""

    def __init__(self, pool: ArmedPool, index: int, pages: NDArray[np.int64]) -> None:
        self.pages = pages
        self._pool, self._index = pool, index
        self._lock = threading.Lock()
        self._released = self._used = False

    def release(self) -> None:
        with self._lock:
            if not self._released:
                self._released = True
                self._pool.release(self._index)

    def drop(self) -> None:
        with self._lock:
            if not self._released:
                self._released = True
                self._pool.release(self._index)
            if not self._used:
                self._used = True
                self._pool.dropped(self._index)

    def __call__(self) -> LayerSums:
        self.release()
        with self._lock:
            if self._used:
                raise RuntimeError("an armed check was read twice, or read after its drop")
            self._used = True
        return self._pool.result(self._index)


class ArmedPool:
    """A hasher's armed checks: streams, flags, page slots and events by slot (see the module
    docstring). ``launch(slot, stream, side, pages)`` enqueues the page-sums kernel of
    ``pages`` on ``stream`` with ``slot``'s buffers (the hasher's), ``finish`` turns a result
    into per-layer sums. Lock contract: the pool's lock guards the slot table, never held
    while the host waits for the device."""

    def __init__(
        self,
        device: torch.device,
        out_elems: int,
        launch: Callable[[PageSlot, Any, PageSide, NDArray[np.int64]], bool],
        finish: Callable[[NDArray[np.int64]], LayerSums],
    ) -> None:
        from cuda.bindings import driver  # ImportError: the hasher arms nothing

        self._driver = driver
        self._geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self.device, self._out_elems = device, out_elems
        self._index = device.index if device.index is not None else 0
        self._launch, self._finish = launch, finish
        self._lock = threading.Lock()
        self._flags = torch.zeros(SLOTS, dtype=torch.int32, pin_memory=True)
        self._flag = self._flags.numpy()
        with torch.cuda.device(self._index):  # the driver call needs the device's context
            err, ptr = driver.cuMemHostGetDevicePointer(self._flags.data_ptr(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer: {getattr(err, 'name', err)}")
        self._dptr = int(ptr)
        self._epoch = [0] * SLOTS
        self._slots: list[tuple[Any, PageSlot, Any] | None] = [None] * SLOTS
        #: Per slot: "free", "armed" (released or not, its result not read), "dropped".
        self._state = ["free"] * SLOTS
        self._closed = False

    def arm(self, side: PageSide, pages: IndexArray) -> ArmedCheck | None:
        """Decode's progress thread: the sums of ``pages`` on ``side`` armed, or None (no
        free slot, no page, the pool closed, or the driver refused the wait: logged)."""
        rp = np.ascontiguousarray(pages, dtype=np.int64)
        with self._lock:
            if self._closed or not rp.size:
                return None
            i = self._free_slot()
            if i is None:
                return None
            self._state[i] = "armed"
            self._epoch[i] += 1
            epoch = self._epoch[i]
        try:
            stream, slot, event = self._slot(i)
            here = torch.cuda.current_device() == self._index
            with contextlib.nullcontext() if here else torch.cuda.device(self._index):
                wait = self._driver.cuStreamWaitValue32(
                    self._driver.CUstream(stream.cuda_stream), self._dptr + 4 * i, epoch, self._geq
                )
                if int(wait[0]) != 0:
                    raise RuntimeError(f"cuStreamWaitValue32: {getattr(wait[0], 'name', wait[0])}")
                if not self._launch(slot, stream, side, rp):
                    self._flag[i] = epoch  # nothing enqueued behind the wait: let it pass
                    with self._lock:
                        self._state[i] = "dropped"
                    return None
                event.record(stream)
        except Exception as exc:  # a device that cannot wait: check at the notes
            logger.warning("checksums: cannot arm a check on %s (%s)", self.device, exc)
            self._flag[i] = epoch
            with self._lock:
                self._closed = True
                self._state[i] = "dropped"
            return None
        return ArmedCheck(self, i, rp)

    def _free_slot(self) -> int | None:
        """Under the lock: a free slot, reclaiming dropped ones whose sums ran."""
        for i, st in enumerate(self._state):
            if st == "free":
                return i
        for i, st in enumerate(self._state):
            made = self._slots[i]
            if st == "dropped" and (made is None or made[2].query()):
                return i
        return None

    def _slot(self, i: int) -> tuple[Any, PageSlot, Any]:
        made = self._slots[i]
        if made is None:
            stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            made = (stream, PageSlot(self.device, True, self._out_elems), torch.cuda.Event())  # type: ignore[no-untyped-call]
            self._slots[i] = made
        return made

    def release(self, i: int) -> None:
        """Let slot ``i``'s sums run (one store the device's wait sees). Any thread."""
        self._flag[i] = self._epoch[i]

    def dropped(self, i: int) -> None:
        """Slot ``i``'s result will not be read: reusable once its sums ran. Any thread."""
        with self._lock:
            self._state[i] = "dropped"

    def result(self, i: int) -> LayerSums:
        """Slot ``i``'s sums, waited for (released already); the slot is free after."""
        made = self._slots[i]
        assert made is not None
        made[2].synchronize()
        got = made[1].result.numpy().copy()
        with self._lock:
            self._state[i] = "free"
        return self._finish(got)

    def armed(self) -> int:
        """Checks armed and not yet read or dropped (leak checks). Any thread."""
        with self._lock:
            return sum(st == "armed" for st in self._state)

    def close(self) -> None:
        """Release every flag (no stream stays held) and arm nothing more."""
        with self._lock:
            self._closed = True
            for i in range(SLOTS):
                self._flag[i] = self._epoch[i]
