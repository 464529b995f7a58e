"""Which engine of the writing GPU moves a run list: its copy engines or its SMs.

A run list of many small pieces (a chunk's rows over scattered pages: a page per layer and
K/V, 32 KiB here) is one launch of kvwire's fused SM mover
(:class:`kvwire.movers.triton_copy.RunCopier`): a copy engine pays ~2-7 µs per copy, so
thousands of them would be the per-descriptor cost issue 27 set out to leave behind. A run
list of a **few large runs**, once runs that continue each other are merged (bulk staging's
blocks of several MiB, or a layer group of contiguous pages: one run per layer and K/V), is
better moved by the copy engines, one ``cudaMemcpyAsync`` per run on the backend's private
stream: the bytes cross NVLink at the same speed, and no SM is taken from the kernels the
engine runs beside them. A layer-wise prefill's transfers then overlap its forward pass
instead of competing with it for SMs: traced on two H100s (docs/benchmarks.md), the SM
mover's layer groups stretched the pass by their own time (time to decode-ready 1.42x the
pass alone at 16k tokens, against 1.10x for NIXL, whose UCX copies use the copy engines).

:func:`takes_copy_engine` is the rule (the backend's options set its two bounds);
:func:`copy_runs` enqueues. Both are called by the backend's submitting thread under the
peer's lock (:meth:`kvwire_cudaipc.backend.CudaIpcBackend._launch`); they never wait for the
GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import TransferError


def takes_copy_engine(lens: NDArray[np.int64], min_bytes: int, max_runs: int) -> bool:
    """Whether the runs of lengths ``lens`` go to the copy engines: there are at most
    ``max_runs`` of them and each has at least ``min_bytes`` (``min_bytes`` 0: never)."""
    return bool(min_bytes > 0 and 0 < lens.size <= max_runs and int(lens.min()) >= min_bytes)


def copy_runs(
    src: NDArray[np.int64], dst: NDArray[np.int64], lens: NDArray[np.int64], stream: int
) -> None:
    """Enqueue one device-to-device ``cudaMemcpyAsync`` per run ``(src, dst, lens)`` on the
    CUDA stream whose handle is ``stream`` (``dst`` in this process's mapping of the peer's
    memory: peer access is enabled, so the copy engines write over NVLink). A loop over at
    most the rule's ``max_runs`` runs of several MiB each, not over descriptors. Raises
    :class:`~kvwire.errors.TransferError` naming the run and the driver's error when a copy
    cannot be enqueued."""
    from cuda.bindings import runtime

    kind = runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    handle = runtime.cudaStream_t(stream)
    for i, (s, d, n) in enumerate(zip(src.tolist(), dst.tolist(), lens.tolist(), strict=True)):
        err, *_ = _as_tuple(runtime.cudaMemcpyAsync(d, s, n, kind, handle))
        if int(err) != 0:
            raise TransferError(
                f"cudaipc: cudaMemcpyAsync of run {i} ({n} bytes) failed: "
                f"{getattr(err, 'name', err)}"
            )


def _as_tuple(result: Any) -> tuple[Any, ...]:
    return result if isinstance(result, tuple) else (result,)
