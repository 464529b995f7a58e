"""The ``cudaipc`` backend's kernel watcher: the thread that learns when a mover launch ended.

The backend :attr:`~kvwire.backend.TransferBackend.pushes_events`, so kvwire's workers sleep
until a transfer's ``wake`` is called; a GPU kernel's end is learnt nowhere else. Owned by one
:class:`~kvwire_cudaipc.backend.CudaIpcBackend` (started at its first launch, stopped at its
close); the backend's launch path is its only producer.

The watcher also keeps the launches' events for reuse (:meth:`KernelWatcher.record`): a
fresh ``torch.cuda.Event`` creates its CUDA event at its first record and destroys it when
dropped, and on the GPU hosts that made recording the launch's event the largest single
cost of a ``cudaipc`` worker's turn (py-spy, session 22: 15% of its wall time). An event
goes back to the free list once the watcher has passed every transfer that waits for it,
and a transfer the watcher passed is marked ``ended`` first, so nobody reads a reused
event as the transfer's own (the launches share one stream: an event recorded later
completes later, so even a stale read can only see "not yet").
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from kvwire import cuda_events

logger = logging.getLogger(__name__)


class _Waitable(Protocol):
    #: The CUDA event recorded after the launch (``synchronize`` blocks until it completed).
    event: Any
    #: Set by the watcher once the launch ended and ``done`` ran: the event may be reused
    #: from then on, so a poll must not read it as this transfer's any more.
    ended: bool


X = TypeVar("X", bound=_Waitable)
#: What runs when a launch ended: ``done(launch, error)`` (error None: it completed).
Done = Callable[[X, str | None], None]


class KernelWatcher(Generic[X]):
    """A thread that waits for each launch's event, in launch order (one stream: they
    complete in that order), and hands the transfer to ``done(transfer, error)``. Waiting
    blocks in the driver (the backend records events with ``blocking=True``: no spinning
    core) without the GIL; ``done`` runs on this thread."""

    def __init__(self, name: str, done: Done[X], make_event: Callable[[], Any]) -> None:
        self._q: queue.SimpleQueue[tuple[X, bool, Done[X] | None] | None] = queue.SimpleQueue()
        self._done = done
        self._make_event = make_event
        #: Events whose transfers the watcher has passed (appended by the watcher thread,
        #: popped by launching threads: a deque's append and pop are atomic).
        self._free: deque[Any] = deque()
        self._thread = threading.Thread(target=self._run, name=f"{name}-kernels", daemon=True)
        self._thread.start()

    def record(self, stream: Any) -> Any:
        """Launch path, right after enqueueing a launch on ``stream`` (under the launch's
        peer locks): an event recorded there, reused when one is free (``make_event``
        otherwise)."""
        try:
            ev = self._free.pop()
        except IndexError:  # none free (or another launching thread took the last one)
            ev = self._make_event()
        cuda_events.record(ev, stream)  # the GIL kept: no hand-off mid-launch
        return ev

    def watch(self, x: X, last: bool = True, done: Done[X] | None = None) -> None:
        """Launch path, right after recording ``x.event`` (in launch order): wait for it.
        ``last``: no later transfer waits for the same event (a batch's transfers share
        one; only its last one frees it). ``done``: called instead of the watcher's own
        (a lane's launch, :mod:`kvwire_cudaipc.lane`)."""
        self._q.put((x, last, done))

    def stop(self, timeout: float = 10.0) -> None:
        """Close: finish the launches already watched, then end the thread."""
        self._q.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            x, last, done = item
            error = None
            try:
                x.event.synchronize()
            except Exception as exc:  # a failed kernel (sticky CUDA error): fail the transfer
                error = f"cudaipc: waiting for the mover kernel failed: {exc}"
            try:
                (done or self._done)(x, error)
            except Exception:
                logger.exception("cudaipc: kernel completion handling failed")
            x.ended = True
            if last and error is None:  # a failed event is dropped, never reused
                self._free.append(x.event)
