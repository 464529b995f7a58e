"""KV checksums of rows in GPU memory: the terms of :mod:`kvwire.integrity`, one launch per call.

:class:`DeviceRowHasher` is what :func:`kvwire.session.checksums.hasher_for` builds for a rank
whose KV buffers are in VRAM (once per link, at handshake). It locates rows and sums terms per
layer exactly as :class:`~kvwire.integrity.RowHasher` does; only the work is done on the
device: one Triton program per row reads the row from its raw address, multiplies its cells by
the position weights, adds them (modulo 2**64), mixes in the destination key and adds the term
into its layer's sum with a 64-bit atomic add (addition modulo 2**64 is associative, so the
order the programs run in does not matter). The sums equal the host hasher's bit for bit (a
prefill GPU and a decode host pool, or the reverse, agree).

What a call costs on the host is kept small, since a call is made per chunk on each side:

- the row table (address, key, cells, how cells are read, layer: 5 x 8 bytes a row) is
  written into a pinned buffer the kernel reads directly (mapped into the device's address
  space): no upload, no device allocation;
- after the first launch the compiled kernel is launched directly (Triton's argument binding
  and cache lookup skipped), as :class:`kvwire.movers.triton_copy.RunCopier` does;
- the per-layer sums are formed on the device, so what comes back is one 8-byte sum per layer
  of the rank (copied into pinned memory), not a term per row; the host counts which layers
  the rows touch while the kernel runs, then waits for its own stream only;
- a call with the same row table as the last one (the same ``table``, ``idx`` and
  ``dst_addr`` objects: :class:`~kvwire.session.checksums.SentSums` passes them again for
  each layer-wise group of a chunk) reuses the located rows and, when nothing else was hashed
  in between, the table already in the pinned buffer; a layer range is then selected on the
  device (rows of other layers add nothing).

Rows whose length divides by 8 are read as 64-bit words (straight loads when the address is
8-byte aligned, otherwise assembled from bytes), other rows as bytes; one launch per call.

The source rows must be final when :meth:`DeviceRowHasher.sums` is called (prefill: the engine
finished writing them, as for any transfer; decode: the chunk's writes completed, which the
completion notification already guarantees).

Imported only where it runs (a CUDA device, or Triton's interpreter on the CPU with
``TRITON_INTERPRET=1`` set before import, as the CPU tests do).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from numpy.typing import NDArray

from kvwire.descriptors import DescTable, IndexArray
from kvwire.errors import DescriptorError
from kvwire.integrity import GOLDEN, MIX1, MIX2, ODD, LayerSums, RowHasher, weights
from kvwire.layout import KVLayout, MemKind

__all__ = ["DeviceRowHasher"]

logger = logging.getLogger(__name__)

#: Cells a program handles per loop step.
_BLOCK = 1024
#: How a row's cells are read (the table's fourth column).
_WORDS, _WORDS_UNALIGNED, _BYTES = 0, 1, 2
#: Columns of the row table: address, destination key, cells, read mode, layer.
_COLS = 5
#: Rows the pinned table holds at first (it grows to the largest call).
_MIN_ROWS = 4096


@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=["table_addr", "consts_addr", "out_addr", "num_rows", "lo", "hi"]
)
def _hash_rows(  # type: ignore[no-untyped-def]  # Triton rejects non-Triton annotations
    table_addr,
    consts_addr,
    out_addr,
    num_rows,
    lo,
    hi,
    block: tl.constexpr,
    inline_weights: tl.constexpr,
    per_layer: tl.constexpr,
) -> None:
    # table (pinned host memory read over the bus, or device memory): int64 [5, rows] = row
    # address, destination key, cells, how cells are read (_WORDS, _WORDS_UNALIGNED,
    # _BYTES), layer. consts: int64 bits of MIX1, MIX2, ODD, GOLDEN, then the position
    # weights (unless computed inline). out: per_layer: int64 [layers], each row's term added
    # to its layer's sum when lo <= layer < hi; else int64 [rows], each row's term.
    table = table_addr.to(tl.pointer_type(tl.int64))
    consts = consts_addr.to(tl.pointer_type(tl.int64))
    out = out_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    addr = tl.load(table + pid)
    key = tl.load(table + num_rows + pid).to(tl.uint64, bitcast=True)
    k = tl.load(table + 2 * num_rows + pid)
    mode = tl.load(table + 3 * num_rows + pid)
    layer = tl.load(table + 4 * num_rows + pid)
    inside = (layer >= lo) & (layer < hi)
    k = tl.where(inside, k, 0)  # a row of another layer reads nothing and adds nothing
    mix1 = tl.load(consts).to(tl.uint64, bitcast=True)
    mix2 = tl.load(consts + 1).to(tl.uint64, bitcast=True)
    odd = tl.load(consts + 2).to(tl.uint64, bitcast=True)
    golden = tl.load(consts + 3).to(tl.uint64, bitcast=True)
    words = addr.to(tl.pointer_type(tl.uint64))
    raw = addr.to(tl.pointer_type(tl.uint8))
    offs = tl.arange(0, block)
    acc = tl.zeros([block], dtype=tl.uint64)
    for start in range(0, k, block):
        o = start + offs
        m = o < k
        if inline_weights:  # weights(k)[j] = mix((j + 1) * GOLDEN) | 1, computed here
            w = (o + 1).to(tl.uint64) * golden
            w = (w ^ (w >> 30)) * mix1
            w = (w ^ (w >> 27)) * mix2
            w = (w ^ (w >> 31)) | 1
        else:
            w = tl.load(consts + 4 + o, mask=m, other=0).to(tl.uint64, bitcast=True)
        if mode == 0:
            cell = tl.load(words + o, mask=m, other=0)
        elif mode == 1:
            cell = tl.zeros([block], dtype=tl.uint64)
            for i in tl.static_range(8):
                byte = tl.load(raw + o * 8 + i, mask=m, other=0).to(tl.uint64)
                cell = cell | (byte << (8 * i))
        else:
            cell = tl.load(raw + o, mask=m, other=0).to(tl.uint64)
        acc += cell * w
    body = tl.sum(acc, axis=0)
    x = key
    x = (x ^ (x >> 30)) * mix1
    x = (x ^ (x >> 27)) * mix2
    x = x ^ (x >> 31)
    term = ((body ^ x) * odd).to(tl.int64, bitcast=True)
    if per_layer:
        tl.atomic_add(out + layer, term, mask=inside)
    else:
        tl.store(out + pid, term)


class DeviceRowHasher(RowHasher):
    """Checksums of rows in one GPU's memory (see the module docstring).

    ``device``: where the kernel runs (default: the buffers' CUDA device; ``"cpu"`` runs
    Triton's interpreter over host memory, for tests). ``block``, ``num_warps`` and
    ``inline_weights`` (compute the position weights in the kernel instead of loading them)
    tune the kernel. :meth:`sums` may be called from several threads at once (transfer
    workers): a lock of its own serialises a call's table, launch and wait (held while the
    device hashes one call's rows, never across calls); it owns the pinned table, the sums'
    buffers, the compiled kernels and the last call's located rows.
    """

    KIND = MemKind.VRAM

    def __init__(
        self,
        layout: KVLayout,
        device: Any = None,
        block: int = _BLOCK,
        num_warps: int = 4,
        inline_weights: bool = False,
    ) -> None:
        super().__init__(layout)
        devices = {int(r.device_id) for r in self._regions}
        if device is None:
            if len(devices) != 1:
                raise DescriptorError(
                    f"KV checksums: this rank's KV buffers span GPUs {sorted(devices)}; one "
                    "GPU per rank is supported"
                )
            if not torch.cuda.is_available():
                raise DescriptorError(
                    "KV checksums: this rank's KV buffers are in GPU memory but torch sees "
                    "no CUDA device here"
                )
            device = f"cuda:{devices.pop()}"
        self.device = torch.device(device)
        self.block = block
        self.num_warps = num_warps
        self.inline_weights = inline_weights
        self._lock = threading.Lock()
        self._num_layers = int(self._layers.max()) + 1 if self._layers.size else 1
        self._consts = self._constants(0)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]
        # The row table (pinned on a GPU, plain memory on the interpreter), the per-layer
        # sums on the device and their pinned copy.
        self._table_buf = self._host_buffer(_COLS * _MIN_ROWS)
        self._table_rows = _MIN_ROWS
        self._sums_dev = torch.zeros(self._num_layers, dtype=torch.int64, device=self.device)
        self._sums_host = self._host_buffer(self._num_layers)
        #: Compiled kernels by their constexprs, launched directly after the first launch.
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self._direct = cuda
        #: The last call's located rows: (table, idx, dst_addr) it was built from (held, so
        #: their ids stay theirs), its row table and layers, and whether the pinned table
        #: still holds it.
        self._last: tuple[tuple[Any, Any, Any], NDArray[np.int64], NDArray[np.int64]] | None = None
        self._last_loaded = False

    def _host_buffer(self, elems: int) -> Any:
        """An int64 host tensor: pinned where the kernel runs on a GPU."""
        pin = self.device.type == "cuda"
        return torch.empty(elems, dtype=torch.int64, pin_memory=pin)

    def _open_views(self) -> list[NDArray[np.uint8]]:
        return []  # rows are read by the kernel from their addresses

    def _constants(self, cells: int) -> Any:
        """MIX1, MIX2, ODD, GOLDEN and the first ``cells`` weights as an int64 tensor on the
        device."""
        host = np.concatenate(
            [np.array([MIX1, MIX2, ODD, GOLDEN], dtype=np.uint64), weights(max(cells, 1))]
        ).view(np.int64)
        return torch.from_numpy(host.copy()).to(self.device)

    # ------------------------------------------------------------------ the call
    def sums(
        self,
        table: DescTable,
        idx: IndexArray,
        dst_addr: NDArray[np.uint64],
        layers: Sequence[int] | None = None,
    ) -> LayerSums:
        """Per-layer checksum of rows ``table[idx]`` keyed by ``dst_addr`` (see
        :meth:`RowHasher.sums`), summed on the device. ``layers`` given as a ``range`` of
        step 1 (a layer-wise group) is selected on the device, any other sequence on the
        host. Called by transfer workers (prefill) and the progress thread (decode)."""
        lo, hi = 0, self._num_layers
        if isinstance(layers, range) and layers.step == 1:
            lo, hi = max(layers.start, 0), max(layers.stop, layers.start, 0)
        elif layers is not None:
            return super().sums(table, idx, dst_addr, layers)  # host filter, then _row_terms
        with self._lock:
            rows, row_layer = self._rows(table, idx, dst_addr)
            n = row_layer.size
            if not n or lo >= hi:
                return {}
            self._launch(rows, n, lo, hi, per_layer=True)
            counts = np.bincount(row_layer, minlength=self._num_layers)[lo:hi]
            present = np.flatnonzero(counts) + lo  # while the device hashes
            got = self._wait_sums()
        return {int(x): int(got[x]) for x in present}

    def _rows(
        self, table: DescTable, idx: IndexArray, dst_addr: NDArray[np.uint64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The ``[5, n]`` row table of a call and each row's layer; reused when the call
        passes the same objects as the last one. Caller holds the lock."""
        last = self._last
        if last is not None and all(
            a is b for a, b in zip(last[0], (table, idx, dst_addr), strict=True)
        ):
            return last[1], last[2]
        addr, lens, pos = self._locate(table, idx)
        row_layer = np.asarray(self._layers[pos], dtype=np.int64)
        rows = self._row_table(addr, lens, np.asarray(dst_addr, dtype=np.uint64), row_layer)
        self._last = ((table, idx, dst_addr), rows, row_layer)
        self._last_loaded = False
        return rows, row_layer

    def _row_table(
        self,
        addr: NDArray[np.uint64],
        lens: NDArray[np.uint64],
        dst: NDArray[np.uint64],
        row_layer: NDArray[np.int64],
    ) -> NDArray[np.int64]:
        """Address, key, cells, read mode and layer of each row (``int64 [5, n]``)."""
        n = addr.size
        lens64 = lens.astype(np.int64)
        rows = np.empty((_COLS, n), dtype=np.int64)
        rows[0] = addr.view(np.int64)
        rows[1] = dst.view(np.int64)
        rows[4] = row_layer
        if n and not (lens64 & 7).any() and not (addr & np.uint64(7)).any():
            np.right_shift(lens64, 3, out=rows[2])  # the usual case: aligned words
            rows[3] = _WORDS
        else:
            words = lens64 % 8 == 0
            aligned = addr % np.uint64(8) == 0
            rows[2] = np.where(words, lens64 // 8, lens64)
            rows[3] = np.where(words, np.where(aligned, _WORDS, _WORDS_UNALIGNED), _BYTES)
        if n and not self.inline_weights:
            longest = int(rows[2].max())
            if self._consts.numel() < longest + 4:
                self._consts = self._constants(longest)
        return rows

    def _row_terms(
        self,
        addr: NDArray[np.uint64],
        lens: NDArray[np.uint64],
        pos: NDArray[np.int64],
        dst: NDArray[np.uint64],
    ) -> NDArray[np.uint64]:
        """One term per row (what :meth:`RowHasher.sums` adds on the host when ``layers`` is
        not a range, and what the benchmark's breakdown times)."""
        n = addr.size
        with self._lock:
            rows = self._row_table(addr, lens, dst, np.asarray(self._layers[pos], dtype=np.int64))
            self._last, self._last_loaded = None, False
            terms = torch.empty(n, dtype=torch.int64, device=self.device)
            self._launch(rows, n, 0, self._num_layers, per_layer=False, out=terms)
            if self._stream is not None:
                self._stream.synchronize()
            out: NDArray[np.uint64] = terms.cpu().numpy().view(np.uint64).copy()
        return out

    # ------------------------------------------------------------------ the device
    def _launch(
        self,
        rows: NDArray[np.int64],
        n: int,
        lo: int,
        hi: int,
        *,
        per_layer: bool,
        out: Any = None,
    ) -> None:
        """Enqueue the kernel over the ``n`` rows of ``rows`` on this hasher's stream (the
        per-layer sums zeroed first when ``per_layer``). Caller holds the lock."""
        if self._table_rows < n:
            self._table_rows = max(n, 2 * self._table_rows)
            self._table_buf = self._host_buffer(_COLS * self._table_rows)
            self._last_loaded = False
        if not (self._last_loaded and self._last is not None and self._last[1] is rows):
            self._table_buf.numpy()[: _COLS * n].reshape(_COLS, n)[...] = rows
            self._last_loaded = self._last is not None and self._last[1] is rows
        target = self._sums_dev if per_layer else out
        key = (self.block, self.inline_weights, per_layer)
        args = (self._table_buf.data_ptr(), self._consts.data_ptr(), target.data_ptr(), n, lo, hi)
        if self._stream is None:  # Triton's interpreter: host memory, synchronous
            if per_layer:
                target.zero_()
            _hash_rows[(n,)](*args, *key)
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if per_layer:
                target.zero_()
            kernel = self._compiled.get(key)
            if kernel is not None and self._direct:
                try:
                    kernel[(n, 1, 1)](*args, *key, stream=self._stream.cuda_stream)
                    return
                except Exception as exc:  # another Triton's launcher: bind arguments again
                    logger.warning("checksums: direct launch refused (%s); using Triton's", exc)
                    self._direct = False
            kernel = _hash_rows[(n,)](*args, *key, num_warps=self.num_warps)
            self._compiled.setdefault(key, kernel)

    def _wait_sums(self) -> NDArray[np.uint64]:
        """The per-layer sums of the launch just enqueued, waited for (this hasher's stream
        only). Caller holds the lock."""
        if self._stream is None:
            return self._sums_dev.numpy().view(np.uint64).copy()
        with torch.cuda.stream(self._stream):
            self._sums_host.copy_(self._sums_dev, non_blocking=True)
        self._stream.synchronize()
        out: NDArray[np.uint64] = self._sums_host.numpy().view(np.uint64).copy()
        return out
