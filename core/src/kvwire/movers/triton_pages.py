"""The page mover of bulk staging: one Triton launch gathers (or scatters) whole pages, or a
byte slice of each token row of them, between a pool's buffers and a contiguous block, with
the addresses computed on the device from the page list.

Imported only where it runs (a CUDA device, or Triton's interpreter on the CPU with
``TRITON_INTERPRET=1`` set before import, as the CPU tests do). The general run mover
(:class:`kvwire.movers.triton_copy.RunCopier`) takes a run list the host plans per call (one
``(src, dst, bytes)`` per buffer and page, or per token for a slice: thousands of rows of
NumPy work and a table of that size per chunk). A staged chunk's runs follow from a few
numbers: the buffers' addresses, the pages, the bytes from one slot to the next and the slice
of a token row. :class:`PageCopier` sends only those (the page list and the buffers'
addresses, written into a pinned slot the kernel reads directly) and launches the compiled
kernel directly, so a call's host work does not grow with the chunk.

One program per (buffer, page): it copies ``tokens`` pieces of ``n`` bytes, piece ``t`` at
``buffer + page * slot_bytes + lo + t * row`` in the pool and at
``block + ((b * pages + i) * tokens + t) * n`` in the block (the block is laid out
``[buffer, page, token, n]``, as :meth:`kvwire.staging.kernels.KVTensors.runs` describes),
in steps of :data:`~kvwire.movers.plan.BLOCK_BYTES` with the widest element that divides
every address and length (16 bytes: vector loads and stores).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from numpy.typing import NDArray

from kvwire.cuda_launch import CompiledKernels
from kvwire.movers.plan import BLOCK_BYTES, MAX_WIDTH
from kvwire.movers.triton_copy import _ELEM, _ELEM_BYTES, _on, _TableSlots

logger = logging.getLogger(__name__)

__all__ = ["PageCopier"]


@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=[
        "table_addr",
        "npages",
        "block_addr",
        "slot_elems",
        "lo_elems",
        "row_elems",
        "n_vecs",
        "tokens",
    ]
)
def _copy_pages(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    table_addr,
    npages,
    block_addr,
    slot_elems,
    lo_elems,
    row_elems,
    n_vecs,
    tokens,
    block: tl.constexpr,
    elem: tl.constexpr,
    align: tl.constexpr,
    vec: tl.constexpr,
    to_pool: tl.constexpr,
) -> None:
    # table (pinned host memory read over the bus, or host memory in the interpreter): int64
    # [npages + buffers] = the pages (slots), then each buffer's address. Offsets are in
    # elements of `elem`, the piece's length in vectors of `vec` elements.
    table = table_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    b = pid // npages
    i = pid - b * npages
    page = tl.load(table + i)
    buf = tl.load(table + npages + b)
    pool0 = buf.to(tl.pointer_type(elem)) + page * slot_elems + lo_elems
    # the length in vectors: the compiler then knows it divides by vec and keeps masked
    # accesses 16 bytes wide (a multiple_of hint on an argument is dropped)
    n_elems = n_vecs * vec
    blk0 = block_addr.to(tl.pointer_type(elem)) + pid * tokens * n_elems
    n = n_elems
    offs = tl.arange(0, block)
    for t in range(0, tokens):
        pool = tl.multiple_of(pool0 + t * row_elems, align)
        blk = tl.multiple_of(blk0 + t * n_elems, align)
        for start in range(0, n, block):
            o = start + offs
            mask = o < n
            if to_pool:
                tl.store(pool + o, tl.load(blk + o, mask=mask), mask=mask)
            else:
                tl.store(blk + o, tl.load(pool + o, mask=mask), mask=mask)


def page_width(addrs: NDArray[np.int64], block: int, *sizes: int) -> int:
    """The widest power of two (at most 16) dividing every buffer address, the block's address
    and every size and offset of a call."""
    acc = int(np.bitwise_or.reduce(addrs)) if addrs.size else 0
    acc |= block | MAX_WIDTH
    for s in sizes:
        acc |= s
    return acc & -acc


def kernel_key(width: int, n: int, to_pool: bool) -> tuple[tuple[Any, ...], int]:
    """The compile-time arguments of a page or unit mover launch for element width ``width``
    and ``n`` bytes per row piece (block size in elements, element type, alignment, vector
    width, direction), and the element size the run-time lengths are counted in."""
    eb = _ELEM_BYTES[width]
    step = BLOCK_BYTES if n >= BLOCK_BYTES else max(1 << (n - 1).bit_length(), width)
    return (step // eb, _ELEM[width], width, width // eb, to_pool), eb


class PageCopier:
    """Gathers and scatters pages of one device's pool with one launch per call.

    Built by :class:`kvwire.staging.kernels.KVTensors` for a GPU pool with token-major pages.
    Any thread may call :meth:`copy`; launches are serialised by a lock of its own (held for
    the table write and the launch only, never while the GPU works). Tables go into pinned
    slots the kernel reads directly (a slot is reused once the launch that read it completed);
    after the first launch of a kernel variant the compiled kernel is launched directly.
    """

    def __init__(self, device: Any, num_warps: int = 4, *, slots: int = 16) -> None:
        self.device = torch.device(device)
        self.num_warps = num_warps
        self._lock = threading.Lock()
        self._slots_count = slots
        self._slot_elems = 0
        self._slots: _TableSlots | None = None
        self._host: NDArray[np.int64] = np.empty(0, dtype=np.int64)  # interpreter
        self._kernels = CompiledKernels("page mover", direct=self.device.type == "cuda")
        #: This thread's list of variants compiled under :meth:`compiling` (else None).
        self._tls = threading.local()

    def copy(
        self,
        addrs: NDArray[np.int64],
        pages: NDArray[np.int64],
        block: int,
        *,
        slot_bytes: int,
        lo: int,
        row: int,
        n: int,
        tokens: int,
        to_pool: bool,
        stream: Any = None,
    ) -> None:
        """Enqueue the copy between bytes ``[lo, lo + n)`` of ``tokens`` rows (``row`` bytes
        apart) of every page ``pages[i]`` (slots ``slot_bytes`` apart) of every buffer at
        ``addrs[b]`` and the block at ``block`` (``[buffer, page, token, n]``): into the
        block, or out of it into the pool when ``to_pool``. Never waits for the GPU unless
        every table slot is still in flight; the caller synchronises ``stream``."""
        npages, nbuf = int(pages.size), int(addrs.size)
        if not npages or not nbuf or not n or not tokens:
            return
        width = page_width(addrs, block, slot_bytes, lo, row, n)
        key, elem_bytes = kernel_key(width, n, to_pool)
        scalars = (
            npages,
            block,
            slot_bytes // elem_bytes,
            lo // elem_bytes,
            row // elem_bytes,
            n // width,
            tokens,
        )
        self._launch(_copy_pages, "page", key, pages, addrs, scalars, stream)

    @contextlib.contextmanager
    def compiling(self) -> Iterator[list[tuple[Any, ...]]]:
        """Within the block, this thread's calls of the copier's copy methods compile the
        kernel variant each would launch, with the arguments it would launch with, and keep
        it for direct launches; they write no table and launch nothing (any page index and
        block address will do). Yields the variants compiled (none where every one already
        was, or on Triton's interpreter, which compiles nothing). A warm-up before a link's
        first copies (:mod:`kvwire.movers.warmup`); any thread. Not under the copier's lock:
        another thread's launch meanwhile does not wait for the compile, and one of the same
        variant compiles it too at worst (the first kept wins)."""
        done: list[tuple[Any, ...]] = []
        self._tls.compiled = done
        try:
            yield done
        finally:
            self._tls.compiled = None

    def _compile_only(
        self,
        kernel_fn: Any,
        ckey: tuple[Any, ...],
        args: tuple[Any, ...],
        grid: tuple[int, int],
        done: list[tuple[Any, ...]],
    ) -> None:
        """:meth:`compiling`'s part of a launch: variant ``ckey`` compiled for ``args``
        (the table address then the scalars and the compile-time key), kept, noted."""
        if self.device.type != "cuda" or self._kernels.kernel(ckey) is not None:
            return
        with _on(self.device):
            kernel = kernel_fn.warmup(*args, grid=grid, num_warps=self.num_warps)
            self._kernels.add(ckey, kernel)
        done.append(ckey)

    def _launch(
        self,
        kernel_fn: Any,
        name: str,
        key: tuple[Any, ...],
        index: NDArray[np.int64],
        addrs: NDArray[np.int64],
        scalars: tuple[int, ...],
        stream: Any,
        grid: int = 0,
    ) -> None:
        """Write the table (``index`` then ``addrs``) into a pinned slot and enqueue one
        launch of ``kernel_fn`` (``grid`` programs, by default one per (buffer, index entry));
        see :meth:`_launch_table`. Called by :meth:`copy` and by subclasses' copies, on the
        caller's thread."""
        nidx, nbuf = int(index.size), int(addrs.size)
        parts = [(0, index), (nidx, addrs)]
        grid = grid or nbuf * nidx
        self._launch_table(kernel_fn, name, key, nidx + nbuf, parts, scalars, stream, (grid, 1))

    def _launch_table(
        self,
        kernel_fn: Any,
        name: str,
        key: tuple[Any, ...],
        need: int,
        parts: Sequence[tuple[int, NDArray[np.int64]]],
        scalars: tuple[int, ...],
        stream: Any,
        grid: tuple[int, int],
    ) -> None:
        """Write a table of ``need`` int64 (each ``(offset, array)`` of ``parts`` at its
        offset; the rest is left as it was) into a pinned slot and enqueue one launch of
        ``kernel_fn`` on ``stream`` over ``grid`` (``scalars`` then the compile-time ``key``);
        the compiled kernel is launched directly after its first launch
        (:class:`kvwire.cuda_launch.CompiledKernels`: the GIL kept where it can be). Under
        this copier's lock; the caller's thread. Under :meth:`compiling`: compiles only."""
        compiled = getattr(self._tls, "compiled", None)
        if compiled is not None:  # a pinned slot's address is above 2**31: typed 64-bit
            args = (1 << 40, *scalars, *key)
            self._compile_only(kernel_fn, (name, *key), args, grid, compiled)
            return
        with self._lock:
            if self.device.type != "cuda":  # Triton's interpreter: host memory, synchronous
                self._host = np.zeros(need, np.int64)
                for o, arr in parts:
                    self._host[o : o + arr.size] = arr
                kernel_fn[grid](self._host.ctypes.data, *scalars, *key)
                return
            if self._slots is None or need > self._slot_elems:
                if self._slots is not None:  # launches may still read the old slots
                    for ev in self._slots.events:
                        if ev is not None:
                            ev.synchronize()
                self._slot_elems = max(need, 2 * self._slot_elems, 4096)
                with _on(self.device):
                    self._slots = _TableSlots(self._slots_count, self._slot_elems)
            slots = self._slots
            s = slots.take()
            row = slots.arr[s]
            for o, arr in parts:
                row[o : o + arr.size] = arr
            stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            args = (slots.addr(s), *scalars)
            ckey = (name, *key)
            with _on(self.device):
                if not self._kernels.launch(
                    ckey, (grid[0], grid[1], 1), stream.cuda_stream, (*args, *key)
                ):
                    with torch.cuda.stream(stream):
                        kernel = kernel_fn[grid](*args, *key, num_warps=self.num_warps)
                    self._kernels.add(ckey, kernel)
                slots.launched(s, stream)
