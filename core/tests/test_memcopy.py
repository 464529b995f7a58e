"""Gather and scatter of :class:`kvwire.backends.memcopy.HostMemory` on both copy paths: one
memmove per row (few rows per (region, length) group, or long rows) and one vectorised copy
per group (many short rows); both must move exactly the rows' bytes, in row order."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.backends import memcopy
from kvwire.backends.memcopy import HostMemory
from kvwire.layout import MemoryRegion


def _regions(n: int, nbytes: int) -> tuple[list[np.ndarray], HostMemory]:
    rng = np.random.default_rng(n)
    arrs = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]
    regs = [MemoryRegion.from_pointer(a.ctypes.data, a.nbytes, 64) for a in arrs]
    return arrs, HostMemory(regs)


@pytest.mark.parametrize(
    ("regions", "rows_per_region", "row"),
    [(16, 1, 2048), (2, 64, 256), (3, 5, 16 * 1024), (4, 40, 512)],
)
def test_gather_scatter_round_trip(regions: int, rows_per_region: int, row: int) -> None:
    arrs, mem = _regions(regions, row * rows_per_region * 3)
    rng = np.random.default_rng(0)
    addr, want = [], []
    for a in arrs:
        slots = rng.choice(3 * rows_per_region, rows_per_region, replace=False)
        for s in slots:
            addr.append(a.ctypes.data + int(s) * row)
            want.append(a[int(s) * row : (int(s) + 1) * row].copy())
    order = rng.permutation(len(addr))  # rows of different regions interleaved
    addr_a = np.array(addr, dtype=np.uint64)[order]
    lens = np.full(addr_a.size, row, dtype=np.uint64)
    payload = mem.gather(addr_a, lens)
    assert payload.tobytes() == b"".join(want[i].tobytes() for i in order)
    fresh = np.random.default_rng(1).integers(0, 256, payload.size, dtype=np.uint8)
    mem.scatter(addr_a, lens, fresh)
    for k, i in enumerate(order):
        a_idx = next(
            j for j, a in enumerate(arrs) if a.ctypes.data <= addr[i] < a.ctypes.data + a.nbytes
        )
        off = addr[i] - arrs[a_idx].ctypes.data
        assert arrs[a_idx][off : off + row].tobytes() == fresh[k * row : (k + 1) * row].tobytes()


def test_path_choice_follows_rows_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row per region goes through memmove; many short rows of one region do not."""
    calls = []
    real = memcopy.ctypes.memmove
    monkeypatch.setattr(memcopy.ctypes, "memmove", lambda *a: calls.append(a) or real(*a))
    arrs, mem = _regions(16, 4096)
    lens = np.full(16, 1024, dtype=np.uint64)
    mem.gather(np.array([a.ctypes.data for a in arrs], dtype=np.uint64), lens)
    assert len(calls) == 16
    calls.clear()
    one = arrs[0].ctypes.data
    mem.gather(
        np.array([one + 64 * i for i in range(32)], dtype=np.uint64),
        np.full(32, 64, dtype=np.uint64),
    )
    assert calls == []
