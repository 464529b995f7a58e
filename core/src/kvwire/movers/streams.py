"""Waiting for a CUDA stream without handing the GIL away.

``stream.synchronize()`` releases the GIL while it blocks; in a rank process whose other
threads run Python (transfer workers, the progress and liveness threads), getting it back after
a wait of tens of microseconds can take far longer than the wait (the interpreter hands the
GIL over at its switch interval). A chunk's gather, scatter or checksum waits for a few tens of
microseconds of GPU work, so :func:`wait` polls an event recorded on the stream, holding the
GIL, for at most ``spin_s``, and blocks only past that. Imported only where torch sees a GPU.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["wait"]

#: Seconds :func:`wait` polls before it blocks.
SPIN_S = 0.002


def wait(stream: Any, spin_s: float = SPIN_S) -> None:
    """Return once the work enqueued on ``stream`` so far has completed (any thread)."""
    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ev.record(stream)
    end = time.perf_counter() + spin_s
    while not ev.query():  # type: ignore[no-untyped-call]
        if time.perf_counter() > end:
            ev.synchronize()
            return
