"""Gather and scatter of head slices between a KV pool and a contiguous staging block.

A staged block holds, for one chunk and one (prefill rank, decode rank) pair, the head slice of
every token of every page of every buffer pair, laid out ``[pair, page, token, slice bytes]``.
Prefill gathers it from its pool; decode scatters it into its pool. Both run where the pool is:
NumPy views of host memory (no torch thread pool spinning beside the engine), or a private CUDA
stream that is synchronised before the transfer reads the block and before its ring space is
freed. On a GPU the copy is **one** kernel launch per gather or scatter, whatever the number of
buffers (:mod:`kvwire.movers.staged_moves`, chosen once by page order): the page and token-run
movers for token-major pages, the head-major mover for head-major ones (a head range of every
token, transposed into token order on the device). Elsewhere (host pools, no Triton) one
indexed copy per buffer, vectorised over pages and tokens (head-major pages through a
transpose), or a single one when the engine hands its pool over as one stacked tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import ConfigError
from kvwire.layout import KVLayout
from kvwire.movers.staged_moves import PoolGeometry, PoolMoves, fused_moves


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dev dependency
        raise ConfigError(
            "bulk staging gathers and scatters with torch; install it (pip install kvwire[torch])"
        ) from exc
    return torch


class KVTensors:
    """Byte views ``[slots, page_size, row_bytes]`` of a rank's KV buffers.

    ``tensors``: the engine's KV buffers in layout order (torch tensors or NumPy arrays), or one
    stacked tensor ``[num_buffers, ...]``. Their addresses must be the layout's buffers.
    Host pools are handled with NumPy views of the same memory (no torch thread pool spinning
    next to the engine); device pools with torch on a private CUDA stream.
    """

    def __init__(self, layout: KVLayout, tensors: Any) -> None:
        row = layout.token_row_bytes
        m = layout.model
        #: Head-major pages: views are ``[slots, heads, page_size, head bytes]`` and a head
        #: slice is gathered (scattered) with a transpose into (out of) token order.
        self.head_major = layout.head_major
        self.head_bytes = layout.head_bytes
        #: K's and V's page in one slot: links from or to such a pool are never staged
        #: (their K and V planes move by descriptors); the views only span its bytes.
        self.in_slot = layout.kv_in_slot
        pages = 2 if self.in_slot else 1
        shape: tuple[int, ...] = (layout.num_slots, pages * m.page_size, row)
        if self.head_major:
            shape = (layout.num_slots, pages * layout.local_kv_heads, m.page_size, self.head_bytes)
        nbuf = len(layout.buffers)
        items = [tensors] if _is_stacked(tensors, layout) else list(tensors)
        self.on_device = any(_is_cuda(t) for t in items)
        views = [_bytes(t, self.on_device) for t in items]
        self.stacked: Any = None
        if len(items) == 1 and nbuf > 1:
            self.stacked = views[0].reshape(nbuf, *shape)
            per = int(np.prod(shape))
            base = _addr(self.stacked)
            addrs = [base + i * per for i in range(nbuf)]
            self.views = [self.stacked[i] for i in range(nbuf)]
        else:
            if len(views) != nbuf:
                raise ConfigError(f"{len(views)} KV tensors given for {nbuf} layout buffers")
            self.views = [v.reshape(shape) for v in views]
            addrs = [_addr(v) for v in self.views]
        if addrs != [b.addr for b in layout.buffers]:
            raise ConfigError(
                "the KV tensors given to the manager are not the layout's buffers (addresses "
                "differ); pass the same tensors the layout was built from"
            )
        self.device: Any = self.views[0].device if self.on_device else "cpu"
        self.stream: Any = None
        #: Buffer start addresses, bytes from one slot to the next, one token row.
        self.addrs = np.asarray(addrs, dtype=np.int64)
        self.slot_bytes = int(np.prod(shape[1:]))
        self.row = row
        self.page_size = m.page_size
        #: The fused moves of a GPU pool, for its page order (None: indexed copies).
        self.moves: PoolMoves | None = None
        if self.on_device:
            self.torch = _torch()
            self.stream = self.torch.cuda.Stream(device=self.device)
            self.moves = self.fused_moves(self.device)

    def fused_moves(self, device: Any) -> PoolMoves | None:
        """This pool's fused moves on ``device`` (built at construction for a GPU pool; tests
        attach them to a host pool with ``device="cpu"``, run by Triton's interpreter), or
        None where Triton is not installed."""
        geometry = PoolGeometry(
            addrs=self.addrs,
            slot_bytes=self.slot_bytes,
            row=self.row,
            page_size=self.page_size,
            head_bytes=self.head_bytes,
        )
        return fused_moves(geometry, device, head_major=self.head_major)

    def _index(self, arr: NDArray[np.int64]) -> Any:
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        if not self.on_device:
            return arr
        # Blocking copy, issued on the staging stream by the callers: a non-blocking copy on
        # the default stream raced with the indexed copy on the staging stream (found on an
        # H200: parts of blocks came out wrong).
        return self.torch.from_numpy(arr).to(self.device)

    def _ctx(self) -> Any:
        if self.stream is None:
            return contextlib.nullcontext()
        return self.torch.cuda.stream(self.stream)

    def sync(self) -> None:
        """Wait for this pool's staging stream (no-op on the host)."""
        if self.stream is not None:
            self.stream.synchronize()

    def gather(
        self,
        bufs: NDArray[np.int64],
        pages: NDArray[np.int64],
        lo: int,
        hi: int,
        out: Any,
        unit: int = 0,
    ) -> None:
        """Copy bytes ``[lo, hi)`` of every token row of ``pages`` in buffers ``bufs`` into
        ``out`` (bytes shaped ``[len(bufs), len(pages), page_size, hi - lo]``, token order
        whatever the pool's page order); synchronised. With ``unit`` (tokens, dividing the
        page size, below it), ``pages`` are *units* of that many tokens (unit ``u`` is tokens
        ``[(u % k) * unit, ...)`` of page ``u // k``, ``k = page_size / unit``) and ``out``
        is ``[len(bufs), len(pages), unit, hi - lo]``: page-size conversion."""
        self._check_staged()
        if self.moves is not None:
            self._fused(bufs, pages, lo, hi, _addr(out), unit, to_pool=False)
            return
        if unit and unit != self.page_size:
            self._units(bufs, pages, lo, hi, out, unit, to_pool=False)
            return
        with self._ctx():
            idx = self._index(pages)
            if self.stacked is not None:
                b = self._index(bufs)
                out[...] = self._tokens(self._part(self.stacked, lo, hi)[b[:, None], idx[None, :]])
            else:
                for i, bi in enumerate(bufs.tolist()):
                    out[i] = self._tokens(self._part(self.views[bi], lo, hi)[idx])
        self.sync()

    def scatter(
        self,
        bufs: NDArray[np.int64],
        pages: NDArray[np.int64],
        lo: int,
        hi: int,
        block: Any,
        unit: int = 0,
    ) -> None:
        """The inverse of :meth:`gather`: write ``block`` into bytes ``[lo, hi)`` of the token
        rows of ``pages`` (units of ``unit`` tokens, when given) in buffers ``bufs``;
        synchronised before returning."""
        self._check_staged()
        if self.moves is not None:
            self._fused(bufs, pages, lo, hi, _addr(block), unit, to_pool=True)
            return
        if unit and unit != self.page_size:
            self._units(bufs, pages, lo, hi, block, unit, to_pool=True)
            return
        with self._ctx():
            idx = self._index(pages)
            if self.stacked is not None:
                b = self._index(bufs)
                part = self._part(self.stacked, lo, hi)
                part[b[:, None], idx[None, :]] = self._pages(block, hi - lo)
            else:
                for i, bi in enumerate(bufs.tolist()):
                    self._part(self.views[bi], lo, hi)[idx] = self._pages(block[i], hi - lo)
        self.sync()

    def move_block(
        self,
        bufs: NDArray[np.int64],
        pages: NDArray[np.int64],
        lo: int,
        hi: int,
        mem: Any,
        start: int,
        unit: int = 0,
        *,
        to_pool: bool,
    ) -> None:
        """:meth:`gather` into (with ``to_pool``: :meth:`scatter` from) the block of staging
        memory ``mem`` (flat bytes) that starts at byte ``start``, shaped ``[len(bufs),
        len(pages), unit or page_size, hi - lo]``; synchronised. With the fused moves the
        block's address goes to the launch as is: no view of ``mem`` is built (slicing and
        reshaping a device tensor cost 0.05-0.14 ms a chunk on the GPU hosts, more than the
        launch's own Python)."""
        if self.moves is not None:
            self._check_staged()
            self._fused(bufs, pages, lo, hi, _addr(mem) + start, unit, to_pool=to_pool)
            return
        tokens = unit if unit and unit != self.page_size else self.page_size
        block = block_view(mem, start, (len(bufs), len(pages), tokens, hi - lo))
        (self.scatter if to_pool else self.gather)(bufs, pages, lo, hi, block, unit)

    def warm(
        self, bufs: NDArray[np.int64], lo: int, hi: int, unit: int = 0, *, to_pool: bool
    ) -> int:
        """Compile, launching nothing, the fused move that :meth:`move_block` of buffers
        ``bufs``, bytes ``[lo, hi)`` of each token row and units of ``unit`` tokens would
        launch (a gather, or a scatter with ``to_pool``), for a block as aligned as a
        staging buffer's or ring's; returns the variants compiled (0: compiled already, or
        no fused moves). Bulk staging's warm-up thread, at setup and at a link's handshake."""
        if self.moves is None:
            return 0
        one = np.zeros(1, dtype=np.int64)
        with self.moves.compiling() as done:  # a block address aligned as any allocation's
            self._fused(np.asarray(bufs, np.int64), one, lo, hi, 1 << 40, unit, to_pool=to_pool)
        return len(done)

    def _fused(
        self,
        bufs: NDArray[np.int64],
        pages: NDArray[np.int64],
        lo: int,
        hi: int,
        block: int,
        unit: int,
        *,
        to_pool: bool,
    ) -> None:
        """One launch of the pool's fused moves between pages (or units of ``unit`` tokens)
        and the block at address ``block``, then the staging stream synchronised."""
        assert self.moves is not None
        if unit and unit != self.page_size:
            self._per_page(unit)
            u = np.asarray(pages, dtype=np.int64)
            self.moves.units(bufs, u, lo, hi, block, unit, to_pool=to_pool, stream=self.stream)
        else:
            self.moves.pages(bufs, pages, lo, hi, block, to_pool=to_pool, stream=self.stream)
        self.sync()

    def _per_page(self, unit: int) -> int:
        """Units of ``unit`` tokens per page; a unit that does not divide pages is refused."""
        if self.page_size % unit:
            raise ConfigError(f"units of {unit} tokens do not divide pages of {self.page_size}")
        return self.page_size // unit

    def _units(
        self,
        bufs: NDArray[np.int64],
        units: NDArray[np.int64],
        lo: int,
        hi: int,
        block: Any,
        unit: int,
        *,
        to_pool: bool,
    ) -> None:
        """Gather (scatter when ``to_pool``) bytes ``[lo, hi)`` of the token rows of token
        ``units`` of ``unit`` tokens and the block (``[buffer, unit, token, hi - lo]``)
        without fused moves: one indexed copy per buffer, vectorised over units (head-major
        pages: through a transpose)."""
        per = self._per_page(unit)
        u = np.asarray(units, dtype=np.int64)
        with self._ctx():
            page, k = self._index(u // per), self._index(u % per)
            for i, bi in enumerate(np.asarray(bufs, dtype=np.int64).tolist()):
                v = self.views[bi]
                if self.head_major:  # [slots, heads, per, unit, hb] -> [n, unit, heads*hb]
                    h0, h1 = lo // self.head_bytes, hi // self.head_bytes
                    v5 = v.reshape(v.shape[0], v.shape[1], per, unit, self.head_bytes)
                    if to_pool:
                        b = block[i].reshape(u.size, unit, h1 - h0, self.head_bytes)
                        v5[page, h0:h1, k] = b.swapaxes(1, 2)
                    else:
                        t = v5[page, h0:h1, k].swapaxes(1, 2)  # [n, unit, heads, hb]
                        block[i] = t.reshape(u.size, unit, (h1 - h0) * self.head_bytes)
                    continue
                v3 = v.reshape(v.shape[0] * per, unit, self.row)
                if to_pool:
                    v3[self._index(u), :, lo:hi] = block[i]
                else:
                    block[i] = v3[self._index(u), :, lo:hi]
        self.sync()

    def runs(
        self, bufs: NDArray[np.int64], pages: NDArray[np.int64], lo: int, hi: int, block: int
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        """Byte runs between bytes ``[lo, hi)`` of the token rows of ``pages`` in buffers
        ``bufs`` (token-major pages) and the contiguous block at address ``block`` laid out
        ``[buffer, page, token, hi - lo]``: (pool addresses, block addresses, lengths), NumPy
        only. Whole rows give one run per (buffer, page), a slice one per token."""
        b = np.asarray(bufs, dtype=np.int64)
        p = np.asarray(pages, dtype=np.int64)
        start = self.addrs[b][:, None] + p[None, :] * self.slot_bytes  # [buffer, page]
        if hi - lo == self.row:
            pool = start.ravel()
            n = self.page_size * self.row
        else:
            tok = np.arange(self.page_size, dtype=np.int64) * self.row + lo
            pool = (start[:, :, None] + tok[None, None, :]).ravel()
            n = hi - lo
        blk = block + np.arange(pool.size, dtype=np.int64) * n
        return pool, blk, np.full(pool.size, n, dtype=np.int64)

    def _check_staged(self) -> None:
        if self.in_slot:
            raise ConfigError(
                "bulk staging does not gather or scatter a kv_in_slot pool; its links move "
                "by descriptors (the staging strategy leaves them unstaged)"
            )

    def _part(self, view: Any, lo: int, hi: int) -> Any:
        """The bytes ``[lo, hi)`` of each token row of a (stacked) view: a slice of the row,
        or, head-major, the heads ``[lo, hi) / head bytes`` (``[..., n, page, head bytes]``)."""
        if not self.head_major:
            return view[..., lo:hi]
        return view[..., lo // self.head_bytes : hi // self.head_bytes, :, :]

    def _tokens(self, sel: Any) -> Any:
        """Selected pages of :meth:`_part` in token order ``[..., page, bytes]``."""
        if not self.head_major:
            return sel
        t = sel.swapaxes(-3, -2)  # [..., page, n, head bytes]
        return t.reshape(*t.shape[:-2], t.shape[-2] * t.shape[-1])

    def _pages(self, block: Any, nbytes: int) -> Any:
        """A token-order block ``[..., page, bytes]`` in this pool's page order."""
        if not self.head_major:
            return block
        n = nbytes // self.head_bytes
        b = block.reshape(*block.shape[:-1], n, self.head_bytes)  # [..., page, n, hb]
        return b.swapaxes(-3, -2)

    def alloc(self, nbytes: int) -> Any:
        """Zeroed staging memory next to the pool (a NumPy array on the host)."""
        if not self.on_device:
            return np.zeros(nbytes, dtype=np.uint8)
        return self.torch.zeros(nbytes, dtype=self.torch.uint8, device=self.device)


def block_view(buf: Any, start: int, shape: tuple[int, ...]) -> Any:
    """The bytes of ``buf`` from ``start`` seen as a contiguous block of ``shape``."""
    n = int(np.prod(shape))
    return buf[start : start + n].reshape(shape)


def _is_cuda(t: Any) -> bool:
    return bool(getattr(t, "is_cuda", False))


def _bytes(t: Any, device: bool) -> Any:
    """A flat byte view of a tensor or array (torch on a device, NumPy on the host)."""
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous:
            raise ConfigError("KV arrays for bulk staging must be C-contiguous")
        return t.reshape(-1).view(np.uint8)
    if not t.is_contiguous():
        raise ConfigError("KV tensors for bulk staging must be contiguous")
    if device:
        return t.reshape(-1).view(_torch().uint8)
    return t.detach().numpy().reshape(-1).view(np.uint8)


def _addr(v: Any) -> int:
    return int(v.ctypes.data) if isinstance(v, np.ndarray) else int(v.data_ptr())


def _is_stacked(tensors: Any, layout: KVLayout) -> bool:
    return not isinstance(tensors, Sequence) and len(layout.buffers) > 1
