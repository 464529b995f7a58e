"""What a prefill worker's :class:`~kvwire.session.prefill.pipeline.Pipeline` keeps per transfer
in flight (:class:`Posted`), and the wake-up it hands a backend that announces a write's end
(:class:`Waker`).

A backend that pushes events (``TransferBackend.pushes_events``: ``cudaipc``, ``tcp``) calls a
write's ``wake`` once the write is terminal. The worker used to poll every write in flight at
each wake-up, so one completion cost a poll of all of them (16 at C=8 over TP 1 -> 2: on the GPU
hosts the largest item of a ``cudaipc`` worker's own code after the launch, py-spy in session
22). With a :class:`Waker` per write the worker polls a pushing write only once its wake-up
fired, and every write at the sweeps that enforce the deadlines
(:meth:`~kvwire.session.prefill.pipeline.Pipeline.progress`).

Everything here belongs to one worker thread, except :meth:`Waker.__call__`, which a backend's
thread calls (it sets a flag and the worker's event; no lock).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvwire.backend import TransferHandle
from kvwire.control.wire import ChunkNote
from kvwire.session.prefill.posting import PlanRef
from kvwire.session.prefill.rooms import SendRoom
from kvwire.staging.base import LocalCopy


class Waker:
    """A write's ``wake``: remembers that the backend announced the write's end and wakes
    the worker (its pipeline's event)."""

    __slots__ = ("_event", "fired")

    def __init__(self, event: threading.Event) -> None:
        self._event = event
        #: The backend called it: the write is terminal (polled at the next progress).
        self.fired = False

    def __call__(self) -> None:
        """Backend thread (or the submitting one), once the write is terminal."""
        self.fired = True
        self._event.set()


@dataclass(eq=False)
class Posted:
    """One transfer (or one segment of a chunk) in flight."""

    handle: TransferHandle
    key: tuple[int, str]
    room: SendRoom
    ref: PlanRef | None
    t_start: float
    t_posted: float
    t_enqueued: float | None
    deadline: float
    what: str
    #: A copy the strategy runs itself; decode hears of it through ``note`` on the control
    #: channel once it is done (backend transfers carry their note themselves).
    copy: LocalCopy | None = None
    note: ChunkNote | None = None
    endpoint: str = ""
    #: The request was failed for this copy's deadline; it is still polled to the end, because
    #: decode may reuse the pages only when nothing writes them any more.
    overdue: bool = False
    #: Accounted as a transfer once done (not a chunk's sums part, which moves no bytes).
    counted: bool = True
    #: The write's wake-up, when its backend announces its end (``handle.pushes``): it is
    #: polled once that fired, else only at the deadline sweeps.
    waker: Waker | None = None

    def due(self, sweep: bool) -> bool:
        """Whether the worker polls this transfer now (``sweep``: a deadline sweep). A write
        a backend list moved to a member that does not announce ends (``handle.pushes``
        cleared by its failover) is polled every time again."""
        return sweep or self.waker is None or self.waker.fired or not self.handle.pushes
