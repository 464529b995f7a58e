"""The token-run ("unit") mode of bulk staging's movers, for page-size conversion: units of
``unit`` tokens of a page gathered into a block ``[buffer, unit, token, bytes]`` and scattered
back into pages of another size.

* :func:`kvwire.movers.plan.unit_runs` (the NumPy reference) against a naive per-token copy;
* the CPU path of :class:`kvwire.staging.kernels.KVTensors` (NumPy indexed copies; head-major
  pages through a transpose) against the reference, for any page and unit sizes, page orders,
  head slices and fused K|V rows; a gather from pages of one size scattered into pages of
  another puts every token row where decode's pages hold it;
* the Triton kernel (:class:`kvwire.movers.triton_units.UnitCopier`) under Triton's CPU
  interpreter against the reference, nothing outside the selection touched.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.layout import ModelSpec, RankPosition
from kvwire.movers import copy_runs_reference, unit_runs
from kvwire.staging.kernels import KVTensors
from kvwire.testing.interpreted import run_interpreted
from kvwire.testing.kvfill import make_pool


def test_unit_runs_match_a_naive_token_copy() -> None:
    rng = np.random.default_rng(0)
    slots, page, row, unit, lo, hi = 5, 6, 12, 2, 4, 10
    mem = rng.integers(0, 256, 2 * slots * page * row + 4096, dtype=np.uint8)
    base = mem.ctypes.data
    addrs = np.array([0, slots * page * row], dtype=np.int64) + base
    units = np.array([7, 0, 14, 3], dtype=np.int64)  # any order, any page
    block = 2 * slots * page * row
    for whole in (True, False):
        n, tokens = (unit * row, 1) if whole else (hi - lo, unit)
        got = mem.copy()
        runs = unit_runs(addrs - base, units, block, slot_bytes=page * row,
                         per_page=page // unit, unit_bytes=unit * row,
                         lo=0 if whole else lo, row=row, n=n, tokens=tokens)  # fmt: skip
        copy_runs_reference(got, *runs)
        want = []
        for b in range(2):
            buf = mem[b * slots * page * row : (b + 1) * slots * page * row].reshape(
                slots, page, row
            )
            for u in units.tolist():
                p, k = divmod(u, page // unit)
                rows = buf[p, k * unit : (k + 1) * unit]
                want.append(rows if whole else rows[:, lo:hi])
        flat = np.concatenate([w.ravel() for w in want])
        assert np.array_equal(got[block : block + flat.size], flat)


@st.composite
def unit_cases(draw: st.DrawFn) -> dict:
    g = draw(st.sampled_from([1, 2, 3, 4]))
    pa = g * draw(st.integers(1, 4))  # two page sizes sharing the unit
    pb = g * draw(st.integers(1, 4))
    heads = draw(st.sampled_from([1, 2, 4]))
    return {
        "g": g,
        "pages": (pa, pb),
        "heads": heads,
        "hm": (draw(st.booleans()), draw(st.booleans())),
        "fused": draw(st.booleans()),
        "h0": draw(st.integers(0, heads - 1)),
        "seed": draw(st.integers(0, 2**31)),
    }


@settings(max_examples=60, deadline=None)
@given(case=unit_cases())
def test_gather_then_scatter_into_other_page_sizes(case: dict) -> None:
    """Tokens gathered by units from pages of ``pa`` tokens and scattered into pages of
    ``pb`` land where decode's pages hold them, every byte; nothing else is written; the
    token-major gather equals the NumPy reference runs."""
    g, (pa, pb), heads = case["g"], case["pages"], case["heads"]
    rng = np.random.default_rng(case["seed"])
    one = RankPosition()
    sides = []
    fused = case["fused"] and not any(case["hm"])  # fused rows: token-major on both sides
    for page, hm in zip((pa, pb), case["hm"], strict=True):
        model = ModelSpec(num_layers=2, total_kv_heads=heads, head_dim=2, dtype="int32",
                          page_size=page)  # fmt: skip
        lay, arrs = make_pool(model, one, 12, head_major=hm, kv_fused=fused)
        for a in arrs:
            a.view(np.uint8)[...] = rng.integers(0, 256, a.nbytes, dtype=np.uint8).reshape(
                a.view(np.uint8).shape
            )
        sides.append((lay, arrs, KVTensors(lay, arrs)))
    (la, aa, ka), (lb, ab, kb) = sides
    row = la.token_row_bytes
    hb = la.head_bytes
    h0 = case["h0"]
    lo, hi = h0 * hb, heads * hb  # a head slice (the whole row when h0 == 0)
    tokens = rng.permutation(12 * pa)[: 4 * g] // g * g  # starts of g-token runs
    tokens = rng.permutation(np.unique(tokens))[: 12 * min(pa, pb) // g]  # any order
    src_units = tokens // g
    dst_tokens = rng.permutation(12 * pb // g)[: src_units.size] * g
    dst_units = dst_tokens // g
    bufs = np.arange(len(la.buffers), dtype=np.int64)
    block = np.zeros((bufs.size, src_units.size, g, hi - lo), dtype=np.uint8)
    ka.gather(bufs, src_units, lo, hi, block, g)

    def token_rows(lay, arrs, buf, toks):  # [n, row] in token order, from the pool itself
        v = arrs[buf].reshape(-1).view(np.uint8)
        ps = lay.model.page_size
        if lay.head_major:
            v = v.reshape(-1, heads, ps, hb).swapaxes(1, 2)
        v = v.reshape(-1, ps, row)
        return v[toks // ps, toks % ps]

    runs = np.concatenate([t + np.arange(g) for t in tokens])
    for b in bufs.tolist():
        want = token_rows(la, aa, b, runs)[:, lo:hi]
        assert np.array_equal(block[b].reshape(-1, hi - lo), want), ("gather", b)
    if not la.head_major:  # the reference runs describe token-major pages, buffer by buffer
        whole = hi - lo == row
        for b in bufs.tolist():
            mem = aa[b].reshape(-1).view(np.uint8)
            out = np.concatenate([mem, np.zeros(block[b].size, dtype=np.uint8)])
            runs_b = unit_runs(
                [0], src_units, mem.size, slot_bytes=la.slot_bytes, per_page=pa // g,
                unit_bytes=g * row, lo=lo, row=row, n=g * row if whole else hi - lo,
                tokens=1 if whole else g)  # fmt: skip
            copy_runs_reference(out, *runs_b)
            assert np.array_equal(out[mem.size :], block[b].ravel()), ("reference", b)
    before = [a.copy() for a in ab]
    kb.scatter(bufs, dst_units, lo, hi, block, g)
    druns = np.concatenate([t + np.arange(g) for t in dst_tokens])
    for b in bufs.tolist():
        got = token_rows(lb, ab, b, druns)[:, lo:hi]
        assert np.array_equal(got, block[b].reshape(-1, hi - lo)), ("scatter", b)
        # nothing else changed: other tokens whole, written tokens outside [lo, hi)
        every = np.arange(12 * pb)
        old = token_rows(lb, before, b, every)
        new = token_rows(lb, ab, b, every)
        mask = np.zeros(every.size, dtype=bool)
        mask[druns] = True
        assert np.array_equal(old[~mask], new[~mask]), ("touched other tokens", b)
        assert np.array_equal(old[mask][:, :lo], new[mask][:, :lo])
        assert np.array_equal(old[mask][:, hi:], new[mask][:, hi:])


def test_unit_mover_in_interpreter_matches_the_reference() -> None:
    """The token-run mover's Triton kernel under Triton's CPU interpreter: units of pages
    gathered into a block and scattered into other units, whole rows and slices, aligned and
    not; every byte compared with the NumPy reference runs, nothing else touched."""
    pytest.importorskip("triton")
    run_interpreted(_UNITS_CHECK, "UNITS-OK")


_UNITS_CHECK = textwrap.dedent(
    """
    import numpy as np
    from kvwire.movers import copy_runs_reference, unit_runs
    from kvwire.movers.triton_units import UnitCopier
    rng = np.random.default_rng(3)
    mover = UnitCopier("cpu")
    # (row bytes, page tokens, unit tokens, lo, hi, pad): widths 16, 16, 8, 1, 1
    for row, page, unit, lo, hi, pad in ((64, 8, 2, 0, 64, 0), (64, 6, 3, 16, 48, 16),
                                         (48, 4, 1, 8, 40, 8), (13, 6, 2, 0, 13, 3),
                                         (13, 4, 4, 5, 9, 1)):
        slots, nbuf = 7, 4
        per = page // unit
        size = slots * page * row
        mem = rng.integers(0, 256, nbuf * (size + 64) + 4096, dtype=np.uint8)
        base = mem.ctypes.data
        offs = np.array([i * (size + 64) + pad for i in range(nbuf)], dtype=np.int64)
        pick = np.array([2, 0, 3])
        units = rng.permutation(slots * per)[:5].astype(np.int64)
        whole = hi - lo == row
        n, tokens = (unit * row, 1) if whole else (hi - lo, unit)
        blk = nbuf * (size + 64) + 16
        kw = dict(slot_bytes=page * row, per_page=per, unit_bytes=unit * row, lo=lo, row=row,
                  n=n, tokens=tokens)
        want = mem.copy()
        copy_runs_reference(want, *unit_runs(offs[pick], units, blk, **kw))
        mover.copy_units(offs[pick] + base, units, blk + base, **kw, to_pool=False)
        assert np.array_equal(mem, want), ("gather", row, unit, lo, hi)
        # scatter a fresh block into other units; compare with the reference
        total = pick.size * units.size * tokens * n
        mem[blk : blk + total] = rng.integers(0, 256, total, dtype=np.uint8)
        other = rng.permutation(slots * per)[:5].astype(np.int64)
        pool, bl, ln = unit_runs(offs[pick], other, blk, **kw)
        want = mem.copy()
        copy_runs_reference(want, bl, pool, ln)
        mover.copy_units(offs[pick] + base, other, blk + base, **kw, to_pool=True)
        assert np.array_equal(mem, want), ("scatter", row, unit, lo, hi)
    print("UNITS-OK")
    """
)


def test_kvtensors_through_the_unit_mover_in_interpreter() -> None:
    """The GPU path's wiring: :class:`KVTensors` handing units to the token-run mover (run by
    Triton's interpreter over host pools) gathers and scatters exactly what its NumPy path
    does, for whole rows and head slices, between pages of 8 and of 4 and 6 tokens."""
    pytest.importorskip("triton")
    run_interpreted(_KV_UNITS_CHECK, "KV-UNITS-OK")


_KV_UNITS_CHECK = textwrap.dedent(
    """
    import numpy as np
    from kvwire.layout import ModelSpec, RankPosition
    from kvwire.staging.kernels import KVTensors
    from kvwire.testing.kvfill import make_pool
    rng = np.random.default_rng(5)

    def pool(page):
        m = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=4, dtype="int32", page_size=page)
        lay, arrs = make_pool(m, RankPosition(), 10)
        for a in arrs:
            a[...] = rng.integers(-2**31, 2**31 - 1, a.shape, dtype=np.int64).astype(np.int32)
        return lay, arrs

    for pa, pb, g in ((8, 4, 4), (8, 6, 2), (4, 6, 1)):
        la, aa = pool(pa)
        lb, ab = pool(pb)
        lb2, ref_b = pool(pb)  # a second pool of that size, the same bytes
        for x, y in zip(ab, ref_b):
            y[...] = x
        lb_ref = KVTensors(lb2, ref_b)
        kv_a, kv_b = KVTensors(la, aa), KVTensors(lb, ab)
        kv_a.moves = kv_a.fused_moves("cpu")  # the GPU path, interpreted
        kv_b.moves = kv_b.fused_moves("cpu")
        ref_a = KVTensors(la, aa)  # NumPy path over the same memory
        bufs = np.array([3, 0, 2], dtype=np.int64)
        row = la.token_row_bytes
        n = 5
        src = rng.permutation(10 * pa // g)[:n].astype(np.int64)
        dst = rng.permutation(10 * pb // g)[:n].astype(np.int64)
        for lo, hi in ((0, row), (16, 48)):
            got = np.zeros((bufs.size, n, g, hi - lo), dtype=np.uint8)
            want = np.zeros_like(got)
            kv_a.gather(bufs, src, lo, hi, got, g)
            ref_a.gather(bufs, src, lo, hi, want, g)
            assert np.array_equal(got, want), ("gather", pa, g, lo)
            kv_b.scatter(bufs, dst, lo, hi, got, g)
            lb_ref.scatter(bufs, dst, lo, hi, got, g)
            for x, y in zip(ab, ref_b):
                assert np.array_equal(x, y), ("scatter", pb, g, lo)
    print("KV-UNITS-OK")
    """
)


def test_kvtensors_blocks_at_an_offset_in_interpreter() -> None:
    """``move_block`` both ways (what bulk staging calls, the block given as its
    staging memory and a byte offset, no view built on the fused path) move exactly what the
    NumPy path does with a view of the same bytes, for whole pages and for units, and touch
    no byte of the memory outside the block."""
    pytest.importorskip("triton")
    run_interpreted(_KV_BLOCK_CHECK, "KV-BLOCK-OK")


_KV_BLOCK_CHECK = textwrap.dedent(
    """
    import numpy as np
    from kvwire.layout import ModelSpec, RankPosition
    from kvwire.staging.kernels import KVTensors, block_view
    from kvwire.testing.kvfill import make_pool
    rng = np.random.default_rng(11)

    def pool():
        m = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=4, dtype="int32", page_size=8)
        lay, arrs = make_pool(m, RankPosition(), 10)
        for a in arrs:
            a[...] = rng.integers(-2**31, 2**31 - 1, a.shape, dtype=np.int64).astype(np.int32)
        return lay, arrs

    la, aa = pool()
    lb, ab = pool()
    lc, ac = pool()  # decode's pool twice: scattered to on the fused and on the NumPy path
    fused, plain = KVTensors(la, aa), KVTensors(la, aa)
    fused.moves = fused.fused_moves("cpu")  # the GPU path, interpreted
    bufs = np.array([2, 0, 3], dtype=np.int64)
    row = la.token_row_bytes
    for unit, count in ((8, 4), (4, 7), (2, 9)):
        sel = rng.permutation(10 * 8 // unit)[:count].astype(np.int64)
        for lo, hi in ((0, row), (16, 48)):
            shape = (bufs.size, count, unit, hi - lo)
            start = 24 + int(rng.integers(0, 64))
            mem = rng.integers(0, 256, start + int(np.prod(shape)) + 40, dtype=np.uint8)
            want = mem.copy()
            fused.move_block(bufs, sel, lo, hi, mem, start, unit, to_pool=False)
            plain.gather(bufs, sel, lo, hi, block_view(want, start, shape), unit)
            assert np.array_equal(mem, want), ("gather", unit, lo)
            # scatter that block into the other pool, both ways
            for x, y in zip(ab, ac):
                y[...] = x
            fb, pb = KVTensors(lb, ab), KVTensors(lc, ac)
            fb.moves = fb.fused_moves("cpu")
            dst = rng.permutation(10 * 8 // unit)[:count].astype(np.int64)
            fb.move_block(bufs, dst, lo, hi, mem, start, unit, to_pool=True)
            pb.move_block(bufs, dst, lo, hi, mem, start, unit, to_pool=True)  # NumPy path, a view
            for x, y in zip(fb.views, pb.views):
                assert np.array_equal(x, y), ("scatter", unit, lo)
    print("KV-BLOCK-OK")
    """
)
