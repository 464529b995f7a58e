"""Prefill copies KV rows itself into a decode process's shared host pool (the ``mapped`` path).

Prefill's ``hisparse`` staging strategy builds one :class:`RowCopier` per linked decode rank, at
handshake (control thread), from this process's registered KV regions and the decode pools it
attached (:class:`~kvwire_hisparse.shm.SharedHostPool`); transfer workers call
:meth:`RowCopier.start` per chunk and source memory kind and poll the returned
:class:`CopyJob`; the strategy calls :meth:`RowCopier.close` before closing the pools.

How rows move:

- Source memory is reached from raw addresses, never from engine tensors. All regions of one
  memory kind and device form a *span* ``[lowest start, highest end)``; a row is addressed as a
  row number in a view of the span (rows are checked to lie inside one region first, so the
  gaps between regions are never touched). Destination rows likewise are row numbers in a view
  of the pool. Rows whose offsets are not multiples of ``row_len`` are grouped by their
  residue, each residue getting its own shifted view, so no alignment is required.
- Validation and planning are vectorised over all rows before anything is written (a refused
  call writes nothing): a bucket table finds each row's region (:class:`Ranges`), and the
  per-row work arrays are reused per thread (:class:`Scratch`), ~20 ns a row on an H200 host.
- DRAM rows: NumPy, synchronously in :meth:`RowCopier.start`, on a small thread pool (NumPy
  releases the GIL while copying): slice copies for long runs of consecutive rows, gather and
  scatter (fancy indexing) otherwise.
- VRAM rows: on a dedicated CUDA stream, long runs of consecutive rows as plain device-to-host
  copies into the pinned pool (copy engine), scattered rows as ``index_select`` into a device
  buffer and ``index_copy_`` into a CUDA tensor that aliases the pinned pool: under unified
  virtual addressing, memory registered with ``cudaHostRegister`` is addressable from the GPU
  at its host address (checked at construction, with ``cudaHostGetDevicePointer`` when the
  CUDA runtime library is reachable; see :attr:`RowCopier.dst_pointer_mode`; on an H200 with
  CUDA 13 torch it returns the host address). Both reach ~55 GB/s on the GPU side, like a
  local pinned device-to-host copy (scripts/gpu_hisparse_bench.py).

The source rows must be final when :meth:`RowCopier.start` is called (the engine finished
writing them, as for any backend): the copier's stream does not wait for the engine's streams.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import ConfigError, DescriptorError, LayoutError, TransferError
from kvwire.layout import MemKind, MemoryRegion
from kvwire_hisparse.pointers import CudaPtr, HostPtr, device_pointer
from kvwire_hisparse.rows import Ranges, Scratch, Span
from kvwire_hisparse.shm import SharedHostPool

logger = logging.getLogger(__name__)

#: Element type used to move rows, by width in bytes (the widest that divides the row length
#: and both base addresses is used).
_TYPESTR = {8: "<i8", 4: "<i4", 2: "<i2", 1: "|u1"}


#: Scattered DRAM rows go to the thread pool in pieces of at least this many bytes.
_DRAM_MIN_PIECE = 4 << 20
_I64_MAX = np.iinfo(np.int64).max
_U64 = (1 << 64) - 1


@dataclass
class _Group:
    """Rows of one (span, pool, source residue, destination residue)."""

    span: int
    pool: int
    rs: int
    rd: int
    src_rows: NDArray[np.int64]
    dst_rows: NDArray[np.int64]


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


class RowCopier:
    """Copies rows from this process's KV regions into shared host pools of a decode process.

    ``src_regions``: this (prefill) process's registered KV regions. ``dst_pools``: pairs of
    (the pool's base address *in the decode process*, this process's attached pool); a remote
    destination address ``a`` in pool ``p`` is written at ``p.addr + (a - remote_base)``.

    ``dma_min_run_bytes``: a group of rows whose runs of consecutive rows (on both sides)
    average at least this many bytes is moved with one plain copy per run (copy engine for
    VRAM), otherwise with gather/scatter kernels. ``max_piece_bytes`` bounds the device buffer
    a gather uses (larger groups go in pieces, the GPU starting on the first while the next
    is prepared). ``dram_threads`` (default: up to 8) copy DRAM rows in parallel.

    With VRAM regions (all on one CUDA device), every pool is pinned under that device
    (re-registered if it was pinned under another) and a CUDA view of it is checked here;
    :class:`~kvwire.errors.ConfigError` when that cannot work.
    """

    def __init__(
        self,
        src_regions: Sequence[MemoryRegion],
        dst_pools: Sequence[tuple[int, SharedHostPool]],
        *,
        dma_min_run_bytes: int = 1 << 20,
        max_piece_bytes: int = 32 << 20,
        dram_threads: int | None = None,
    ) -> None:
        if not src_regions:
            raise ConfigError("RowCopier needs at least one source region")
        if not dst_pools:
            raise ConfigError("RowCopier needs at least one destination pool")
        self.dma_min_run_bytes = max(1, int(dma_min_run_bytes))
        self.max_piece_bytes = max(1, int(max_piece_bytes))
        self.dram_threads = max(1, dram_threads or min(8, os.cpu_count() or 1))
        self._executor: ThreadPoolExecutor | None = None
        self._scratch = Scratch()
        self._lock = threading.Lock()
        self._closed = False

        regs = sorted(src_regions, key=lambda r: r.addr)
        for a, b in itertools.pairwise(regs):
            if a.end > b.addr:
                raise LayoutError(
                    f"source regions overlap: {a.addr:#x} (+{a.length}) and {b.addr:#x}"
                )
        self._src_ranges = Ranges([r.addr for r in regs], [r.end for r in regs])
        keys = sorted({(r.kind, r.device_id if r.kind is MemKind.VRAM else 0) for r in regs})
        spans: list[Span] = []
        for kind, dev in keys:
            mine = [
                r for r in regs if r.kind is kind and (kind is MemKind.DRAM or r.device_id == dev)
            ]
            spans.append(
                Span(
                    kind,
                    dev,
                    mine[0].addr,
                    max(r.end for r in mine),
                    tuple((r.addr, r.end) for r in mine),
                )
            )
        self._spans = spans
        span_index = {(s.kind, s.device): i for i, s in enumerate(spans)}
        self._region_span = np.array(
            [span_index[(r.kind, r.device_id if r.kind is MemKind.VRAM else 0)] for r in regs],
            dtype=np.int64,
        )
        self._span_base = np.array([s.base for s in spans], dtype=np.int64)
        self._span_kind = np.array([int(s.kind) for s in spans], dtype=np.int64)
        #: per region: the base of its span (rows are numbered from there)
        self._region_base = self._span_base[self._region_span]

        pools = sorted(((int(b), p) for b, p in dst_pools), key=lambda bp: bp[0])
        for (ba, pa), (bb, _) in itertools.pairwise(pools):
            if ba + pa.nbytes > bb:
                raise LayoutError(f"destination pools overlap at remote address {bb:#x}")
        self._pools = [p for _, p in pools]
        self._pool_rstart = np.array([b for b, _ in pools], dtype=np.int64)
        self._dst_ranges = Ranges([b for b, _ in pools], [b + p.nbytes for b, p in pools])

        self._views: dict[tuple[Any, ...], tuple[Any, int]] = {}
        self._torch: Any = None
        self._device: int | None = None
        self._stream: Any = None
        self._pool_devptr: list[int] = []
        #: How the GPU addresses the pinned pools: "uva" (cudaHostGetDevicePointer returned the
        #: host address), "device-pointer" (it returned another address, used instead),
        #: "uva-assumed" (runtime library not reachable; host address used) or "" (no VRAM).
        self.dst_pointer_mode = ""
        vdevs = sorted({s.device for s in spans if s.kind is MemKind.VRAM})
        if len(vdevs) > 1:
            raise ConfigError(
                f"source VRAM regions span CUDA devices {vdevs}; the mapped path copies from one "
                "device per process"
            )
        if vdevs:
            self._setup_cuda(vdevs[0])

    # ------------------------------------------------------------------ CUDA setup
    def _setup_cuda(self, device: int) -> None:
        try:
            import torch
        except ImportError as exc:
            raise ConfigError("VRAM source regions need torch to copy into a host pool") from exc
        if not torch.cuda.is_available():
            raise ConfigError("VRAM source regions but CUDA is not available to torch")
        self._torch, self._device = torch, device
        modes = set()
        for pool in self._pools:
            pool.pin(device)
            ptr, mode = device_pointer(pool.addr)
            modes.add(mode)
            self._pool_devptr.append(ptr)
            view = self._cuda_alias(ptr, (pool.nbytes,), 1)
            if int(view.data_ptr()) != ptr:
                raise ConfigError(
                    f"a CUDA view of shared host pool {pool.path} landed at "
                    f"{int(view.data_ptr()):#x}, not at {ptr:#x}"
                )
        self.dst_pointer_mode = ",".join(sorted(modes))
        with torch.cuda.device(device):
            self._stream = self._torch.cuda.Stream(device=device)
        logger.debug(
            "row copier on cuda:%d, pools addressed by the GPU as %s", device, self.dst_pointer_mode
        )

    def _cuda_alias(self, ptr: int, shape: tuple[int, ...], width: int) -> Any:
        torch = self._torch
        dev = self._device
        try:
            t = torch.as_tensor(CudaPtr(ptr, shape, _TYPESTR[width]))
        except Exception as exc:
            raise ConfigError(f"cannot view address {ptr:#x} as CUDA memory: {exc}") from exc
        if t.device != torch.device("cuda", dev):
            raise ConfigError(
                f"address {ptr:#x} belongs to {t.device}, not cuda:{dev} (a pool must be pinned "
                "under the device of the source rows)"
            )
        return t

    # ------------------------------------------------------------------ views
    def _src_view(self, span_i: int, rs: int, row_len: int, width: int) -> tuple[Any, int]:
        """(view of the span as rows shifted by ``rs``, row number of the view's first row)."""
        key = ("s", span_i, rs, row_len, width)
        with self._lock:
            hit = self._views.get(key)
            if hit is not None:
                return hit
            span = self._spans[span_i]
            first = span.first_row(rs, row_len)
            k0 = (first - span.base - rs) // row_len
            nrows = (span.end - first) // row_len
            shape = (nrows, row_len // width)
            view: Any
            if span.kind is MemKind.VRAM:
                view = self._cuda_alias(first, shape, width)
            else:
                view = np.asarray(HostPtr(first, shape, _TYPESTR[width]))
            self._views[key] = (view, k0)
            return view, k0

    def _dst_view(self, pool_i: int, rd: int, row_len: int, width: int, how: str) -> Any:
        """The pool as rows shifted by ``rd``: ``how`` is "numpy", "cpu" (torch CPU tensor, for
        device-to-host copies) or "cuda" (CUDA alias, for kernels)."""
        key = ("d", pool_i, rd, row_len, width, how)
        with self._lock:
            hit = self._views.get(key)
            if hit is not None:
                return hit[0]
            pool = self._pools[pool_i]
            nrows = (pool.nbytes - rd) // row_len
            shape = (nrows, row_len // width)
            view: Any
            if how == "cuda":
                view = self._cuda_alias(self._pool_devptr[pool_i] + rd, shape, width)
            else:
                arr = pool.array()[rd : rd + nrows * row_len].view(_TYPESTR[width]).reshape(shape)
                view = self._torch.from_numpy(arr) if how == "cpu" else arr
            self._views[key] = (view, 0)
            return view

    # ------------------------------------------------------------------ copies
    def start(
        self,
        src_addr: NDArray[np.uint64],
        dst_addr: NDArray[np.uint64],
        row_len: int,
    ) -> CopyJob:
        """Transfer worker: copy row ``i`` (``row_len`` bytes) from local address
        ``src_addr[i]`` to decode-side address ``dst_addr[i]``.

        All rows must come from one source memory kind (several regions are fine) and land
        anywhere in the pools; :class:`~kvwire.errors.DescriptorError` names the first row that
        is not inside one source region or one pool. DRAM rows are copied before this returns;
        VRAM rows are queued on the copier's stream. Errors while copying raise
        :class:`~kvwire.errors.TransferError` (queued GPU work is waited for first).
        """
        if self._closed:
            raise TransferError("row copier is closed")
        # int64 views of the addresses (no copy): user-space addresses are below 2**63, and
        # larger ones turn negative here and are refused as outside every region
        src = np.ascontiguousarray(src_addr, dtype=np.uint64).reshape(-1).view(np.int64)
        dst = np.ascontiguousarray(dst_addr, dtype=np.uint64).reshape(-1).view(np.int64)
        row_len = int(row_len)
        if src.shape != dst.shape:
            raise DescriptorError(
                f"{src.size} source addresses but {dst.size} destination addresses"
            )
        if row_len <= 0:
            raise DescriptorError(f"row_len must be > 0, got {row_len}")
        n = int(src.size)
        if n == 0:
            return CopyJob(0, 0, label="empty")
        groups, kind = self._plan(src, dst, row_len)
        nbytes = n * row_len
        if kind is MemKind.DRAM:
            try:
                for g in groups:
                    self._copy_numpy(g, row_len)
            except Exception as exc:
                raise TransferError(f"DRAM row copy into shared host pool failed: {exc}") from exc
            return CopyJob(nbytes, n, label="DRAM")
        return self._copy_cuda(groups, row_len, nbytes, n)

    def _plan(
        self, src: NDArray[np.int64], dst: NDArray[np.int64], row_len: int
    ) -> tuple[list[_Group], MemKind]:
        """Validate every row (vectorised) and split the rows into groups."""
        sc = self._scratch
        n = src.size
        pos_s, ok = self._src_ranges.locate(src, row_len, sc, "s")
        if not ok.all():
            bad = np.flatnonzero(~ok)
            i = int(bad[0])
            raise DescriptorError(
                f"row {i}: source {int(src[i]) & _U64:#x} (+{row_len} B) is not inside one "
                f"source region ({bad.size} such rows)"
            )
        pos_d, ok = self._dst_ranges.locate(dst, row_len, sc, "d")
        if not ok.all():
            bad = np.flatnonzero(~ok)
            i = int(bad[0])
            raise DescriptorError(
                f"row {i}: destination {int(dst[i]) & _U64:#x} (+{row_len} B) is not inside "
                f"one shared host pool ({bad.size} such rows)"
            )
        one_span = len(self._spans) == 1
        span = None
        if one_span:
            row_kind0 = int(self._span_kind[0])
        else:
            span = self._region_span[pos_s]
            row_kind = self._span_kind[span]
            row_kind0 = int(row_kind[0])
            bad = np.flatnonzero(row_kind != row_kind0)
            if bad.size:
                i = int(bad[0])
                raise DescriptorError(
                    f"row {i}: source memory kind {MemKind(int(row_kind[i])).name} differs "
                    f"from row 0's {MemKind(row_kind0).name}; split rows by kind"
                )
        rows_s, rs = sc.get("rows_s", n, np.int64), sc.get("rs", n, np.int64)
        rows_d, rd = sc.get("rows_d", n, np.int64), sc.get("rd", n, np.int64)
        if one_span:
            np.subtract(src, self._span_base[0], out=rows_s)
        else:
            np.subtract(src, np.take(self._region_base, pos_s), out=rows_s)
        if len(self._pools) == 1:
            np.subtract(dst, self._pool_rstart[0], out=rows_d)
        else:
            np.subtract(dst, np.take(self._pool_rstart, pos_d), out=rows_d)
        if row_len & (row_len - 1) == 0:  # the usual case: shifts and masks, no division
            shift, mask = row_len.bit_length() - 1, row_len - 1
            for rows, res in ((rows_s, rs), (rows_d, rd)):
                np.bitwise_and(rows, mask, out=res)
                np.right_shift(rows, shift, out=rows)
        else:
            for rows, res in ((rows_s, rs), (rows_d, rd)):
                np.divmod(rows, row_len, out=(rows, res))
        members: list[NDArray[np.intp] | slice] = [slice(None)]
        residues = bool(rs.any() or rd.any())
        if span is not None or len(self._pools) > 1 or residues:
            key = pos_d.astype(np.int64) if span is None else span * len(self._pools) + pos_d
            if residues:
                cols = np.stack([key, rs, rd], axis=1)
                _, inverse = np.unique(cols, axis=0, return_inverse=True)
                key = inverse.reshape(-1)
            if key.min() != key.max():
                order = np.argsort(key, kind="stable")
                cuts = np.flatnonzero(np.diff(key[order])) + 1
                members = list(np.split(order, cuts))
        groups = []
        for m in members:
            first = 0 if isinstance(m, slice) else int(m[0])
            groups.append(
                _Group(
                    0 if span is None else int(span[first]),
                    int(pos_d[first]),
                    int(rs[first]),
                    int(rd[first]),
                    rows_s[m],
                    rows_d[m],
                )
            )
        return groups, MemKind(row_kind0)

    def _width(self, g: _Group, row_len: int, dst_base: int) -> int:
        a = self._spans[g.span].base + g.rs
        b = dst_base + g.rd
        for w in (8, 4, 2):
            if row_len % w == 0 and a % w == 0 and b % w == 0:
                return w
        return 1

    def _runs(self, g: _Group, row_len: int) -> NDArray[np.intp] | None:
        """Run boundaries (``[0, ..., n]``) if the group's consecutive-row runs are long enough
        for one plain copy each, else None."""
        n = g.src_rows.size
        if n * row_len < self.dma_min_run_bytes:
            return None
        sc = self._scratch
        step = sc.get("step", n - 1, np.int64)
        brk, brk2 = sc.get("brk", n - 1, np.bool_), sc.get("brk2", n - 1, np.bool_)
        np.subtract(g.src_rows[1:], g.src_rows[:-1], out=step)
        np.not_equal(step, 1, out=brk)
        np.subtract(g.dst_rows[1:], g.dst_rows[:-1], out=step)
        np.not_equal(step, 1, out=brk2)
        brk |= brk2
        if n * row_len < (int(np.count_nonzero(brk)) + 1) * self.dma_min_run_bytes:
            return None
        return np.concatenate(([0], np.flatnonzero(brk) + 1, [n])).astype(np.intp)

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

    def _copy_numpy(self, g: _Group, row_len: int) -> None:
        w = self._width(g, row_len, self._pools[g.pool].addr)
        src, k0 = self._src_view(g.span, g.rs, row_len, w)
        dst = self._dst_view(g.pool, g.rd, row_len, w, "numpy")
        s, d = g.src_rows, g.dst_rows
        runs = self._runs(g, row_len)
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

    def _copy_cuda(self, groups: list[_Group], row_len: int, nbytes: int, n: int) -> CopyJob:
        torch = self._torch
        stream = self._stream
        keep: list[Any] = []
        try:
            with torch.cuda.device(self._device), torch.cuda.stream(stream):
                for g in groups:
                    keep.extend(self._queue_cuda(g, row_len))
                ev = torch.cuda.Event()
                ev.record(stream)
        except Exception as exc:
            try:  # never leave queued writes running behind an error
                stream.synchronize()
            except Exception as exc2:
                logger.warning("waiting for the copy stream after an error failed: %s", exc2)
            raise TransferError(f"VRAM row copy into shared host pool failed: {exc}") from exc
        return CopyJob(nbytes, n, [ev], keep, label="VRAM")

    def _queue_cuda(self, g: _Group, row_len: int) -> list[Any]:
        """Queue one group's copies on the current (copier) stream; returns what must stay
        alive until they are done."""
        torch = self._torch
        w = self._width(g, row_len, self._pool_devptr[g.pool])
        src, k0 = self._src_view(g.span, g.rs, row_len, w)
        s = g.src_rows
        runs = self._runs(g, row_len)
        if runs is not None:
            dst = self._dst_view(g.pool, g.rd, row_len, w, "cpu")
            lo = runs[:-1]
            ln = np.diff(runs)
            for s0, d0, k in zip(
                (s[lo] - k0).tolist(), g.dst_rows[lo].tolist(), ln.tolist(), strict=True
            ):
                dst[d0 : d0 + k].copy_(src[s0 : s0 + k], non_blocking=True)
            return []
        dst = self._dst_view(g.pool, g.rd, row_len, w, "cuda")
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

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for queued copies, drop the views (so the pools can be unmapped) and the
        stream. Idempotent; call before closing the pools."""
        if self._closed:
            return
        self._closed = True
        if self._stream is not None:
            try:
                self._stream.synchronize()
            except Exception as exc:
                logger.warning("waiting for the copy stream at close failed: %s", exc)
        with self._lock:
            self._views.clear()
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)
        self._stream = None
