"""Descriptor tables of block spans for bulk staging: a staged chunk in one or two descriptors.

A staged chunk occupies consecutive blocks of a prefill buffer and of decode's ring. With one
table row per block, a 128 MiB chunk of 8 MiB blocks was 16 descriptors, and a NIXL post
costs per descriptor (UCX's ``cuda_ipc`` issues a copy per descriptor): on two H200s
``transfer`` took 0.16-0.22 ms of the prefill worker per 128 MiB request, its polls 0.11-0.17
(session 21 samples). So each side's table holds, for every order ``k`` up to ``order``, a row
of ``2**k`` blocks at every block position: a run of ``n`` blocks is one row per set bit of
``n`` (one row when ``n`` is a power of two: a full 128 MiB buffer), and source and
destination rows of a run pair up by size. Order 0 is the old one-row-per-block table (its
rows come first, at their block positions), so index arithmetic is the same for both sides;
each side's rows of order ``k`` start at its own offset (its block counts differ).

Built by :meth:`kvwire.staging.bulk.BulkStaging.link_staging` (prefill, handshake), read by
the writer's plans (:class:`kvwire.staging.bulk_writer.WriterSide`). NumPy only; immutable.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numpy.typing import NDArray

from kvwire.descriptors import DescTable, make_table

I64 = NDArray[np.int64]


def order_for(blocks_per_chunk: int) -> int:
    """The largest span order a chunk of at most ``blocks_per_chunk`` blocks can use."""
    return max(0, int(blocks_per_chunk).bit_length() - 1)


@dataclass(frozen=True)
class Spans:
    """One side's span rows: ``nblocks`` blocks, spans of ``2**k`` blocks for ``k <= order``
    (no span runs past the last block)."""

    nblocks: int
    order: int

    def rows(self, k: int) -> int:
        """Rows of order ``k``: one per position ``0 .. nblocks - 2**k``."""
        return max(0, self.nblocks - (1 << k) + 1)

    @cached_property
    def offsets(self) -> I64:
        """Index of the first row of each order."""
        counts = [self.rows(k) for k in range(self.order + 1)]
        return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)

    def table(self, base: int, block: int, device: int) -> DescTable:
        """The descriptor table of this side's memory at ``base`` (blocks of ``block``
        bytes on ``device``): every span row, order by order."""
        addrs, lens = [], []
        for k in range(self.order + 1):
            pos = np.arange(self.rows(k), dtype=np.uint64)
            addrs.append(np.uint64(base) + pos * np.uint64(block))
            lens.append(np.full(pos.size, block << k, dtype=np.uint64))
        return make_table(np.concatenate(addrs), np.concatenate(lens), device)


def span_rows(src: Spans, dst: Spans, src_blocks: I64, dst_blocks: I64) -> tuple[I64, I64]:
    """The span rows that move blocks ``src_blocks`` to ``dst_blocks`` (equal lengths, block
    ``i`` of one to block ``i`` of the other): each run that is consecutive on both sides
    becomes one row per set bit of its length, largest first. The loop is per run and bit
    (a chunk has one run, a layer-wise chunk one per layer group), never per block."""
    s = np.asarray(src_blocks, dtype=np.int64)
    d = np.asarray(dst_blocks, dtype=np.int64)
    if s.size == 0:
        return s, d
    order = min(src.order, dst.order)
    cuts = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate([[0], cuts])
    lengths = np.diff(np.concatenate([starts, [s.size]]))
    so, do = src.offsets, dst.offsets
    out_s: list[int] = []
    out_d: list[int] = []
    for i, n in zip(starts.tolist(), lengths.tolist(), strict=True):
        a, b = int(s[i]), int(d[i])
        while n:
            k = min(order, n.bit_length() - 1)
            out_s.append(int(so[k]) + a)
            out_d.append(int(do[k]) + b)
            a, b, n = a + (1 << k), b + (1 << k), n - (1 << k)
    return np.asarray(out_s, dtype=np.int64), np.asarray(out_d, dtype=np.int64)
