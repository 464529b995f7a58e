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
    expand_groups,
    merge_adjacent,
    plan_groups,
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


def head_slice_runs(
    rng: np.random.Generator, nbuf: int, pages: int, tokens: int, row: int, lo: int, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The run list of a head slice moved page to page (heterogeneous TP): for every buffer
    and page (random page order on both sides), bytes ``[lo, lo + n)`` of each source token
    row into bytes ``[0, n)`` of the destination's narrower rows (``n`` apart)."""
    slots = 2 * pages
    sp, dp = rng.permutation(slots)[:pages], rng.permutation(slots)[:pages]
    b = np.arange(nbuf)[:, None, None]
    t = np.arange(tokens)[None, None, :]
    src = ((b * slots + sp[None, :, None]) * tokens + t) * row + lo
    dst = (1 << 30) + ((b * slots + dp[None, :, None]) * tokens + t) * n
    size = src.size
    return src.ravel(), dst.ravel(), np.full(size, n, dtype=np.int64)


@settings(max_examples=100, deadline=None)
@given(
    nbuf=st.integers(1, 6),
    pages=st.integers(1, 9),
    tokens=st.integers(4, 16),
    row_n=st.sampled_from([(64, 32), (2048, 1024), (48, 16), (13, 5), (4096, 512)]),
    seed=st.integers(0, 2**32 - 1),
)
def test_head_slices_group_per_page_and_expand_to_the_same_runs(
    nbuf: int, pages: int, tokens: int, row_n: tuple[int, int], seed: int
) -> None:
    """A head slice of every token row of a page is one group (one GPU program) at most, and
    the groups expand back to exactly the run list, in order."""
    row, n = row_n
    rng = np.random.default_rng(seed)
    lo = int(rng.integers(0, row - n + 1))
    src, dst, lens = head_slice_runs(rng, nbuf, pages, tokens, row, lo, n)
    plan = plan_groups(src, dst, lens, min_gain=2)
    assert plan is not None
    # at most one group per (buffer, page): two pages that follow each other on both sides
    # continue one group
    assert plan.num_groups <= nbuf * pages and (plan.count % tokens == 0).all()
    assert plan.src_stride == row and plan.dst_stride == n
    for got, want in zip(expand_groups(plan), (src, dst, lens), strict=True):
        assert np.array_equal(got, want)
    assert plan.total_bytes == int(lens.sum())
    assert src[0] % plan.width == 0 and n % plan.width == 0 and row % plan.width == 0


@settings(max_examples=150, deadline=None)
@given(runs=run_lists(), same_len=st.booleans())
def test_grouping_any_run_list_is_refused_or_exact(
    runs: tuple[np.ndarray, np.ndarray, np.ndarray], same_len: bool
) -> None:
    """Any run list: plan_groups either refuses it (None: the tile plan copies it) or its
    groups expand to exactly the runs; a list of runs of different lengths is refused."""
    src, dst, lens = runs
    if same_len and lens.size:
        lens = np.full(lens.size, max(int(lens.min()), 1), dtype=np.int64)
    plan = plan_groups(src, dst, lens, min_gain=1)
    keep = lens > 0
    if plan is None:
        return
    assert len(set(lens[keep].tolist())) == 1
    for got, want in zip(expand_groups(plan), (src[keep], dst[keep], lens[keep]), strict=True):
        assert np.array_equal(got, want)


def test_grouping_refuses_overlapping_or_mixed_pieces() -> None:
    """Pieces that would overlap on the destination, or runs of two lengths, are not grouped;
    neither is a list the groups would not shrink."""
    src = np.arange(16, dtype=np.int64) * 64
    assert plan_groups(src, (1 << 20) + src // 4, np.full(16, 32)) is None  # dst stride 16 < 32
    mixed = np.full(16, 32)
    mixed[3] = 16
    assert plan_groups(src, (1 << 20) + src, mixed) is None
    scattered = np.random.default_rng(0).permutation(16) * 4096
    assert plan_groups(scattered, (1 << 20) + src, np.full(16, 32)) is None


_GROUPS_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from kvwire.movers import GroupPlan, copy_runs_reference
    from kvwire.movers.triton_copy import RunCopier
    from test_movers import head_slice_runs
    rng = np.random.default_rng(5)
    mover = RunCopier("cpu")
    for row, n, pad in ((2048, 1024, 0), (64, 32, 16), (48, 16, 8), (13, 5, 3), (256, 8, 4)):
        nbuf, pages, tokens = 3, 4, 5
        src, dst, lens = head_slice_runs(rng, nbuf, pages, tokens, row, 0, n)
        lo = int(rng.integers(0, row - n + 1)) // pad * pad if pad else 0
        src = src + lo + pad
        dst = dst - (1 << 30) + nbuf * 2 * pages * tokens * row + 64 + pad
        size = int(dst.max()) + n + 64
        mem = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
        want = mem.numpy().copy()
        copy_runs_reference(want, src, dst, lens)
        base = mem.data_ptr()
        plan = mover.move(src + base, dst + base, lens)
        assert isinstance(plan, GroupPlan) and plan.num_groups <= nbuf * pages, plan
        assert np.array_equal(mem.numpy(), want), (row, n, pad)
    # a list that does not group is copied by the tile path
    src = rng.permutation(12) * 4096
    n = rng.integers(1, 256, 12) * 16
    mem = torch.from_numpy(rng.integers(0, 256, 1 << 17, dtype=np.uint8))
    want = mem.numpy().copy()
    copy_runs_reference(want, src, (1 << 16) + src, n)
    plan = mover.move(src + mem.data_ptr(), (1 << 16) + src + mem.data_ptr(), n)
    assert not isinstance(plan, GroupPlan)
    assert np.array_equal(mem.numpy(), want)
    print("GROUPS-OK")
    """
)


def test_group_mover_in_interpreter_copies_head_slices_page_to_page() -> None:
    """The group kernel (heterogeneous TP's head slices, one program per buffer and page), run
    by Triton's CPU interpreter over host memory for every element width: every byte compared
    with the reference mover, nothing else written."""
    pytest.importorskip("triton")
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    run_interpreted(f"import sys; sys.path.insert(0, {here!r})\n" + _GROUPS_CHECK, "GROUPS-OK")
