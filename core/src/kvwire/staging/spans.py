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

A chunk's last block is often partly filled (a 2 MiB request staged at TP 2 -> 1 is 1 MiB a
prefill rank, in a block of 8 MiB at the GPU sizes): writing the whole block moved up to 8x
the chunk's bytes over the link (the cross-host path staging exists for). So each side's
table also holds ``tails`` rows at every block position, of ``block >> 1`` down to
``block >> tails`` bytes (no smaller than :data:`MIN_TAIL_BYTES`), and a chunk's partly
filled last block moves as the smallest such row that covers its bytes (at most twice them,
down to the smallest tail). Prefill builds both sides' tables from decode's ring description,
so nothing changes on the wire; decode reads only the chunk's bytes of a block either way.

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


#: The smallest tail row (bytes): a chunk's last block moves as at least this much.
MIN_TAIL_BYTES = 4096


def order_for(blocks_per_chunk: int) -> int:
    """The largest span order a chunk of at most ``blocks_per_chunk`` blocks can use."""
    return max(0, int(blocks_per_chunk).bit_length() - 1)


def tails_for(block: int) -> int:
    """How many tail sizes (``block >> 1`` .. ``block >> tails``) blocks of ``block`` bytes
    get: halvings while the tail stays at least :data:`MIN_TAIL_BYTES` and whole bytes."""
    tails = 0
    while block % (2 << tails) == 0 and block >> (tails + 1) >= MIN_TAIL_BYTES:
        tails += 1
    return tails


@dataclass(frozen=True)
class Spans:
    """One side's span rows: ``nblocks`` blocks, spans of ``2**k`` blocks for ``k <= order``
    (no span runs past the last block), then ``tails`` rows per block position of the
    block's first ``block >> j`` bytes, ``j = 1 .. tails``."""

    nblocks: int
    order: int
    tails: int = 0

    def rows(self, k: int) -> int:
        """Rows of order ``k``: one per position ``0 .. nblocks - 2**k``."""
        return max(0, self.nblocks - (1 << k) + 1)

    @cached_property
    def offsets(self) -> I64:
        """Index of the first row of each order."""
        counts = [self.rows(k) for k in range(self.order + 1)]
        return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)

    @cached_property
    def tail_offsets(self) -> I64:
        """Index of the first tail row of each size ``j = 1 .. tails`` (entry ``j - 1``)."""
        first = sum(self.rows(k) for k in range(self.order + 1))
        return first + self.nblocks * np.arange(self.tails, dtype=np.int64)

    def table(self, base: int, block: int, device: int) -> DescTable:
        """The descriptor table of this side's memory at ``base`` (blocks of ``block``
        bytes on ``device``): every span row, order by order, then the tail rows."""
        addrs, lens = [], []
        for k in range(self.order + 1):
            pos = np.arange(self.rows(k), dtype=np.uint64)
            addrs.append(np.uint64(base) + pos * np.uint64(block))
            lens.append(np.full(pos.size, block << k, dtype=np.uint64))
        pos = np.arange(self.nblocks, dtype=np.uint64)
        for j in range(1, self.tails + 1):
            addrs.append(np.uint64(base) + pos * np.uint64(block))
            lens.append(np.full(pos.size, block >> j, dtype=np.uint64))
        return make_table(np.concatenate(addrs), np.concatenate(lens), device)


def span_rows(
    src: Spans, dst: Spans, src_blocks: I64, dst_blocks: I64, last: float = 1.0
) -> tuple[I64, I64]:
    """The span rows that move blocks ``src_blocks`` to ``dst_blocks`` (equal lengths, block
    ``i`` of one to block ``i`` of the other): each run that is consecutive on both sides
    becomes one row per set bit of its length, largest first. The loop is per run and bit
    (a chunk has one run, a layer-wise chunk one per layer group), never per block.
    ``last``: the share of the last block the chunk fills (in ``(0, 1]``); below one half,
    and with tail rows on both sides, that block moves as the smallest tail row that covers
    it (its first ``block >> j`` bytes)."""
    s = np.asarray(src_blocks, dtype=np.int64)
    d = np.asarray(dst_blocks, dtype=np.int64)
    if s.size == 0:
        return s, d
    j = 0
    while j < min(src.tails, dst.tails) and last <= 0.5 ** (j + 1):
        j += 1
    if j:  # the last block as a tail row, the others as spans
        rs, rd = span_rows(src, dst, s[:-1], d[:-1])
        ts = np.array([src.tail_offsets[j - 1] + s[-1]], dtype=np.int64)
        td = np.array([dst.tail_offsets[j - 1] + d[-1]], dtype=np.int64)
        return np.concatenate([rs, ts]), np.concatenate([rd, td])
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
