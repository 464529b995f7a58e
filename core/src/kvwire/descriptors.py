"""Descriptor tables and index arrays: the vocabulary between mappers and backends.

A descriptor table is an ``N x 3`` ``uint64`` NumPy array of ``(addr, len, device_id)`` rows.
A chunk's transfer is two equally long ``int64`` index arrays: row ``src_idx[i]`` of the source
table is copied to row ``dst_idx[i]`` of the destination table. All checks here are vectorised.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvwire.errors import DescriptorError
from kvwire.layout import MemoryRegion

DescTable = NDArray[np.uint64]
IndexArray = NDArray[np.int64]

ADDR, LEN, DEV = 0, 1, 2


def make_table(addr: ArrayLike, length: ArrayLike, device: ArrayLike = 0) -> DescTable:
    """Stack address, length and device columns into an ``N x 3`` ``uint64`` table."""
    a = np.asarray(addr, dtype=np.uint64).ravel()
    n = a.shape[0]
    table = np.empty((n, 3), dtype=np.uint64)
    table[:, ADDR] = a
    table[:, LEN] = np.broadcast_to(np.asarray(length, dtype=np.uint64), (n,))
    table[:, DEV] = np.broadcast_to(np.asarray(device, dtype=np.uint64), (n,))
    return table


def check_table(table: object, what: str = "descriptor table") -> DescTable:
    """Return ``table`` if it is a well-formed descriptor table, else raise DescriptorError."""
    if not isinstance(table, np.ndarray):
        raise DescriptorError(f"{what} must be a NumPy array, got {type(table).__name__}")
    if table.ndim != 2 or table.shape[1] != 3:
        raise DescriptorError(f"{what} must have shape (N, 3), got {table.shape}")
    if table.dtype != np.uint64:
        raise DescriptorError(f"{what} must have dtype uint64, got {table.dtype}")
    if table.shape[0] == 0:
        raise DescriptorError(f"{what} is empty")
    lens = table[:, LEN]
    if not lens.all():
        raise DescriptorError(f"{what} has {int((lens == 0).sum())} zero-length rows")
    if (table[:, ADDR] + lens < table[:, ADDR]).any():
        raise DescriptorError(f"{what} has rows whose end overflows 64 bits")
    return table


def check_indices(idx: object, size: int, what: str, unit: str = "rows") -> IndexArray:
    """Coerce ``idx`` to a 1-D ``int64`` array and check every entry is in ``[0, size)``.

    ``unit`` names what ``size`` counts, for the error message (table rows, page slots).
    """
    arr = np.asarray(idx)
    if arr.ndim != 1:
        raise DescriptorError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype != np.int64:  # the transfer path's arrays are int64 already
        if arr.size and arr.dtype.kind not in "iu":
            raise DescriptorError(f"{what} must hold integers, got {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)  # a uint64 past int64 turns negative: refused
    # one pass for both bounds: a negative entry is a huge unsigned one
    if arr.size and int(arr.view(np.uint64).max()) >= size:
        lo, hi = int(arr.min()), int(arr.max())
        raise DescriptorError(
            f"{what} out of range: values span [{lo}, {hi}] but there are {size} {unit}"
        )
    return arr


def require_inside(table: DescTable, regions: Sequence[MemoryRegion], what: str) -> None:
    """Raise DescriptorError naming the first row of ``table`` outside ``regions``."""
    bad = outside_regions(table, regions)
    if bad.any():
        i = int(np.argmax(bad))
        raise DescriptorError(
            f"{what}: {int(bad.sum())} rows lie outside the registered regions (first: row "
            f"{i}, addr {int(table[i, ADDR]):#x}, len {int(table[i, LEN])})"
        )


def locate_rows(
    starts: NDArray[np.uint64],
    ends: NDArray[np.uint64],
    addr: NDArray[np.uint64],
    lens: NDArray[np.uint64],
) -> NDArray[np.int64]:
    """Index of the region (``starts`` sorted, non-overlapping) that holds each whole row,
    or -1 where a row is not entirely inside one region (or its end overflows 64 bits)."""
    if starts.size == 0:
        return np.full(addr.shape, -1, dtype=np.int64)
    pos = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
    p = np.clip(pos, 0, None)
    end = addr + lens
    inside = (pos >= 0) & (end <= ends[p]) & (end >= addr)
    return np.where(inside, pos, -1)


def outside_regions(table: DescTable, regions: Sequence[MemoryRegion]) -> NDArray[np.bool_]:
    """Mask of table rows that are not entirely inside one of ``regions`` (same device)."""
    order = sorted(regions, key=lambda r: r.addr)
    starts = np.array([r.addr for r in order], dtype=np.uint64)
    ends = np.array([r.end for r in order], dtype=np.uint64)
    devs = np.array([r.device_id for r in order], dtype=np.uint64)
    pos = locate_rows(starts, ends, table[:, ADDR], table[:, LEN])
    bad: NDArray[np.bool_] = pos < 0
    if order:
        bad |= table[:, DEV] != devs[np.clip(pos, 0, None)]
    return bad
