"""The row copier's DRAM side: rows copied with NumPy, synchronously, on a small thread pool
(NumPy releases the GIL while copying): slice copies for long runs of consecutive rows, gather
and scatter (fancy indexing) otherwise. Owned by :class:`~kvwire_hisparse.copier.RowCopier`
(built at its construction, closed at its close); :meth:`DramRows.copy_group` is called on
transfer worker threads."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvwire_hisparse.rows import Group, Scratch, Span, consecutive_runs, row_width
from kvwire_hisparse.shm import SharedHostPool
from kvwire_hisparse.views import Views

__all__ = ["DramRows"]

#: Scattered DRAM rows go to the thread pool in pieces of at least this many bytes.
_DRAM_MIN_PIECE = 4 << 20


class DramRows:
    """NumPy copies of DRAM rows into the pools, ``threads`` at a time."""

    def __init__(
        self,
        spans: Sequence[Span],
        pools: Sequence[SharedHostPool],
        views: Views,
        *,
        threads: int,
        dma_min_run_bytes: int,
    ) -> None:
        self._spans = list(spans)
        self._pools = list(pools)
        self._views = views
        self.dram_threads = threads
        self.dma_min_run_bytes = dma_min_run_bytes
        self._scratch = Scratch()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def _run_tasks(self, tasks: list[tuple[int, int]], fn: Any) -> None:
        """``fn(a, b)`` for every task, on the DRAM thread pool when there are several (NumPy
        releases the GIL while it copies)."""
        if len(tasks) == 1:
            fn(*tasks[0])
            return
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.dram_threads, thread_name_prefix="kvwire-rowcopy"
                )
            ex = self._executor
        for f in [ex.submit(fn, a, b) for a, b in tasks]:
            f.result()

    def copy_group(self, g: Group, row_len: int, sc: Scratch) -> None:
        """Transfer worker: copy one group's rows now (``sc``: the caller's scratch, which
        holds the group's row arrays)."""
        w = row_width(row_len, self._spans[g.span].base + g.rs, self._pools[g.pool].addr + g.rd)
        src, k0 = self._views.src(g.span, g.rs, row_len, w)
        dst = self._views.dst(g.pool, g.rd, row_len, w, "numpy")
        s, d = g.src_rows, g.dst_rows
        runs = consecutive_runs(g, row_len, self.dma_min_run_bytes, sc)
        n = s.size if runs is None else runs.size - 1
        per = max(1, -(-n // self.dram_threads))
        if runs is None:
            per = max(per, -(-_DRAM_MIN_PIECE // row_len))

            def piece(a: int, b: int) -> None:  # on a pool thread: its own scratch arrays
                sc = self._scratch
                step = max(1, _DRAM_MIN_PIECE // row_len)
                for lo in range(a, b, step):
                    hi = min(b, lo + step)
                    idx = sc.get("gidx", hi - lo, np.intp)
                    np.subtract(s[lo:hi], k0, out=idx)
                    tmp = sc.get("gather", (hi - lo) * src.shape[1], src.dtype)
                    tmp = tmp.reshape(hi - lo, src.shape[1])
                    np.take(src, idx, axis=0, out=tmp, mode="clip")
                    dst[d[lo:hi]] = tmp

        else:
            los = s[runs[:-1]] - k0
            lod = d[runs[:-1]]
            lens = np.diff(runs)

            def piece(a: int, b: int) -> None:
                for s0, d0, k in zip(
                    los[a:b].tolist(), lod[a:b].tolist(), lens[a:b].tolist(), strict=True
                ):
                    dst[d0 : d0 + k] = src[s0 : s0 + k]

        self._run_tasks([(a, min(n, a + per)) for a in range(0, n, per)], piece)

    def close(self) -> None:
        """At the copier's close: stop the thread pool."""
        with self._lock:
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)
