"""Row views of raw memory for the row copier's NumPy and torch paths: a source span or a
destination pool as a 2-D array of rows (NumPy, torch CPU, or a CUDA alias of pinned memory),
cached per (span or pool, residue, row length, element width). Owned by
:class:`~kvwire_hisparse.copier.RowCopier` (built at its construction, CUDA set at its CUDA
setup, cleared at its close); any transfer worker thread asks for views under the cache's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwire.errors import ConfigError
from kvwire.layout import MemKind
from kvwire_hisparse.pointers import CudaPtr, HostPtr
from kvwire_hisparse.rows import Span
from kvwire_hisparse.shm import SharedHostPool

__all__ = ["TYPESTR", "Views"]

#: Element type used to move rows, by width in bytes (the widest that divides the row length
#: and both base addresses is used).
TYPESTR = {8: "<i8", 4: "<i4", 2: "<i2", 1: "|u1"}


class Views:
    """Cached row views of the copier's source spans and destination pools."""

    def __init__(self, spans: Sequence[Span], pools: Sequence[SharedHostPool]) -> None:
        self._spans = list(spans)
        self._pools = list(pools)
        self._lock = threading.Lock()
        self._cache: dict[tuple[Any, ...], tuple[Any, int]] = {}
        self._torch: Any = None
        self._device: int | None = None
        #: per pool: the address the GPU writes it at (CUDA only)
        self.pool_devptr: list[int] = []

    def set_cuda(self, torch: Any, device: int, pool_devptr: Sequence[int]) -> None:
        """At the copier's CUDA setup: the device of VRAM spans and the pools' device
        addresses."""
        self._torch, self._device = torch, device
        self.pool_devptr = list(pool_devptr)

    def clear(self) -> None:
        """At the copier's close: drop every view (so that the pools can be unmapped)."""
        with self._lock:
            self._cache.clear()

    def alias(self, ptr: int, shape: tuple[int, ...], width: int) -> Any:
        torch = self._torch
        dev = self._device
        try:
            t = torch.as_tensor(CudaPtr(ptr, shape, TYPESTR[width]))
        except Exception as exc:
            raise ConfigError(f"cannot view address {ptr:#x} as CUDA memory: {exc}") from exc
        if t.device != torch.device("cuda", dev):
            raise ConfigError(
                f"address {ptr:#x} belongs to {t.device}, not cuda:{dev} (a pool must be pinned "
                "under the device of the source rows)"
            )
        return t

    def src(self, span_i: int, rs: int, row_len: int, width: int) -> tuple[Any, int]:
        """(view of the span as rows shifted by ``rs``, row number of the view's first row)."""
        key = ("s", span_i, rs, row_len, width)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                return hit
            span = self._spans[span_i]
            first = span.first_row(rs, row_len)
            k0 = (first - span.base - rs) // row_len
            nrows = (span.end - first) // row_len
            shape = (nrows, row_len // width)
            view: Any
            if span.kind is MemKind.VRAM:
                view = self.alias(first, shape, width)
            else:
                view = np.asarray(HostPtr(first, shape, TYPESTR[width]))
            self._cache[key] = (view, k0)
            return view, k0

    def dst(self, pool_i: int, rd: int, row_len: int, width: int, how: str) -> Any:
        """The pool as rows shifted by ``rd``: ``how`` is "numpy", "cpu" (torch CPU tensor, for
        device-to-host copies) or "cuda" (CUDA alias, for kernels)."""
        key = ("d", pool_i, rd, row_len, width, how)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                return hit[0]
            pool = self._pools[pool_i]
            nrows = (pool.nbytes - rd) // row_len
            shape = (nrows, row_len // width)
            view: Any
            if how == "cuda":
                view = self.alias(self.pool_devptr[pool_i] + rd, shape, width)
            else:
                arr = pool.array()[rd : rd + nrows * row_len].view(TYPESTR[width]).reshape(shape)
                view = self._torch.from_numpy(arr) if how == "cpu" else arr
            self._cache[key] = (view, 0)
            return view
