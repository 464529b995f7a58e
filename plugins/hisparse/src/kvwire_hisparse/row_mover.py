"""Rows through kvwire's fused run mover (the row copier's ``mover`` VRAM path).

:class:`RowMover` queues a batch of equally long rows, given as raw source and destination
addresses the launching GPU can reach (VRAM, and the device address of the pinned shared pool),
as ONE Triton launch of :class:`kvwire.movers.triton_copy.RunCopier`: the tile table (one tile
per row, no expansion) is written straight into one of the mover's pinned table slots, which the
kernel reads over the bus, so a launch needs no upload, no device allocation and no index
tensors. Built by :class:`~kvwire_hisparse.copier.RowCopier` at construction (or by a test
around a CPU ``RunCopier`` under Triton's interpreter); :meth:`RowMover.queue` is called on a
transfer worker's thread, per batch; the mover's own lock serialises launches.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.movers.plan import DEFAULT_TILE_BYTES, MAX_WIDTH, TilePlan, plan_tiles

__all__ = ["RowMover", "row_width"]


def row_width(src: NDArray[np.int64], dst: NDArray[np.int64], row_len: int) -> int:
    """The widest access (a power of two up to ``MAX_WIDTH`` bytes) that every address of
    ``src`` and ``dst`` and ``row_len`` divide by."""
    acc = int(np.bitwise_or.reduce(src)) if src.size else 0
    acc |= int(np.bitwise_or.reduce(dst)) if dst.size else 0
    acc |= row_len | MAX_WIDTH
    return acc & -acc


class RowMover:
    """One fused launch per batch of rows of one length.

    ``mover``: a :class:`kvwire.movers.triton_copy.RunCopier` (its device launches; on a CPU
    device, Triton's interpreter copies synchronously). :attr:`max_rows` is the most rows one
    :meth:`queue` call takes with its table in a pinned slot (larger batches still work: the
    mover uploads their table, slower).
    """

    def __init__(self, mover: Any) -> None:
        self.mover = mover
        self._slot_tiles = int(getattr(mover, "_slot_tiles", 16384))
        self._lock = threading.Lock()
        #: row lengths in elements, one array per (elements, width), grown on demand
        self._elems: dict[int, NDArray[np.int64]] = {}

    def max_rows(self, row_len: int) -> int:
        """Rows per call that keep the table in one slot (rows longer than a tile are cut)."""
        per_row = max(1, -(-row_len // DEFAULT_TILE_BYTES))
        return max(1, self._slot_tiles // per_row)

    def _lengths(self, n: int, elems: int) -> NDArray[np.int64]:
        with self._lock:
            arr = self._elems.get(elems)
            if arr is None or arr.size < n:
                arr = np.full(max(n, 4096), elems, dtype=np.int64)
                self._elems[elems] = arr
        return arr[:n]

    def queue(
        self,
        src: NDArray[np.int64],
        dst: NDArray[np.int64],
        row_len: int,
        stream: Any = None,
        width: int = 0,
    ) -> None:
        """Transfer worker: enqueue the copy of row ``i`` (``row_len`` bytes) from ``src[i]``
        to ``dst[i]`` (addresses the mover's device reaches, already validated by the caller)
        on ``stream``. ``width``: the access width every address and ``row_len`` divide by
        (:func:`row_width` of a superset of these rows, found once per link); 0: found here,
        two passes over the batch. Returns once the launch is queued (on a CPU device: once
        copied)."""
        n = int(src.size)
        if n == 0:
            return
        if row_len > DEFAULT_TILE_BYTES:  # long rows: cut into tiles (rare for KV rows)
            lens = np.full(n, row_len, dtype=np.int64)
            self.mover.launch(plan_tiles(src, dst, lens, merge=False), stream)
            return
        width = width or row_width(src, dst, row_len)
        # one tile per row, the kernel's block the row rounded up to a power of two: no
        # masked-off lanes beyond that rounding
        tile = max(MAX_WIDTH, 1 << (row_len - 1).bit_length())
        plan = TilePlan(
            src=src,
            dst=dst,
            elems=self._lengths(n, row_len // width),
            width=width,
            tile_bytes=tile,
        )
        self.mover.launch(plan, stream)
