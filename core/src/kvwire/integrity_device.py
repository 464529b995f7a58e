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
8-byte aligned, otherwise assembled from bytes), other rows as bytes; one launch per call.

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
from kvwire.integrity import GOLDEN, MIX1, MIX2, ODD, RowHasher, weights
from kvwire.layout import KVLayout, MemKind

__all__ = ["DeviceRowHasher"]

#: Cells a program handles per loop step.
_BLOCK = 1024
#: How a row's cells are read (the table's fourth column).
_WORDS, _WORDS_UNALIGNED, _BYTES = 0, 1, 2


@triton.jit  # type: ignore[untyped-decorator]
def _row_terms(  # type: ignore[no-untyped-def]  # Triton rejects non-Triton annotations
    table_ptr,
    consts_ptr,
    out_ptr,
    num_rows,
    block: tl.constexpr,
    inline_weights: tl.constexpr,
) -> None:
    # table: int64 [4, rows] = row address, destination key, cells, how cells are read
    # (_WORDS, _WORDS_UNALIGNED, _BYTES); consts: int64 bits of MIX1, MIX2, ODD, GOLDEN,
    # then the position weights (unless computed inline).
    pid = tl.program_id(0).to(tl.int64)
    addr = tl.load(table_ptr + pid)
    key = tl.load(table_ptr + num_rows + pid).to(tl.uint64, bitcast=True)
    k = tl.load(table_ptr + 2 * num_rows + pid)
    mode = tl.load(table_ptr + 3 * num_rows + pid)
    mix1 = tl.load(consts_ptr).to(tl.uint64, bitcast=True)
    mix2 = tl.load(consts_ptr + 1).to(tl.uint64, bitcast=True)
    odd = tl.load(consts_ptr + 2).to(tl.uint64, bitcast=True)
    golden = tl.load(consts_ptr + 3).to(tl.uint64, bitcast=True)
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
            w = tl.load(consts_ptr + 4 + o, mask=m, other=0).to(tl.uint64, bitcast=True)
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
    tl.store(out_ptr + pid, ((body ^ x) * odd).to(tl.int64, bitcast=True))


class DeviceRowHasher(RowHasher):
    """Checksum terms of rows in one GPU's memory (see the module docstring).

    ``device``: where the kernel runs (default: the buffers' CUDA device; ``"cpu"`` runs
    Triton's interpreter over host memory, for tests). ``block``, ``num_warps`` and
    ``inline_weights`` (compute the position weights in the kernel instead of loading them)
    tune the kernel. :meth:`sums` may be called from several threads at once: a lock of its
    own serialises the launch and the wait for its result (held while the device hashes one
    call's rows, never across calls); it also owns the reused pinned and device buffers.
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
        self._consts = self._constants(0)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]
        self._pinned: Any = None  # int64 [5 * capacity]: the table, then the terms
        self._host: NDArray[np.int64] = np.empty((4, 0), dtype=np.int64)  # interpreter
        self._on_device: Any = None  # the same on the device

    def _open_views(self) -> list[NDArray[np.uint8]]:
        return []  # rows are read by the kernel from their addresses

    def _constants(self, cells: int) -> Any:
        """MIX1, MIX2, ODD, GOLDEN and the first ``cells`` weights as an int64 tensor on the
        device."""
        host = np.concatenate(
            [np.array([MIX1, MIX2, ODD, GOLDEN], dtype=np.uint64), weights(max(cells, 1))]
        ).view(np.int64)
        return torch.from_numpy(host.copy()).to(self.device)

    def _row_terms(
        self,
        addr: NDArray[np.uint64],
        lens: NDArray[np.uint64],
        pos: NDArray[np.int64],
        dst: NDArray[np.uint64],
    ) -> NDArray[np.uint64]:
        n = addr.size
        lens64 = lens.astype(np.int64)
        with self._lock:
            longest = int(lens64.max())  # cells of a row never exceed its bytes
            if not self.inline_weights and self._consts.numel() < longest + 4:
                self._consts = self._constants(longest)
            table = self._table(n)
            table[0] = addr.view(np.int64)
            table[1] = dst.view(np.int64)
            if not (lens64 & 7).any() and not (addr & np.uint64(7)).any():
                np.right_shift(lens64, 3, out=table[2])  # the usual case: aligned words
                table[3] = _WORDS
            else:
                words = lens64 % 8 == 0
                aligned = addr % np.uint64(8) == 0
                table[2] = np.where(words, lens64 // 8, lens64)
                table[3] = np.where(words, np.where(aligned, _WORDS, _WORDS_UNALIGNED), _BYTES)
            return self._launch(n)

    def _table(self, n: int) -> NDArray[np.int64]:
        """The ``[4, n]`` table of a call, written in place into the reused pinned buffer
        (a plain array on the interpreter). Caller holds the lock."""
        if self._stream is None:
            self._host = np.empty((4, n), dtype=np.int64)
            return self._host
        if self._pinned is None or self._pinned.numel() < 5 * n:
            cap = max(5 * n, 5 * 4096)
            self._pinned = torch.empty(cap, dtype=torch.int64, pin_memory=True)
            self._on_device = torch.empty(cap, dtype=torch.int64, device=self.device)
        out: NDArray[np.int64] = self._pinned.numpy()[: 4 * n].reshape(4, n)
        return out

    def _launch(self, n: int) -> NDArray[np.uint64]:
        """Terms of the ``n`` rows of the table :meth:`_table` returned, waited for. Caller
        holds the lock."""
        grid = (n,)
        meta = {"block": self.block, "inline_weights": self.inline_weights}
        if self._stream is None:  # Triton's interpreter: host memory, synchronous
            terms = torch.empty(n, dtype=torch.int64)
            _row_terms[grid](torch.from_numpy(self._host), self._consts, terms, n, **meta)
            return terms.numpy().view(np.uint64).copy()
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            dtable = self._on_device[: 4 * n]
            dtable.copy_(self._pinned[: 4 * n], non_blocking=True)
            terms = self._on_device[4 * n : 5 * n]
            _row_terms[grid](dtable, self._consts, terms, n, num_warps=self.num_warps, **meta)
            self._pinned[4 * n : 5 * n].copy_(terms, non_blocking=True)
        self._stream.synchronize()
        out: NDArray[np.uint64] = self._pinned.numpy()[4 * n : 5 * n].view(np.uint64).copy()
        return out
