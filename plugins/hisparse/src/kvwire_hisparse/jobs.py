"""What a row copy hands back: :class:`CopyJob`, one :meth:`~kvwire_hisparse.copier.RowCopier.start`
call's rows on their way (built by the copier on a transfer worker's thread, polled by the
transfer pipeline on that thread, waited for by the staging strategy)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvwire.errors import TransferError

__all__ = ["CopyJob"]


class CopyJob:
    """One :meth:`RowCopier.start` call: rows of one source memory kind on their way.

    The transfer pipeline polls :meth:`done` (a :class:`~kvwire.staging.base.LocalCopy`);
    the strategy calls :meth:`wait` when it must be sure nothing writes any more.
    """

    def __init__(
        self,
        nbytes: int,
        num_rows: int,
        events: Sequence[Any] = (),
        keep: Sequence[Any] = (),
        label: str = "",
    ) -> None:
        self.nbytes = nbytes
        self.num_rows = num_rows
        self._events = list(events)
        self._keep: list[Any] = list(keep)
        self._label = label
        self._done = not self._events

    def done(self) -> bool:
        """Non-blocking: True once every byte is in the pool and visible to the decode process.

        CUDA semantics: when an event recorded after the copies completes, every write of the
        preceding work on the stream, including kernel stores into mapped (registered) host
        memory, is complete and visible to host threads that observe the completion
        (``cudaEventQuery``/``cudaEventSynchronize`` are synchronising operations); no extra
        system-scope fence is needed. The decode process reads the same physical pages through
        its own mapping (coherent on the host) after a control-channel message that this
        thread sends only after seeing True here, so its reads are ordered after the writes.
        Raises :class:`~kvwire.errors.TransferError` when the copy failed.
        """
        if self._done:
            return True
        try:
            if not all(ev.query() for ev in self._events):
                return False
            for ev in self._events:  # complete already: returns at once
                ev.synchronize()
        except Exception as exc:
            raise TransferError(f"{self._label} copy failed on the GPU: {exc}") from exc
        self._done = True
        self._events.clear()
        self._keep.clear()
        return True

    def wait(self, timeout_s: float) -> None:
        """Block until :meth:`done`; :class:`~kvwire.errors.TransferError` after
        ``timeout_s`` seconds or on failure."""
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while not self.done():
            if time.monotonic() > deadline:
                raise TransferError(
                    f"{self._label} copy of {self.nbytes} bytes not done within {timeout_s} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
