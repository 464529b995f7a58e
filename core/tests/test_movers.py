"""The fused run mover's planning and reference movers (CPU), and the Triton kernel itself
through Triton's interpreter (CPU memory, ``TRITON_INTERPRET=1`` in a subprocess).

The oracle is a naive byte-by-byte copy; every property runs on fresh random memory, so an
unwritten or misplaced byte shows.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.movers import (
    as_runs,
    copy_runs_reference,
    copy_tiles_reference,
    element_width,
    merge_adjacent,
    plan_tiles,
)
from kvwire.testing.interpreted import run_interpreted

MEM = 1 << 16


def naive_copy(mem: np.ndarray, src: np.ndarray, dst: np.ndarray, n: np.ndarray) -> None:
    for s, d, k in zip(src.tolist(), dst.tolist(), n.tolist(), strict=True):
        for i in range(k):
            mem[d + i] = mem[s + i]


@st.composite
def run_lists(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint runs: sources in the lower half of memory, destinations in the upper half,
    each side cut into non-overlapping slots; an alignment shared by all (or not)."""
    align = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    count = draw(st.integers(0, 24))
    slot = MEM // 2 // 32
    lens = np.array(
        [draw(st.integers(0, (slot - 32) // align)) * align for _ in range(count)], dtype=np.int64
    )
    src_slots = np.array(draw(st.permutations(range(32)))[:count], dtype=np.int64)
    dst_slots = np.array(draw(st.permutations(range(32)))[:count], dtype=np.int64)
    shift = draw(st.integers(0, 31 // align)) * align
    src = src_slots * slot + shift
    dst = MEM // 2 + dst_slots * slot + draw(st.integers(0, 31 // align)) * align
    # Sometimes make runs continue each other on both sides (they get merged).
    if count >= 2 and draw(st.booleans()):
        # Both runs inside the first slot of each side (shift <= 31 + two halves <= slot - 32).
        half = (slot - 32) // 2 // align * align
        lens = np.minimum(lens[:2], half)
        src, dst = src[:2], dst[:2]
        src[1] = src[0] + lens[0]
        dst[1] = dst[0] + lens[0]
    return src, dst, lens


@settings(max_examples=150, deadline=None)
@given(runs=run_lists(), tile_pow=st.integers(4, 12), seed=st.integers(0, 2**32 - 1))
def test_plan_and_references_match_byte_copy(
    runs: tuple[np.ndarray, np.ndarray, np.ndarray], tile_pow: int, seed: int
) -> None:
    src, dst, n = runs
    rng = np.random.default_rng(seed)
    mem = rng.integers(0, 256, MEM, dtype=np.uint8)
    want = mem.copy()
    naive_copy(want, src, dst, n)

    got = mem.copy()
    assert copy_runs_reference(got, src, dst, n) == int(n.sum())
    assert np.array_equal(got, want)

    plan = plan_tiles(src, dst, n, 1 << tile_pow)
    assert plan.total_bytes == int(n.sum())
    assert (plan.elems > 0).all()
    assert (plan.elems * plan.width <= plan.tile_bytes).all()
    assert not (plan.src % plan.width).any() and not (plan.dst % plan.width).any()
    tiles = mem.copy()
    assert copy_tiles_reference(tiles, plan) == int(n.sum())
    assert np.array_equal(tiles, want)


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.integers(0, 2**40), min_size=1, max_size=30),
    max_pow=st.integers(0, 5),
)
def test_element_width_is_largest_common_power_of_two(values: list[int], max_pow: int) -> None:
    a = np.array(values, dtype=np.int64)
    w = element_width(a, a[::-1].copy(), a, 1 << max_pow)
    assert w <= 1 << max_pow and w & (w - 1) == 0
    assert all(v % w == 0 for v in values)
    if w < 1 << max_pow:
        assert any(v % (2 * w) for v in values)


def test_merge_adjacent_merges_continuing_runs_and_drops_empty() -> None:
    s = np.array([0, 10, 20, 100, 200], dtype=np.int64)
    d = np.array([1000, 1010, 1025, 1100, 1200], dtype=np.int64)
    n = np.array([10, 10, 5, 0, 7], dtype=np.int64)
    ms, md, mn = merge_adjacent(s, d, n)
    assert ms.tolist() == [0, 20, 200] and md.tolist() == [1000, 1025, 1200]
    assert mn.tolist() == [20, 5, 7]


def test_bad_runs_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        as_runs([0, 1], [0], [1, 1])
    with pytest.raises(ValueError, match="non-negative"):
        as_runs([0], [8], [-1])
    with pytest.raises(ValueError, match="power of two"):
        plan_tiles([0], [64], [16], tile_bytes=24)
    with pytest.raises(ValueError, match="past the end"):
        copy_runs_reference(np.zeros(64, np.uint8), [0], [60], [8])


def test_plan_of_a_large_run_list_is_vectorised() -> None:
    """32 layers x K/V x 256 pages of 32 KiB (the issue's model, 512 MiB): planned with NumPy
    in one pass; tiles cover every run once."""
    runs = 64 * 256
    src = np.arange(runs, dtype=np.int64) * (64 << 10)
    dst = (1 << 40) + np.arange(runs, dtype=np.int64)[::-1] * (64 << 10)
    plan = plan_tiles(src, dst, np.full(runs, 32 << 10), 16 << 10)
    assert plan.width == 16 and plan.num_tiles == 2 * runs
    assert plan.total_bytes == runs * (32 << 10)
    # With the default 64 KiB tiles every 32 KiB run is one tile: no expansion at all.
    whole = plan_tiles(src, dst, np.full(runs, 32 << 10))
    assert whole.num_tiles == runs and np.array_equal(whole.src, src)


_KERNEL_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from kvwire.movers import copy_runs_reference, plan_tiles
    from kvwire.movers.triton_copy import RunCopier, launch_plan
    rng = np.random.default_rng(1)
    for align in (16, 8, 4, 2, 1):
        mem = torch.from_numpy(rng.integers(0, 256, 1 << 18, dtype=np.uint8))
        want = mem.numpy().copy()
        count = 48
        src = rng.permutation(count) * 2048 + align
        dst = (1 << 17) + rng.permutation(count) * 2048 + 3 * align
        n = rng.integers(1, 2000 // align, count) * align
        copy_runs_reference(want, src, dst, n)
        base = mem.data_ptr()
        plan = RunCopier("cpu", tile_bytes=256).copy(src + base, dst + base, n)
        assert plan.width == min(align, 16), (plan.width, align)
        assert np.array_equal(mem.numpy(), want), align
    # Default tiles (64 KiB): runs up to 20 KB are one tile each, copied in 8 KiB steps.
    mem = torch.from_numpy(rng.integers(0, 256, 1 << 20, dtype=np.uint8))
    want = mem.numpy().copy()
    src = rng.permutation(24) * 20480 + 16
    dst = (1 << 19) + rng.permutation(24) * 20480 + 48
    n = rng.integers(1, 20000 // 16, 24) * 16
    copy_runs_reference(want, src, dst, n)
    plan = RunCopier("cpu").copy(src + mem.data_ptr(), dst + mem.data_ptr(), n)
    assert plan.num_tiles == 24 and int(n.max()) > 8192
    assert np.array_equal(mem.numpy(), want)
    print("KERNEL-OK")
    """
)


def test_triton_kernel_in_interpreter_copies_every_byte() -> None:
    """The Triton kernel itself (not a stand-in), run by Triton's CPU interpreter over host
    memory for every element width; compared with the reference mover."""
    pytest.importorskip("triton")
    run_interpreted(_KERNEL_CHECK, "KERNEL-OK")


_PAGES_CHECK = textwrap.dedent(
    """
    import numpy as np
    from kvwire.movers.triton_pages import PageCopier
    rng = np.random.default_rng(2)
    mover = PageCopier("cpu")
    # buffers of [slots, page, row] bytes; rows of 48, 64 and 13 bytes (widths 16, 16, 1)
    for row, page, lo, hi, pad in ((64, 4, 0, 64, 0), (64, 4, 16, 48, 16), (48, 2, 8, 40, 8),
                                   (13, 3, 0, 13, 3), (13, 3, 5, 9, 1)):
        slots, nbuf = 9, 5
        raw = [rng.integers(0, 256, slots * page * row + 64, dtype=np.uint8) for _ in range(nbuf)]
        bufs = [r[pad : pad + slots * page * row].reshape(slots, page, row) for r in raw]
        addrs = np.array([b.ctypes.data for b in bufs], dtype=np.int64)
        pages = rng.permutation(slots)[:4]
        pick = np.array([3, 0, 2])  # buffers, any order
        whole = hi - lo == row
        n, tokens = (page * row, 1) if whole else (hi - lo, page)
        block = np.zeros(pick.size * pages.size * page * (hi - lo) + 32, dtype=np.uint8)
        out = block[16:]
        want = np.stack([bufs[b][pages][:, :, lo:hi] for b in pick]).reshape(-1)
        mover.copy(addrs[pick], pages, out.ctypes.data, slot_bytes=page * row, lo=lo, row=row,
                   n=n, tokens=tokens, to_pool=False)
        assert np.array_equal(out[: want.size], want), (row, lo, hi)
        assert not out[want.size :].any() and not block[:16].any(), "wrote past the block"
        # scatter a fresh block into other pages; everything else stays
        before = [b.copy() for b in bufs]
        fresh = rng.integers(0, 256, want.size, dtype=np.uint8)
        out[: want.size] = fresh
        dst_pages = rng.permutation(slots)[:4]
        mover.copy(addrs[pick], dst_pages, out.ctypes.data, slot_bytes=page * row, lo=lo,
                   row=row, n=n, tokens=tokens, to_pool=True)
        got = np.stack([bufs[b][dst_pages][:, :, lo:hi] for b in pick]).reshape(-1)
        assert np.array_equal(got, fresh), (row, lo, hi)
        for b in range(nbuf):
            keep = before[b].copy()
            if b in pick:
                keep[dst_pages, :, lo:hi] = bufs[b][dst_pages, :, lo:hi]
            assert np.array_equal(bufs[b], keep), ("touched bytes outside", b)
    print("PAGES-OK")
    """
)


def test_page_mover_in_interpreter_gathers_and_scatters_pages_and_slices() -> None:
    """The page mover's Triton kernel (bulk staging's gather and scatter), run by Triton's
    CPU interpreter over host memory: whole pages and token-row slices, aligned and not, into
    a block laid out ``[buffer, page, token, bytes]`` and back into other pages, every byte
    compared with NumPy and nothing outside the selection touched."""
    pytest.importorskip("triton")
    run_interpreted(_PAGES_CHECK, "PAGES-OK")
