"""The row copier's CUDA side: the pools pinned under the source device and addressed by the
GPU, the copy stream, and the two ways VRAM rows are queued (``mover``: kvwire's fused run
mover through :class:`~kvwire_hisparse.row_mover.RowMover`; ``index``: copy-engine runs or
``index_select``/``index_copy_`` kernels per group). Owned by
:class:`~kvwire_hisparse.copier.RowCopier` (built at its construction, closed at its close);
:meth:`CudaRows.run` is called on transfer worker threads (ordering between calls is the
stream's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from kvwire.errors import ConfigError, TransferError
from kvwire_hisparse.jobs import CopyJob
from kvwire_hisparse.pointers import device_pointer
from kvwire_hisparse.row_mover import RowMover
from kvwire_hisparse.rows import Group, Scratch, Span, consecutive_runs, row_width
from kvwire_hisparse.shm import SharedHostPool
from kvwire_hisparse.views import Views

__all__ = ["CudaRows", "VramPath"]

logger = logging.getLogger(__name__)

#: How VRAM rows that are not long runs move: ``mover`` (kvwire's fused run mover, one Triton
#: launch per batch writing into the pinned pool), ``index`` (``index_select`` into a device
#: buffer and ``index_copy_`` into the pool, per piece), ``auto`` (``mover`` when Triton imports).
VramPath = Literal["auto", "mover", "index"]


class CudaRows:
    """CUDA state of one row copier: raises :class:`~kvwire.errors.ConfigError` at
    construction when the pools cannot be pinned and viewed under ``device``."""

    def __init__(
        self,
        device: int,
        pools: Sequence[SharedHostPool],
        spans: Sequence[Span],
        views: Views,
        vram_path: VramPath,
        *,
        dma_min_run_bytes: int,
        max_piece_bytes: int,
    ) -> None:
        self._pools = list(pools)
        self._spans = list(spans)
        self._views = views
        self.dma_min_run_bytes = dma_min_run_bytes
        self.max_piece_bytes = max_piece_bytes
        #: per pool: the address the GPU writes it at
        self.pool_devptr: list[int] = []
        self.row_mover: RowMover | None = None
        self.stream: Any = None
        self.dst_pointer_mode = ""
        self.vram_path = "index"
        try:
            import torch
        except ImportError as exc:
            raise ConfigError("VRAM source regions need torch to copy into a host pool") from exc
        if not torch.cuda.is_available():
            raise ConfigError("VRAM source regions but CUDA is not available to torch")
        self._torch: Any = torch
        self._device = device
        self._views.set_cuda(torch, device, [])
        modes = set()
        for pool in self._pools:
            pool.pin(device)
            ptr, mode = device_pointer(pool.addr)
            modes.add(mode)
            self.pool_devptr.append(ptr)
            view = self._views.alias(ptr, (pool.nbytes,), 1)
            if int(view.data_ptr()) != ptr:
                raise ConfigError(
                    f"a CUDA view of shared host pool {pool.path} landed at "
                    f"{int(view.data_ptr()):#x}, not at {ptr:#x}"
                )
        self.dst_pointer_mode = ",".join(sorted(modes))
        self._views.set_cuda(torch, device, self.pool_devptr)
        with torch.cuda.device(device):
            self.stream = self._torch.cuda.Stream(device=device)
        self.vram_path = "index"
        if vram_path != "index":
            try:
                from kvwire.movers.triton_copy import RunCopier
            except ImportError as exc:
                if vram_path == "mover":
                    raise ConfigError(f"vram_path='mover' needs Triton: {exc}") from exc
                logger.info("row copier: no Triton (%s); VRAM rows use index kernels", exc)
            else:
                self.row_mover = RowMover(RunCopier(torch.device("cuda", device), slots=32))
                self.vram_path = "mover"
        logger.debug(
            "row copier on cuda:%d, pools addressed by the GPU as %s, rows through %s",
            device,
            self.dst_pointer_mode,
            self.vram_path,
        )

    def run(self, work: Callable[[], list[Any]], nbytes: int, num_rows: int) -> CopyJob:
        """Transfer worker: ``work()`` queues copies with this device and stream current (and
        returns what must outlive them); then one event. On an error, waits for the stream
        (never leaves queued writes running behind it) and raises TransferError."""
        torch = self._torch
        stream = self.stream
        try:
            with torch.cuda.device(self._device), torch.cuda.stream(stream):
                keep = work()
                ev = torch.cuda.Event()
                ev.record(stream)
        except Exception as exc:
            try:  # never leave queued writes running behind an error
                stream.synchronize()
            except Exception as exc2:
                logger.warning("waiting for the copy stream after an error failed: %s", exc2)
            raise TransferError(f"VRAM row copy into shared host pool failed: {exc}") from exc
        return CopyJob(nbytes, num_rows, [ev], keep, label="VRAM")

    def queue_group(self, g: Group, row_len: int, sc: Scratch) -> list[Any]:
        """In :meth:`run`'s ``work``, ``index`` path: queue one group's copies on the current
        (copier) stream, one device-to-host copy per run of consecutive rows when the runs are
        long, else gather/scatter kernels in pieces; returns what must stay alive until they
        are done."""
        torch = self._torch
        w = row_width(row_len, self._spans[g.span].base + g.rs, self.pool_devptr[g.pool] + g.rd)
        src, k0 = self._views.src(g.span, g.rs, row_len, w)
        s = g.src_rows
        runs = consecutive_runs(g, row_len, self.dma_min_run_bytes, sc)
        if runs is not None:
            dst = self._views.dst(g.pool, g.rd, row_len, w, "cpu")
            lo = runs[:-1]
            ln = np.diff(runs)
            for s0, d0, k in zip(
                (s[lo] - k0).tolist(), g.dst_rows[lo].tolist(), ln.tolist(), strict=True
            ):
                dst[d0 : d0 + k].copy_(src[s0 : s0 + k], non_blocking=True)
            return []
        dst = self._views.dst(g.pool, g.rd, row_len, w, "cuda")
        m = s.size
        piece = max(1, self.max_piece_bytes // row_len)
        keep: list[Any] = []
        for a in range(0, m, piece):
            b = min(m, a + piece)
            # Indices go up from torch's pinned host cache (an upload from pageable memory
            # would wait for the copies already queued on the stream), a piece at a time so
            # that the GPU starts while later pieces are prepared.
            buf = torch.empty(2 * (b - a), dtype=torch.int64, pin_memory=True)
            host = buf.numpy()
            np.subtract(s[a:b], k0, out=host[: b - a])
            host[b - a :] = g.dst_rows[a:b]
            idx = buf.to(device=src.device, non_blocking=True)
            # The gather buffer comes from (and returns to) the caching allocator on this
            # stream, so later work can reuse it only after these kernels in stream order.
            tmp = torch.index_select(src, 0, idx[: b - a])
            dst.index_copy_(0, idx[b - a :], tmp)
            keep.append(idx)
        return keep

    def close(self) -> None:
        """At the copier's close: wait for queued copies and drop the stream."""
        if self.stream is not None:
            try:
                self.stream.synchronize()
            except Exception as exc:
                logger.warning("waiting for the copy stream at close failed: %s", exc)
        self.stream = None
