"""Gather and scatter between registered host memory and a contiguous payload.

Used by backends that move bytes through sockets (the ``tcp`` reference backend). Rows are
grouped by (region, length) with NumPy; rows shorter than :data:`LOOP_MIN_BYTES` are copied by
vectorised fancy indexing (when their groups hold :data:`LOOP_MIN_ROWS_PER_GROUP` rows on
average; else by one ``memmove`` each), longer rows by one ``memmove`` each, where the copy
itself dominates
(measured in docs/benchmarks.md: NumPy's per-element fancy copy runs at ~1.4 GB/s on this class
of machine, ``memmove`` of a large row at the machine's memory bandwidth).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from numpy.typing import NDArray

from kvwire.descriptors import locate_rows
from kvwire.layout import MemoryRegion

#: Rows at least this long are copied with one memmove each instead of fancy indexing.
LOOP_MIN_BYTES = 8 * 1024
#: Short rows are copied by one vectorised copy per (region, row length) group only when the
#: groups average at least this many rows; a group's views cost ~20 memmoves (a request of one
#: small page has a row per layer and K/V, each in its own region: a group per row).
LOOP_MIN_ROWS_PER_GROUP = 16


def region_array(region: MemoryRegion) -> NDArray[np.uint8]:
    """A writable NumPy view over a registered host region (no copy)."""
    buf = (ctypes.c_uint8 * region.length).from_address(region.addr)
    arr: NDArray[np.uint8] = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    return arr


def coalesce(
    a_addr: NDArray[np.uint64], b_addr: NDArray[np.uint64], lens: NDArray[np.uint64]
) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64]]:
    """Merge consecutive rows that are contiguous on both sides into one row."""
    if a_addr.size < 2:
        return a_addr, b_addr, lens
    cont = (a_addr[1:] == a_addr[:-1] + lens[:-1]) & (b_addr[1:] == b_addr[:-1] + lens[:-1])
    if not cont.any():
        return a_addr, b_addr, lens
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return a_addr[starts], b_addr[starts], np.add.reduceat(lens, starts)


class HostMemory:
    """The registered host regions of one agent, addressable by absolute address.

    Built by a backend from its registered regions; immutable, so a new one replaces it when
    registrations change (safe to read from an I/O thread without a lock).
    """

    def __init__(self, regions: Sequence[MemoryRegion]) -> None:
        order = sorted(regions, key=lambda r: r.addr)
        self.regions = order
        self.bases = np.array([r.addr for r in order], dtype=np.uint64)
        self.ends = np.array([r.end for r in order], dtype=np.uint64)
        self.arrays = [region_array(r) for r in order]

    def locate(self, addr: NDArray[np.uint64], lens: NDArray[np.uint64]) -> NDArray[np.int64]:
        """Region index of each row, or -1 where the row is not inside one region."""
        return locate_rows(self.bases, self.ends, addr, lens)

    def gather(self, addr: NDArray[np.uint64], lens: NDArray[np.uint64]) -> NDArray[np.uint8]:
        """Copy the rows into one contiguous payload, in row order."""
        out = np.empty(int(lens.sum()), dtype=np.uint8)
        self._copy(addr, lens, out, to_payload=True)
        return out

    def scatter(
        self,
        addr: NDArray[np.uint64],
        lens: NDArray[np.uint64],
        payload: memoryview | NDArray[np.uint8],
    ) -> None:
        """Copy a contiguous payload into the rows, in row order."""
        data = np.frombuffer(payload, dtype=np.uint8)
        if data.size != int(lens.sum()):
            raise ValueError(f"payload holds {data.size} bytes, rows need {int(lens.sum())}")
        self._copy(addr, lens, data, to_payload=False)

    def _copy(
        self,
        addr: NDArray[np.uint64],
        lens: NDArray[np.uint64],
        payload: NDArray[np.uint8],
        *,
        to_payload: bool,
    ) -> None:
        ridx = self.locate(addr, lens)
        if (ridx < 0).any():
            raise ValueError("rows outside registered memory")
        pos = np.cumsum(lens) - lens  # payload offset of each row
        # a few rows (a notification's scratch word, an aux row): memmove each, without
        # grouping them first (np.unique alone costs more than the copies)
        big = lens >= LOOP_MIN_BYTES if lens.size > LOOP_MIN_ROWS_PER_GROUP else lens >= 0
        small = ~big
        s_len = lens[small]
        keys: list[int] = []
        if s_len.size:
            s_r = ridx[small]
            # One vectorised copy per (region, row length) group: few groups, not per row.
            key = s_r * (1 << 40) + s_len.astype(np.int64)
            keys = np.unique(key).tolist()
            if s_len.size < LOOP_MIN_ROWS_PER_GROUP * len(keys):
                big, keys = np.ones_like(big), []  # groups of a few rows: memmove each row
        if big.any():
            pay_base = payload.ctypes.data
            for a, p, n in zip(
                addr[big].tolist(), pos[big].tolist(), lens[big].tolist(), strict=True
            ):
                if to_payload:
                    ctypes.memmove(pay_base + p, a, n)
                else:
                    ctypes.memmove(a, pay_base + p, n)
        if not keys:
            return
        s_off = (addr[small] - self.bases[s_r]).astype(np.int64)
        s_pos = pos[small].astype(np.int64)
        for k in keys:
            sel = key == k
            r, n = k >> 40, k & ((1 << 40) - 1)
            mem = sliding_window_view(self.arrays[r], n, writeable=not to_payload)
            pay = sliding_window_view(payload, n, writeable=to_payload)
            if to_payload:
                pay[s_pos[sel]] = mem[s_off[sel]]
            else:
                mem[s_off[sel]] = pay[s_pos[sel]]
