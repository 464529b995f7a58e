"""KV checksums of rows in GPU memory: the terms of :mod:`kvwire.integrity`, one launch per call.

:class:`DeviceRowHasher` is what :func:`kvwire.session.checksums.hasher_for` builds for a rank
whose KV buffers are in VRAM (once per link, at handshake). It locates rows and sums terms per
layer exactly as :class:`~kvwire.integrity.RowHasher` does; only the terms are computed on the
device: one Triton program per row reads the row from its raw address, multiplies its cells by
the position weights, adds them (modulo 2**64) and mixes in the destination key, so the sums
equal the host hasher's bit for bit (a prefill GPU and a decode host pool, or the reverse, agree).
The terms (8 bytes a row) come back to the host through pinned memory; the call waits for its
own stream only.

Rows whose length divides by 8 are read as 64-bit words (straight loads when the address is
8-byte aligned, otherwise assembled from bytes), other rows as bytes: at most three launches
per call, one per class present.

The source rows must be final when :meth:`DeviceRowHasher.sums` is called (prefill: the engine
finished writing them, as for any transfer; decode: the chunk's writes completed, which the
completion notification already guarantees).

Imported only where it runs (a CUDA device, or Triton's interpreter on the CPU with
``TRITON_INTERPRET=1`` set before import, as the CPU tests do).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from numpy.typing import NDArray

from kvwire.errors import DescriptorError
from kvwire.integrity import MIX1, MIX2, ODD, RowHasher, weights
from kvwire.layout import KVLayout, MemKind

__all__ = ["DeviceRowHasher"]

#: Cells a program handles per loop step.
_BLOCK = 1024
#: Row classes: how a row's cells are read.
_WORDS, _WORDS_UNALIGNED, _BYTES = 0, 1, 2


@triton.jit  # type: ignore[untyped-decorator]
def _row_terms(  # type: ignore[no-untyped-def]  # Triton rejects non-Triton annotations
    table_ptr,
    consts_ptr,
    out_ptr,
    num_rows,
    block: tl.constexpr,
    mode: tl.constexpr,
) -> None:
    # table: int64 [3, rows] = row address, destination key, cells; consts: int64 bits of
    # MIX1, MIX2, ODD, then the position weights.
    pid = tl.program_id(0).to(tl.int64)
    addr = tl.load(table_ptr + pid)
    key = tl.load(table_ptr + num_rows + pid).to(tl.uint64, bitcast=True)
    k = tl.load(table_ptr + 2 * num_rows + pid)
    mix1 = tl.load(consts_ptr).to(tl.uint64, bitcast=True)
    mix2 = tl.load(consts_ptr + 1).to(tl.uint64, bitcast=True)
    odd = tl.load(consts_ptr + 2).to(tl.uint64, bitcast=True)
    offs = tl.arange(0, block)
    acc = tl.zeros([block], dtype=tl.uint64)
    for start in range(0, k, block):
        o = start + offs
        m = o < k
        w = tl.load(consts_ptr + 3 + o, mask=m, other=0).to(tl.uint64, bitcast=True)
        if mode == 0:
            p = addr.to(tl.pointer_type(tl.uint64))
            cell = tl.load(p + o, mask=m, other=0)
        elif mode == 1:
            b = addr.to(tl.pointer_type(tl.uint8))
            cell = tl.zeros([block], dtype=tl.uint64)
            for i in tl.static_range(8):
                byte = tl.load(b + o * 8 + i, mask=m, other=0).to(tl.uint64)
                cell = cell | (byte << (8 * i))
        else:
            b = addr.to(tl.pointer_type(tl.uint8))
            cell = tl.load(b + o, mask=m, other=0).to(tl.uint64)
        acc += cell * w
    body = tl.sum(acc, axis=0)
    x = key
    x = (x ^ (x >> 30)) * mix1
    x = (x ^ (x >> 27)) * mix2
    x = x ^ (x >> 31)
    tl.store(out_ptr + pid, ((body ^ x) * odd).to(tl.int64, bitcast=True))


class DeviceRowHasher(RowHasher):
    """Checksum terms of rows in one GPU's memory (see the module docstring).

    ``device``: where the kernels run (default: the buffers' CUDA device; ``"cpu"`` runs
    Triton's interpreter over host memory, for tests). :meth:`sums` may be called from
    several threads at once: a lock of its own serialises the launches and the wait for
    their results (held while the device hashes one call's rows, never across calls).
    """

    KIND = MemKind.VRAM

    def __init__(self, layout: KVLayout, device: Any = None) -> None:
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
        self._lock = threading.Lock()
        self._consts = self._constants(0)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]

    def _open_views(self) -> list[NDArray[np.uint8]]:
        return []  # rows are read by the kernel from their addresses

    def _constants(self, cells: int) -> Any:
        """MIX1, MIX2, ODD and the first ``cells`` weights as an int64 tensor on the device."""
        host = np.concatenate(
            [np.array([MIX1, MIX2, ODD], dtype=np.uint64), weights(max(cells, 1))]
        ).view(np.int64)
        return torch.from_numpy(host.copy()).to(self.device)

    def _row_terms(
        self,
        addr: NDArray[np.uint64],
        lens: NDArray[np.uint64],
        pos: NDArray[np.int64],
        dst: NDArray[np.uint64],
    ) -> NDArray[np.uint64]:
        lens64 = lens.astype(np.int64)
        words = lens64 % 8 == 0
        mode = np.where(words, np.where(addr % np.uint64(8) == 0, _WORDS, _WORDS_UNALIGNED), _BYTES)
        cells = np.where(words, lens64 // 8, lens64)
        out = np.empty(addr.shape, dtype=np.uint64)
        with self._lock:
            need = int(cells.max()) + 3
            if self._consts.numel() < need:
                self._consts = self._constants(need - 3)
            for m in np.unique(mode).tolist():
                sel = mode == m
                table = np.stack([addr[sel].view(np.int64), dst[sel].view(np.int64), cells[sel]])
                out[sel] = self._launch(table, int(m))
        return out

    def _launch(self, table: NDArray[np.int64], mode: int) -> NDArray[np.uint64]:
        """Terms of the rows of ``table`` (one class), waited for. Caller holds the lock."""
        n = table.shape[1]
        grid = (n,)
        if self._stream is None:  # Triton's interpreter: host memory, synchronous
            terms = torch.empty(n, dtype=torch.int64)
            _row_terms[grid](
                torch.from_numpy(np.ascontiguousarray(table)),
                self._consts,
                terms,
                n,
                block=_BLOCK,
                mode=mode,
            )
            return terms.numpy().view(np.uint64).copy()
        host = torch.from_numpy(np.ascontiguousarray(table)).pin_memory()
        result = torch.empty(n, dtype=torch.int64, pin_memory=True)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            dtable = host.to(self.device, non_blocking=True)
            terms = torch.empty(n, dtype=torch.int64, device=self.device)
            _row_terms[grid](dtable, self._consts, terms, n, block=_BLOCK, mode=mode)
            result.copy_(terms, non_blocking=True)
        self._stream.synchronize()
        return result.numpy().view(np.uint64).copy()
