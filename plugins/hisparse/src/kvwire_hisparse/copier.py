"""Prefill copies KV rows itself into a decode process's shared host pool (the ``mapped`` path).

Prefill's ``hisparse`` staging strategy builds one :class:`RowCopier` per linked decode rank, at
handshake (control thread), from this process's registered KV regions and the decode pools it
attached (:class:`~kvwire_hisparse.shm.SharedHostPool`), and has it validate the link's row
tables once (:meth:`RowCopier.prepare`); transfer workers call :meth:`RowCopier.start_rows`
(table indices) per chunk and source memory kind and poll the returned :class:`CopyJob`;
:meth:`RowCopier.start` takes raw addresses instead; the strategy calls
:meth:`RowCopier.close` before closing the pools.

How rows move:

- Every row of a call is validated before anything is written (a refused call writes
  nothing): by address (:meth:`~RowCopier.start`: a bucket table finds each row's region,
  :class:`~kvwire_hisparse.rows.Ranges`, ~7 ns a row) or by index into a prepared table
  (:meth:`~RowCopier.start_rows`: bounds only). Then the rows are planned and copied in
  batches (``batch_rows``), so for VRAM rows the GPU starts on the first batch while the CPU
  plans the next. Per-row work arrays are reused per thread
  (:class:`~kvwire_hisparse.rows.Scratch`).
- Source memory is reached from raw addresses, never from engine tensors. For the NumPy and
  ``index`` paths all regions of one memory kind and device form a *span* ``[lowest start,
  highest end)`` and a row is a row number in a view of the span (:mod:`kvwire_hisparse.views`;
  rows were checked to lie inside one region, so the gaps between regions are never touched);
  destination rows likewise in a view of the pool; rows off the ``row_len`` grid are grouped
  by residue, each with its own shifted view, so no alignment is required.
- DRAM rows (:mod:`kvwire_hisparse.dram_rows`): NumPy, synchronously, on a small thread pool
  (NumPy releases the GIL while copying): slice copies for long runs, gather and scatter
  otherwise.
- VRAM rows (:mod:`kvwire_hisparse.cuda_rows`), on a dedicated CUDA stream into the pinned
  pool, which the GPU addresses directly: under unified virtual addressing, memory registered
  with ``cudaHostRegister`` is addressable from the GPU at its host address (checked at
  construction with ``cudaHostGetDevicePointer`` when the CUDA runtime library is reachable;
  see :attr:`RowCopier.dst_pointer_mode`). ``vram_path="mover"`` (the default when Triton
  imports): each batch is ONE launch of kvwire's fused run mover
  (:class:`~kvwire_hisparse.row_mover.RowMover`), a tile per row, its table in a pinned slot,
  source and destination as raw addresses; a batch of long runs of consecutive rows goes to
  the copy engine instead, a copy per run (SMs left to the engine). ``"index"`` (the earlier
  path, kept for A/B): long runs of consecutive rows as device-to-host copies (copy engine),
  other rows as ``index_select`` into a device buffer and ``index_copy_`` into a CUDA alias
  of the pool.

The source rows must be final when a copy starts (the engine finished writing them, as for
any backend): the copier's stream does not wait for the engine's streams.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import ConfigError, DescriptorError, LayoutError, TransferError
from kvwire.layout import MemKind, MemoryRegion
from kvwire_hisparse.cuda_rows import CudaRows, VramPath
from kvwire_hisparse.dram_rows import DramRows
from kvwire_hisparse.jobs import CopyJob
from kvwire_hisparse.row_mover import RowMover, row_width
from kvwire_hisparse.rows import (
    Group,
    Ranges,
    Scratch,
    Span,
    group_rows,
)
from kvwire_hisparse.shm import SharedHostPool
from kvwire_hisparse.views import Views

__all__ = ["CopyJob", "RowCopier", "RowTable", "VramPath"]

logger = logging.getLogger(__name__)


_U64 = (1 << 64) - 1
#: ``prepare`` checks tables this many rows at a time (bounded work arrays).
_PREPARE_PIECE = 1 << 20


def _addresses(addr: Any) -> NDArray[np.int64]:
    """A 1-D int64 view of 64-bit addresses (no copy when they are 64-bit integers already;
    addresses >= 2**63 turn negative and are refused as outside every range)."""
    arr = np.asarray(addr)
    if arr.dtype in (np.dtype(np.uint64), np.dtype(np.int64)) and arr.ndim == 1:
        return arr.view(np.int64)
    return np.asarray(arr, dtype=np.uint64).reshape(-1).view(np.int64)


@dataclass(frozen=True)
class RowTable:
    """A link's row tables, validated once by :meth:`RowCopier.prepare` (at handshake) and
    read-only after: source and decode-side destination addresses, the row length, each
    source row's span (None: one span) and each destination row's pool (None: one pool)."""

    src: NDArray[np.int64]
    dst: NDArray[np.int64]
    row_len: int
    src_span: NDArray[np.int8] | None
    dst_pool: NDArray[np.int32] | None
    #: Each destination row's address as the copies reach it (``dst`` moved by its pool's
    #: shift), and the access width of every source and such address: found once here, so
    #: a mover batch gathers two columns and passes the width instead of recomputing both.
    dst_dev: NDArray[np.int64]
    width: int


@dataclass
class _Checked:
    """Validated rows of one call, read batch by batch (:meth:`rows`): the memory kind of
    every row, and either addresses with each row's pool and span (``start``: ``span`` None
    for one span) or table indices into a prepared :class:`RowTable` (``start_rows``:
    ``table``, ``si``, ``di``; the addresses are gathered per batch, so the GPU starts
    after the first batch's gather, not after all of them). Scratch-backed (see
    :class:`~kvwire_hisparse.rows.Scratch`)."""

    kind: MemKind
    size: int
    src: NDArray[np.int64] | None = None
    dst: NDArray[np.int64] | None = None
    pos_d: NDArray[np.intp] | None = None
    span: NDArray[np.int64] | None = None
    table: RowTable | None = None
    si: NDArray[np.integer] | None = None
    di: NDArray[np.integer] | None = None

    def rows(
        self, a: int, b: int, sc: Scratch
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.intp], NDArray[np.int64] | None]:
        """(source addresses, destination addresses, pools, spans or None) of rows [a, b)."""
        if self.table is None:
            assert self.src is not None and self.dst is not None and self.pos_d is not None
            span = None if self.span is None else self.span[a:b]
            return self.src[a:b], self.dst[a:b], self.pos_d[a:b], span
        assert self.si is not None and self.di is not None
        t, si, di = self.table, self.si[a:b], self.di[a:b]
        src = np.take(t.src, si, out=sc.get("tsrc", b - a, np.int64))
        dst = np.take(t.dst, di, out=sc.get("tdst", b - a, np.int64))
        pos_d: NDArray[np.intp]
        if t.dst_pool is None:
            pos_d = np.broadcast_to(np.intp(0), (b - a,))
        else:
            pos_d = np.take(t.dst_pool, di)
        span = None if t.src_span is None else np.take(t.src_span, si)
        return src, dst, pos_d, span


class RowCopier:
    """Copies rows from this process's KV regions into shared host pools of a decode process.

    ``src_regions``: this (prefill) process's registered KV regions. ``dst_pools``: pairs of
    (the pool's base address *in the decode process*, this process's attached pool); a remote
    destination address ``a`` in pool ``p`` is written at ``p.addr + (a - remote_base)``.

    Every row of a call is validated first (vectorised; a refused call writes nothing), then
    the rows are planned and copied in batches of ``batch_rows`` (0: one batch), so that for
    VRAM rows the GPU starts on the first batch while the CPU plans the next.

    ``vram_path`` (:data:`VramPath`): how VRAM rows move. ``mover``: every batch through one
    launch of kvwire's fused run mover (:class:`~kvwire_hisparse.row_mover.RowMover`), from
    the raw source addresses into the pool's device address, except a batch whose runs of
    consecutive rows average ``dma_min_run_bytes``: one copy-engine copy per run, as
    ``index`` does (no SMs taken from the engine); ``index``: the earlier path,
    per group of rows of one (span, pool, residues) either one device-to-host copy per run of
    consecutive rows (copy engine; when runs average ``dma_min_run_bytes``) or
    ``index_select``/``index_copy_`` kernels in pieces of at most ``max_piece_bytes``.
    ``dma_min_run_bytes`` also picks slice copies over fancy indexing for DRAM rows.
    ``dram_threads`` (default: up to 8) copy DRAM rows in parallel. ``dram_mover``: DRAM rows
    through this mover instead of NumPy (the tests' seam: a CPU ``RunCopier`` under Triton's
    interpreter runs the ``mover`` path's batching and addressing on host memory).

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
        batch_rows: int = 16384,
        vram_path: VramPath = "auto",
        dram_mover: RowMover | None = None,
    ) -> None:
        if not src_regions:
            raise ConfigError("RowCopier needs at least one source region")
        if not dst_pools:
            raise ConfigError("RowCopier needs at least one destination pool")
        self.dma_min_run_bytes = max(1, int(dma_min_run_bytes))
        self.max_piece_bytes = max(1, int(max_piece_bytes))
        self.dram_threads = max(1, dram_threads or min(8, os.cpu_count() or 1))
        self.batch_rows = max(0, int(batch_rows))
        if vram_path not in ("auto", "mover", "index"):
            raise ConfigError(f"vram_path must be auto, mover or index, got {vram_path!r}")
        #: The VRAM path in use: "mover" or "index" ("" without VRAM regions).
        self.vram_path = ""
        self._dram_mover = dram_mover
        self._scratch = Scratch()
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

        pools = sorted(((int(b), p) for b, p in dst_pools), key=lambda bp: bp[0])
        for (ba, pa), (bb, _) in itertools.pairwise(pools):
            if ba + pa.nbytes > bb:
                raise LayoutError(f"destination pools overlap at remote address {bb:#x}")
        self._pools = [p for _, p in pools]
        self._pool_rstart = np.array([b for b, _ in pools], dtype=np.int64)
        self._dst_ranges = Ranges([b for b, _ in pools], [b + p.nbytes for b, p in pools])
        #: per pool: the address the copies write at minus the remote address (host address
        #: here; the device address once the pools are pinned for VRAM rows)
        self._pool_shift = np.array([p.addr for p in self._pools], dtype=np.int64)
        self._pool_shift -= self._pool_rstart

        self._views = Views(self._spans, self._pools)
        self._dram = DramRows(
            self._spans,
            self._pools,
            self._views,
            threads=self.dram_threads,
            dma_min_run_bytes=self.dma_min_run_bytes,
        )
        self._cuda: CudaRows | None = None
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
            self._cuda = CudaRows(
                vdevs[0],
                self._pools,
                self._spans,
                self._views,
                vram_path,
                dma_min_run_bytes=self.dma_min_run_bytes,
                max_piece_bytes=self.max_piece_bytes,
            )
            self.dst_pointer_mode = self._cuda.dst_pointer_mode
            self.vram_path = self._cuda.vram_path
            self._pool_shift = np.array(self._cuda.pool_devptr, dtype=np.int64)
            self._pool_shift -= self._pool_rstart

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
        return self._copy(self._check(src, dst, row_len), row_len)

    def prepare(
        self, src_addr: NDArray[np.uint64], dst_addr: NDArray[np.uint64], row_len: int
    ) -> RowTable:
        """Staging strategy, at handshake: validate a link's whole source and destination row
        tables once (each row inside one source region, resp. one pool; sources of any kinds),
        so that :meth:`start_rows` only checks indices per chunk.
        :class:`~kvwire.errors.DescriptorError` names the first bad row. The address columns
        are kept as contiguous int64 arrays (copied once here when they are columns of a wider
        table: ``np.take`` copies a strided source whole on every call, which made each
        16,384-row batch of a chunk cost 4.5 ms instead of 0.04 on an H200 host); the check
        runs in pieces, so its work arrays stay small."""
        src = np.ascontiguousarray(_addresses(src_addr))
        dst = np.ascontiguousarray(_addresses(dst_addr))
        row_len = int(row_len)
        if row_len <= 0:
            raise DescriptorError(f"row_len must be > 0, got {row_len}")
        sc = Scratch()  # once per link: nothing worth keeping
        multi_span, multi_pool = len(self._spans) > 1, len(self._pools) > 1
        span = np.empty(src.size, dtype=np.int8) if multi_span else None
        pool = np.empty(dst.size, dtype=np.int32) if multi_pool else None
        for a in range(0, src.size, _PREPARE_PIECE):
            b = min(src.size, a + _PREPARE_PIECE)
            pos_s = self._locate_src(src[a:b], row_len, sc, a)
            if span is not None:
                span[a:b] = self._region_span[pos_s]
        for a in range(0, dst.size, _PREPARE_PIECE):
            b = min(dst.size, a + _PREPARE_PIECE)
            pos_d = self._locate_dst(dst[a:b], row_len, sc, a)
            if pool is not None:
                pool[a:b] = pos_d
        shift = self._pool_shift
        dst_dev = dst + (shift[0] if pool is None else np.take(shift, pool))
        width = row_width(src, dst_dev, row_len)
        return RowTable(src, dst, row_len, span, pool, dst_dev, width)

    def start_rows(
        self, table: RowTable, src_idx: NDArray[np.integer], dst_idx: NDArray[np.integer]
    ) -> CopyJob:
        """Transfer worker: like :meth:`start` for rows ``table.src[src_idx[i]]`` ->
        ``table.dst[dst_idx[i]]`` of a table :meth:`prepare` validated. Per call only the
        indices are checked (integers in bounds, one source memory kind: a few reductions, a
        refused call writes nothing); the addresses are gathered batch by batch."""
        if self._closed:
            raise TransferError("row copier is closed")
        si = np.asarray(src_idx).reshape(-1)
        di = np.asarray(dst_idx).reshape(-1)
        if si.shape != di.shape:
            raise DescriptorError(f"{si.size} source rows but {di.size} destination rows")
        if not (np.issubdtype(si.dtype, np.integer) and np.issubdtype(di.dtype, np.integer)):
            raise DescriptorError(f"row indices must be integers, got {si.dtype}, {di.dtype}")
        n = int(si.size)
        if n == 0:
            return CopyJob(0, 0, label="empty")
        for what, idx, size in (
            ("source", si, table.src.size),
            ("destination", di, table.dst.size),
        ):
            if int(idx.min()) < 0 or int(idx.max()) >= size:
                i = int(np.flatnonzero((idx < 0) | (idx >= size))[0])
                raise DescriptorError(
                    f"row {i}: {what} row {int(idx[i])} is not in the table of {size}"
                )
        kind = MemKind(int(self._span_kind[0]))
        if table.src_span is not None:
            kind = self._one_kind(np.take(table.src_span, si))
        chk = _Checked(kind, n, table=table, si=si, di=di)
        return self._copy(chk, table.row_len)

    def _copy(self, chk: _Checked, row_len: int) -> CopyJob:
        """Copy checked rows: DRAM now, VRAM queued."""
        n = chk.size
        nbytes = n * row_len
        if chk.kind is MemKind.DRAM:
            try:
                if self._dram_mover is not None:

                    def runs(g: Group) -> list[Any]:
                        self._dram.copy_group(g, row_len, self._scratch)
                        return []

                    self._move(self._dram_mover, chk, row_len, None, runs)
                    return CopyJob(nbytes, n, label="DRAM")
                for a, b in self._batches(n, self.batch_rows):
                    for g in self._groups(chk, a, b, row_len):
                        self._dram.copy_group(g, row_len, self._scratch)
            except Exception as exc:
                raise TransferError(f"DRAM row copy into shared host pool failed: {exc}") from exc
            return CopyJob(nbytes, n, label="DRAM")
        return self._copy_cuda(chk, row_len)

    @staticmethod
    def _batches(n: int, per: int) -> Iterator[tuple[int, int]]:
        per = per if per > 0 else n
        for a in range(0, n, per):
            yield a, min(n, a + per)

    def _locate_src(
        self, src: NDArray[np.int64], row_len: int, sc: Scratch, first: int = 0
    ) -> NDArray[np.intp]:
        """Each row's source region; DescriptorError names the first row outside them (rows
        numbered from ``first``)."""
        pos_s, ok = self._src_ranges.locate(src, row_len, sc, "s")
        if not ok.all():
            bad = np.flatnonzero(~ok)
            i = int(bad[0])
            raise DescriptorError(
                f"row {first + i}: source {int(src[i]) & _U64:#x} (+{row_len} B) is not inside one "
                f"source region ({bad.size} such rows)"
            )
        return pos_s

    def _locate_dst(
        self, dst: NDArray[np.int64], row_len: int, sc: Scratch, first: int = 0
    ) -> NDArray[np.intp]:
        """Each row's pool; DescriptorError names the first row outside them (rows numbered
        from ``first``)."""
        pos_d, ok = self._dst_ranges.locate(dst, row_len, sc, "d")
        if not ok.all():
            bad = np.flatnonzero(~ok)
            i = int(bad[0])
            raise DescriptorError(
                f"row {first + i}: destination {int(dst[i]) & _U64:#x} (+{row_len} B) is not "
                f"inside one shared host pool ({bad.size} such rows)"
            )
        return pos_d

    def _one_kind(self, span: NDArray[np.int64]) -> MemKind:
        """The source memory kind of rows of these spans; DescriptorError if they differ."""
        row_kind = self._span_kind[span]
        row_kind0 = int(row_kind[0])
        bad = np.flatnonzero(row_kind != row_kind0)
        if bad.size:
            i = int(bad[0])
            raise DescriptorError(
                f"row {i}: source memory kind {MemKind(int(row_kind[i])).name} differs "
                f"from row 0's {MemKind(row_kind0).name}; split rows by kind"
            )
        return MemKind(row_kind0)

    def _check(self, src: NDArray[np.int64], dst: NDArray[np.int64], row_len: int) -> _Checked:
        """Validate every row of a :meth:`start` call (vectorised): inside one source region
        and one pool, one source memory kind."""
        sc = self._scratch
        pos_s = self._locate_src(src, row_len, sc)
        pos_d = self._locate_dst(dst, row_len, sc)
        n = int(src.size)
        if len(self._spans) == 1:
            return _Checked(MemKind(int(self._span_kind[0])), n, src, dst, pos_d)
        span = self._region_span[pos_s]
        return _Checked(self._one_kind(span), n, src, dst, pos_d, span)

    def _groups(self, chk: _Checked, a: int, b: int, row_len: int) -> list[Group]:
        """Rows ``[a, b)`` of a checked call as groups (see ``rows.group_rows``)."""
        return self._group(*chk.rows(a, b, self._scratch), row_len)

    def _group(
        self,
        src: NDArray[np.int64],
        dst: NDArray[np.int64],
        pos_d: NDArray[np.intp],
        span: NDArray[np.int64] | None,
        row_len: int,
    ) -> list[Group]:
        return group_rows(
            src,
            dst,
            pos_d,
            span,
            row_len,
            src_base=self._span_base[:1] if span is None else np.take(self._span_base, span),
            pool_rstart=self._pool_rstart,
            sc=self._scratch,
        )

    def _copy_cuda(self, chk: _Checked, row_len: int) -> CopyJob:
        """Queue every batch on the copier's stream (the GPU starts on the first while the
        next is planned), then one event."""
        cuda = self._cuda
        assert cuda is not None  # VRAM rows exist only when it was set up
        sc = self._scratch

        def work() -> list[Any]:
            mover = cuda.row_mover
            if mover is not None:
                return self._move(
                    mover, chk, row_len, cuda.stream, lambda g: cuda.queue_group(g, row_len, sc)
                )
            keep: list[Any] = []
            for a, b in self._batches(chk.size, self.batch_rows):
                for g in self._groups(chk, a, b, row_len):
                    keep.extend(cuda.queue_group(g, row_len, self._scratch))
            return keep

        return cuda.run(work, chk.size * row_len, chk.size)

    def _move(
        self,
        mover: RowMover,
        chk: _Checked,
        row_len: int,
        stream: Any,
        runs: Callable[[Group], list[Any]],
    ) -> list[Any]:
        """Every row through ``mover``, one launch per batch (at most what fits a table slot),
        except batches of long runs of consecutive rows: those go as groups to ``runs`` (the
        copy engine on a GPU, which leaves the SMs to the engine). Returns what ``runs`` asks
        to keep alive."""
        per = mover.max_rows(row_len)
        per = min(per, self.batch_rows) if self.batch_rows else per
        keep: list[Any] = []
        t = chk.table
        sc = self._scratch
        for a, b in self._batches(chk.size, per):
            if t is not None:  # a prepared table: two gathers
                assert chk.si is not None and chk.di is not None
                src = np.take(t.src, chk.si[a:b], out=sc.get("tsrc", b - a, np.int64))
                ddev = np.take(t.dst_dev, chk.di[a:b], out=sc.get("ddev", b - a, np.int64))
                if not self._long_runs(src, ddev, row_len):
                    mover.queue(src, ddev, row_len, stream, t.width)
                    continue
            src, dst, pos_d, span = chk.rows(a, b, sc)
            if self._long_runs(src, dst, row_len):
                for g in self._group(src, dst, pos_d, span, row_len):
                    keep.extend(runs(g))
            else:
                mover.queue(src, self._device_dst(dst, pos_d), row_len, stream)
        return keep

    def _long_runs(self, src: NDArray[np.int64], dst: NDArray[np.int64], row_len: int) -> bool:
        """Whether rows consecutive on both sides form runs of ``dma_min_run_bytes`` on
        average (a few passes over the batch)."""
        n = int(src.size)
        if n * row_len < self.dma_min_run_bytes:
            return False
        brk = np.diff(src) != row_len
        brk |= np.diff(dst) != row_len
        return n * row_len >= (int(np.count_nonzero(brk)) + 1) * self.dma_min_run_bytes

    def _device_dst(self, dst: NDArray[np.int64], pos_d: NDArray[np.intp]) -> NDArray[np.int64]:
        """Decode-side addresses as the copies reach the pools (a scratch array)."""
        out = self._scratch.get("ddev", dst.size, np.int64)
        if len(self._pools) == 1:
            np.add(dst, self._pool_shift[0], out=out)
        else:
            np.add(dst, np.take(self._pool_shift, pos_d), out=out)
        return out

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for queued copies, drop the views (so the pools can be unmapped) and the
        stream. Idempotent; call before closing the pools."""
        if self._closed:
            return
        self._closed = True
        if self._cuda is not None:
            self._cuda.close()
        self._views.clear()
        self._dram.close()
