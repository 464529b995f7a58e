"""Recording a CUDA event without letting go of the GIL.

torch's ``Event.record`` releases the GIL around its CUDA call, which takes a few
microseconds. In a busy rank process another thread takes the GIL in that gap,
and the caller then waits until that thread lets go of it again: on the GPU hosts py-spy put
``Event.record`` at 14-17% of a ``cudaipc`` transfer worker's wall time at C=8, far above
what the call itself costs (docs/benchmarks.md, "Session 27"). A transfer worker's turn
records two events per launch (the mover's table slot and the launch's completion), so each
of those handed the GIL to whichever thread was waiting.

Here the same driver call (``cuEventRecord``) goes through :func:`kvwire.cuda_driver.held`
(``libcuda`` loaded with ``ctypes.PyDLL``, whose calls keep the GIL): nothing else runs
during those microseconds, and the caller goes on at once. torch's ``query`` keeps the GIL
already (2.1 µs a call beside a busy thread on an H100 host, the busy thread never ran);
``synchronize`` (a wait) stays torch's, which lets go of the GIL while it waits, as it
should.

Contract: the caller's current CUDA device is the event's (the driver call acts in the
current context). Where it is not, where the event has not been created yet (torch creates
it at its first record), or where ``libcuda`` cannot be loaded, torch's own call is made.
Any thread.
"""

from __future__ import annotations

from typing import Any

from kvwire import cuda_driver


def _held_handle(event: Any) -> int:
    """``event``'s CUDA handle when the raw call applies (0: use torch's call)."""
    handle = int(getattr(event, "cuda_event", 0) or 0)
    if not handle or cuda_driver.held() is None:
        return 0
    import torch

    if torch.cuda.current_device() != event.device.index:
        return 0
    return handle


def record(event: Any, stream: Any) -> None:
    """Record torch CUDA ``event`` on torch CUDA ``stream`` (the same device's), keeping the
    GIL when it can (see the module docstring). Raises RuntimeError on a CUDA error."""
    handle = _held_handle(event)
    if not handle:
        event.record(stream)
        return
    rc = cuda_driver.held().cuEventRecord(handle, stream.cuda_stream)
    if rc != cuda_driver.SUCCESS:
        raise RuntimeError(f"cuEventRecord failed: CUDA driver error {rc}")


__all__ = ["record"]
