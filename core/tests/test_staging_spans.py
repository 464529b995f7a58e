"""Span rows of bulk staging's tables (:mod:`kvwire.staging.spans`): moving a chunk's blocks
through span rows writes exactly what one row per block writes, with one row per run and set
bit of its length."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.descriptors import ADDR, LEN
from kvwire.staging.spans import Spans, order_for, span_rows, tails_for

BLOCK = 16


def _apply(table_s: np.ndarray, table_d: np.ndarray, rs: np.ndarray, rd: np.ndarray,
           src: np.ndarray, dst: np.ndarray) -> None:  # fmt: skip
    """Copy rows ``rs`` of the source table to rows ``rd`` of the destination table, the
    tables' addresses being offsets into ``src`` and ``dst``."""
    for i, j in zip(rs.tolist(), rd.tolist(), strict=True):
        n = int(table_s[i, LEN])
        assert n == int(table_d[j, LEN]), "paired rows differ in length"
        a, b = int(table_s[i, ADDR]), int(table_d[j, ADDR])
        dst[b : b + n] = src[a : a + n]


def test_order_for() -> None:
    assert [order_for(n) for n in (0, 1, 2, 3, 16, 17, 31, 32)] == [0, 0, 1, 1, 4, 4, 4, 5]


@pytest.mark.parametrize("seed", range(40))
def test_span_rows_move_what_block_rows_move(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ns, nd = int(rng.integers(1, 70)), int(rng.integers(1, 70))
    order = int(rng.integers(0, 7))
    src, dst = Spans(ns, order), Spans(nd, order)
    ts, td = src.table(0, BLOCK, 0), dst.table(0, BLOCK, 0)
    assert ts.shape[0] == sum(max(0, ns - (1 << k) + 1) for k in range(order + 1))
    # a chunk: runs of consecutive blocks on both sides (a layer-wise chunk's groups), or a
    # scattered pick
    count = int(rng.integers(0, min(ns, nd) + 1))
    s0, d0 = int(rng.integers(0, ns - count + 1)), int(rng.integers(0, nd - count + 1))
    sb, db = np.arange(s0, s0 + count), np.arange(d0, d0 + count)
    if seed % 3 == 0 and count:
        keep = np.sort(rng.choice(count, size=int(rng.integers(1, count + 1)), replace=False))
        sb, db = sb[keep], db[keep]
    memory = rng.integers(0, 256, ns * BLOCK, dtype=np.uint8)
    want = np.zeros(nd * BLOCK, dtype=np.uint8)
    got = np.zeros_like(want)
    _apply(ts, td, sb, db, memory, want)  # order-0 rows are the block positions
    rs, rd = span_rows(src, dst, sb, db)
    _apply(ts, td, rs, rd, memory, got)
    assert np.array_equal(got, want)
    if count and seed % 3:  # one run: a row per set bit of its length (bounded by the order)
        top = 1 << order
        assert rs.size == count // top + bin(count % top).count("1")


def test_a_full_buffer_is_one_row() -> None:
    """The GPU sizes: 128 MiB buffers of 8 MiB blocks (16 blocks), a 1 GiB ring."""
    order = order_for(16)
    src, dst = Spans(128, order), Spans(128, order)
    rs, rd = span_rows(src, dst, np.arange(32, 48), np.arange(100, 116))
    assert rs.size == rd.size == 1
    assert src.table(0, 8 << 20, 0)[rs[0], LEN] == 128 << 20
    rs, _ = span_rows(src, dst, np.arange(0, 13), np.arange(5, 18))  # 13 = 8 + 4 + 1
    assert rs.size == 3


@pytest.mark.parametrize("seed", range(30))
def test_a_partly_filled_last_block_moves_as_the_smallest_tail_that_covers_it(seed: int) -> None:
    """A chunk of ``nbytes`` over its blocks: its bytes all arrive, the rows move at most
    twice the last block's bytes in it (down to the smallest tail) and never past it, and
    nothing beyond the chunk's last block is written."""
    rng = np.random.default_rng(100 + seed)
    block, tails = 64, 3  # tails of 32, 16 and 8 bytes
    ns, nd = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    order = int(rng.integers(0, 5))
    src, dst = Spans(ns, order, tails), Spans(nd, order, tails)
    ts, td = src.table(0, block, 0), dst.table(0, block, 0)
    count = int(rng.integers(1, min(ns, nd) + 1))
    s0, d0 = int(rng.integers(0, ns - count + 1)), int(rng.integers(0, nd - count + 1))
    nbytes = (count - 1) * block + int(rng.integers(1, block + 1))
    r = nbytes - (count - 1) * block
    memory = rng.integers(0, 256, ns * block, dtype=np.uint8)
    got = np.zeros(nd * block, dtype=np.uint8)
    rs, rd = span_rows(src, dst, np.arange(s0, s0 + count), np.arange(d0, d0 + count), r / block)
    _apply(ts, td, rs, rd, memory, got)
    a, b = s0 * block, d0 * block
    assert np.array_equal(got[b : b + nbytes], memory[a : a + nbytes])
    moved = int(ts[rs, LEN].sum())
    tail = moved - (count - 1) * block
    assert r <= tail <= max(2 * r, block >> tails) and tail <= block
    assert not got[b + (count - 1) * block + tail :].any() and not got[:b].any()


def test_tail_sizes_of_the_gpu_blocks() -> None:
    """8 MiB blocks: tails down to 4 KiB; a 1 MiB tail moves 1 MiB, a 1.5 MiB one 2 MiB,
    a full block as one; the host's 64 KiB blocks get four tails."""
    assert tails_for(8 << 20) == 11 and tails_for(64 << 10) == 4 and tails_for(3 << 20) == 9
    assert tails_for(4096) == 0 and tails_for(1000) == 0
    src = dst = Spans(128, order_for(16), tails_for(8 << 20))
    table = src.table(0, 8 << 20, 0)
    for share, want in ((1 / 8, 1 << 20), (1.5 / 8, 2 << 20), (1.0, 8 << 20), (1e-6, 4 << 10)):
        rs, _ = span_rows(src, dst, np.arange(3, 4), np.arange(7, 8), share)
        assert int(table[rs[-1], LEN]) == want, share
