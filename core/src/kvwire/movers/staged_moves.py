"""Bulk staging's fused moves on a GPU pool: a pool's page order (token-major or head-major)
chosen once, behind one seam.

A staged block is ``[buffer, page (or unit), token, bytes lo..hi]`` in token order whatever
the pool's page order. :class:`PoolMoves` is what :class:`kvwire.staging.kernels.KVTensors`
asks of a GPU pool: gather (scatter) whole pages or units of ``unit`` tokens, every buffer of
the call in **one** kernel launch. :class:`TokenMajorMoves` hands them to the page and unit
movers (:class:`~kvwire.movers.triton_units.UnitCopier`), :class:`HeadMajorMoves` to the
head-major mover (:class:`~kvwire.movers.triton_heads.HeadCopier`); :func:`fused_moves`
builds the one that fits a pool (None without Triton: the caller's indexed copies serve).
Both enqueue on the caller's stream and never wait; the caller synchronises it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from kvwire.movers.triton_heads import HeadCopier
    from kvwire.movers.triton_units import UnitCopier

__all__ = ["HeadMajorMoves", "PoolGeometry", "PoolMoves", "TokenMajorMoves", "fused_moves"]

I64 = NDArray[np.int64]


@dataclass(frozen=True)
class PoolGeometry:
    """Where a pool's bytes are: each buffer's address (``addrs``), bytes from one slot to
    the next, one token row's bytes, tokens per page, one head's bytes of one token (a slot
    is ``[page, row]`` token-major, ``[heads, page, head_bytes]`` head-major). Built once by
    the pool's owner (:class:`kvwire.staging.kernels.KVTensors`); immutable."""

    addrs: I64
    slot_bytes: int
    row: int
    page_size: int
    head_bytes: int


class PoolMoves(Protocol):
    """Fused gathers and scatters between a GPU pool and staging blocks. Called by the pool's
    owner on a staging worker's thread (prefill: gather; decode: scatter), any number of
    threads at once (launches are serialised by the copier's lock); the owner synchronises
    ``stream`` before the block is read or its space freed."""

    def pages(
        self, bufs: I64, pages: I64, lo: int, hi: int, block: int, *, to_pool: bool, stream: Any
    ) -> None:
        """Enqueue the copy between bytes ``[lo, hi)`` of every token row of slots ``pages``
        of buffers ``bufs`` and the block at address ``block`` (``[buffer, page, token,
        hi - lo]``), into the pool when ``to_pool``."""

    def units(
        self,
        bufs: I64,
        units: I64,
        lo: int,
        hi: int,
        block: int,
        unit: int,
        *,
        to_pool: bool,
        stream: Any,
    ) -> None:
        """As :meth:`pages` for units of ``unit`` tokens (``unit`` divides the page size:
        unit ``u`` is tokens ``[(u % k) * unit, ...)`` of slot ``u // k``, ``k = page /
        unit``), the block ``[buffer, unit, token, hi - lo]``."""

    def compiling(self) -> AbstractContextManager[list[Any]]:
        """Within the block, this thread's :meth:`pages` and :meth:`units` calls compile
        their kernel variant and launch nothing (the copier's
        :meth:`~kvwire.movers.triton_pages.PageCopier.compiling`); yields what compiled."""


@dataclass(frozen=True)
class TokenMajorMoves:
    """Token-major pages: one launch of the page mover per page call (one piece per page for
    whole rows, one per token for a slice), of the token-run mover per unit call."""

    geometry: PoolGeometry
    copier: UnitCopier

    def compiling(self) -> AbstractContextManager[list[Any]]:
        """See :meth:`PoolMoves.compiling`."""
        return self.copier.compiling()

    def pages(
        self, bufs: I64, pages: I64, lo: int, hi: int, block: int, *, to_pool: bool, stream: Any
    ) -> None:
        """See :meth:`PoolMoves.pages`."""
        g = self.geometry
        whole = hi - lo == g.row
        self.copier.copy(
            g.addrs[np.asarray(bufs, dtype=np.int64)],
            np.asarray(pages, dtype=np.int64),
            block,
            slot_bytes=g.slot_bytes,
            lo=lo,
            row=g.row,
            n=g.page_size * g.row if whole else hi - lo,
            tokens=1 if whole else g.page_size,
            to_pool=to_pool,
            stream=stream,
        )

    def units(
        self,
        bufs: I64,
        units: I64,
        lo: int,
        hi: int,
        block: int,
        unit: int,
        *,
        to_pool: bool,
        stream: Any,
    ) -> None:
        """See :meth:`PoolMoves.units`."""
        g = self.geometry
        whole = hi - lo == g.row
        self.copier.copy_units(
            g.addrs[np.asarray(bufs, dtype=np.int64)],
            np.asarray(units, dtype=np.int64),
            block,
            slot_bytes=g.slot_bytes,
            per_page=g.page_size // unit,
            unit_bytes=unit * g.row,
            lo=lo,
            row=g.row,
            n=unit * g.row if whole else hi - lo,
            tokens=1 if whole else unit,
            to_pool=to_pool,
            stream=stream,
        )


@dataclass(frozen=True)
class HeadMajorMoves:
    """Head-major pages: one launch of the head-major mover per call, pages being units of a
    whole page. ``[lo, hi)`` must be whole heads (the staged slices are)."""

    geometry: PoolGeometry
    copier: HeadCopier

    def compiling(self) -> AbstractContextManager[list[Any]]:
        """See :meth:`PoolMoves.compiling`."""
        return self.copier.compiling()

    def pages(
        self, bufs: I64, pages: I64, lo: int, hi: int, block: int, *, to_pool: bool, stream: Any
    ) -> None:
        """See :meth:`PoolMoves.pages`."""
        self.units(bufs, pages, lo, hi, block, self.geometry.page_size, to_pool=to_pool,
                   stream=stream)  # fmt: skip

    def units(
        self,
        bufs: I64,
        units: I64,
        lo: int,
        hi: int,
        block: int,
        unit: int,
        *,
        to_pool: bool,
        stream: Any,
    ) -> None:
        """See :meth:`PoolMoves.units`. One head's tokens of a unit are contiguous in a
        head-major slot, so a single head moves as one piece per unit."""
        g = self.geometry
        hb = g.head_bytes
        if lo % hb or hi % hb:
            raise ValueError(f"bytes [{lo}, {hi}) of a token row are not whole heads of {hb} bytes")
        heads = (hi - lo) // hb
        one = heads == 1  # the block's [token, head bytes] of one head = the pool's run
        self.copier.copy_heads(
            g.addrs[np.asarray(bufs, dtype=np.int64)],
            np.asarray(units, dtype=np.int64),
            block,
            slot_bytes=g.slot_bytes,
            per_page=g.page_size // unit,
            unit_bytes=unit * hb,
            lo=lo // hb * g.page_size * hb,
            head_stride=g.page_size * hb,
            token_stride=unit * hb if one else hb,
            n=unit * hb if one else hb,
            heads=heads,
            tokens=1 if one else unit,
            to_pool=to_pool,
            stream=stream,
        )


def fused_moves(geometry: PoolGeometry, device: Any, *, head_major: bool) -> PoolMoves | None:
    """The fused moves of a pool on ``device`` (``"cpu"``: Triton's interpreter, for tests),
    for head-major pages or token-major ones; None where Triton is not installed."""
    try:
        if head_major:
            from kvwire.movers.triton_heads import HeadCopier

            return HeadMajorMoves(geometry, HeadCopier(device))
        from kvwire.movers.triton_units import UnitCopier

        return TokenMajorMoves(geometry, UnitCopier(device))
    except ImportError:
        return None
