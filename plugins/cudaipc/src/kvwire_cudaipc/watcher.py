"""The ``cudaipc`` backend's kernel watcher: the thread that learns when a mover launch ended.

The backend :attr:`~kvwire.backend.TransferBackend.pushes_events`, so kvwire's workers sleep
until a transfer's ``wake`` is called; a GPU kernel's end is learnt nowhere else. Owned by one
:class:`~kvwire_cudaipc.backend.CudaIpcBackend` (started at its first launch, stopped at its
close); the backend's launch path is its only producer.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

logger = logging.getLogger(__name__)


class _Waitable(Protocol):
    #: The CUDA event recorded after the launch (``synchronize`` blocks until it completed).
    event: Any


X = TypeVar("X", bound=_Waitable)


class KernelWatcher(Generic[X]):
    """A thread that waits for each launch's event, in launch order (one stream: they
    complete in that order), and hands the transfer to ``done(transfer, error)``. Waiting
    blocks in the driver (the backend records events with ``blocking=True``: no spinning
    core) without the GIL; ``done`` runs on this thread."""

    def __init__(self, name: str, done: Callable[[X, str | None], None]) -> None:
        self._q: queue.SimpleQueue[X | None] = queue.SimpleQueue()
        self._done = done
        self._thread = threading.Thread(target=self._run, name=f"{name}-kernels", daemon=True)
        self._thread.start()

    def watch(self, x: X) -> None:
        """Launch path, right after recording ``x.event`` (in launch order): wait for it."""
        self._q.put(x)

    def stop(self, timeout: float = 10.0) -> None:
        """Close: finish the launches already watched, then end the thread."""
        self._q.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (x := self._q.get()) is not None:
            error = None
            try:
                x.event.synchronize()
            except Exception as exc:  # a failed kernel (sticky CUDA error): fail the transfer
                error = f"cudaipc: waiting for the mover kernel failed: {exc}"
            try:
                self._done(x, error)
            except Exception:
                logger.exception("cudaipc: kernel completion handling failed")
