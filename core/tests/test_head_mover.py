"""Bulk staging's head-major mover: a head range of every token of head-major pages
(``[heads, page, head bytes]`` slots) gathered into a token-order block ``[buffer, unit,
token, head bytes lo..hi]`` and scattered back, every buffer in one launch.

* :func:`kvwire.movers.plan.head_runs` (the NumPy reference) against the indexed copies of
  :class:`kvwire.staging.kernels.KVTensors`' host path (the semantics it replaces on a GPU),
  gathers and scatters, pages and units, head slices, fused K|V rows, stacked pools, every
  byte of the arena (so neither writes outside the selection);
* the Triton kernel (:class:`kvwire.movers.triton_heads.HeadCopier`) under Triton's CPU
  interpreter against the reference, the arena poisoned with random bytes and compared whole;
* :class:`KVTensors` wired to the kernel (interpreted) against its NumPy path;
* the kernel compiled for an H100 on the CPU: 16-byte vector loads and stores.

Tiny shapes; about 0.2 s in process and 7 s of interpreter and compiler subprocesses.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.movers import copy_runs_reference, head_runs
from kvwire.movers.staged_moves import HeadMajorMoves, PoolGeometry
from kvwire.staging.kernels import KVTensors
from kvwire.testing.interpreted import run_interpreted

SLOTS = 5
_DT = {"int32": np.int32, "float16": np.int16}


class Arena:
    """One byte arena holding a head-major pool's buffers (each ``pad`` bytes past a 16-byte
    boundary; or one stacked tensor) and, after them, room for a block."""

    def __init__(self, model: ModelSpec, *, fused: bool, stacked: bool, pad: int, seed: int):
        self.model = model
        dt = _DT[model.dtype]
        heads = model.total_kv_heads
        shape = (SLOTS, heads, model.page_size, *((2,) if fused else ()), model.head_dim)
        nbuf = model.num_layers * (1 if fused else 2)
        one = int(np.prod(shape)) * np.dtype(dt).itemsize
        room = nbuf * one * 2 + 4096
        self.mem = np.random.default_rng(seed).integers(0, 256, room, dtype=np.uint8)
        base = -self.mem.ctypes.data % 64 + pad
        self.base = self.mem.ctypes.data
        if stacked:
            big = self.mem[base : base + nbuf * one].view(dt).reshape(nbuf, *shape)
            views = [big[i] for i in range(nbuf)]
            self.tensors: Any = big
            end = base + nbuf * one
        else:
            views, off = [], base
            for _ in range(nbuf):
                views.append(self.mem[off : off + one].view(dt).reshape(shape))
                off += one + 16 + pad
            self.tensors, end = views, off
        self.layout = KVLayout.from_tensors(
            model, views, RankPosition(), head_major=True, kv_fused=fused
        )
        self.kv = KVTensors(self.layout, self.tensors)
        self.block_at = end + -end % 16 + 16 + pad  # arena offset of the block

    def block(self, shape: tuple[int, ...]) -> Any:
        n = int(np.prod(shape))
        return self.mem[self.block_at : self.block_at + n].reshape(shape)

    def runs_kw(self, lo: int, hi: int, unit: int) -> dict[str, int]:
        """:func:`head_runs`' geometry for bytes ``[lo, hi)`` of a token row, units of
        ``unit`` tokens (written out here, apart from the code under test)."""
        hb, ps = self.layout.head_bytes, self.model.page_size
        return dict(
            slot_bytes=self.layout.slot_bytes, per_page=ps // unit, unit_bytes=unit * hb,
            lo=lo // hb * ps * hb, head_stride=ps * hb, token_stride=hb, n=hb,
            heads=(hi - lo) // hb, tokens=unit,
        )  # fmt: skip


def cases() -> list[dict[str, Any]]:
    """(model, unit, head slice, fused, stacked, pad): every element width the engines and
    odd head sizes give (16: 16-byte heads; 4: 12-byte heads; 2: 6-byte heads), whole pages
    and units (of one token too), all heads / a slice / one head."""
    out = []
    for dtype, dim, heads, page, unit, h0, h1, fused, stacked, pad in (
        ("int32", 4, 4, 4, 4, 0, 4, False, False, 0),
        ("int32", 4, 4, 6, 3, 1, 3, False, True, 0),
        ("int32", 3, 4, 4, 1, 2, 3, False, False, 4),
        ("float16", 3, 2, 4, 2, 0, 2, False, False, 2),
        ("int32", 2, 2, 4, 4, 1, 2, True, True, 0),
        ("float16", 8, 4, 8, 2, 1, 4, True, False, 0),
    ):
        model = ModelSpec(num_layers=2, total_kv_heads=heads, head_dim=dim, dtype=dtype,
                          page_size=page)  # fmt: skip
        out.append({"model": model, "unit": unit, "heads": (h0, h1), "fused": fused,
                    "stacked": stacked, "pad": pad})  # fmt: skip
    return out


def check_against_reference(case: dict[str, Any], seed: int, moves_device: str = "") -> None:
    """Gather units (pages) of buffers in a random order through ``KVTensors`` (its NumPy path,
    or its fused moves on ``moves_device``), the same through :func:`head_runs` on a copy of
    the arena, compare every byte; then scatter a fresh block into other units both ways."""
    # a stream of its own: drawn from the arena's seed, the "fresh" block could repeat the
    # arena's own bytes (the arena draws from that seed's start, and after this stream's
    # permutations the two lined up: a block equal to the units it was scattered into)
    rng = np.random.default_rng((seed, 1))
    mk = dict(fused=case["fused"], stacked=case["stacked"], pad=case["pad"], seed=seed)
    arena = Arena(case["model"], **mk)
    ref = arena.mem.copy()
    if moves_device:
        arena.kv.moves = arena.kv.fused_moves(moves_device)
        assert arena.kv.moves is not None
    unit, (h0, h1) = case["unit"], case["heads"]
    hb = arena.layout.head_bytes
    lo, hi = h0 * hb, h1 * hb
    per = arena.model.page_size // unit
    nbuf = len(arena.layout.buffers)
    bufs = rng.permutation(nbuf)[: max(1, nbuf - 1)].astype(np.int64)
    kw = arena.runs_kw(lo, hi, unit)
    addrs = arena.kv.addrs[bufs] - arena.base
    for to_pool in (False, True):
        units = rng.permutation(SLOTS * per)[:3].astype(np.int64)
        block = arena.block((bufs.size, units.size, unit, hi - lo))
        if to_pool:  # a fresh block, in both arenas
            block[...] = rng.integers(0, 256, block.shape, dtype=np.uint8)
            ref[arena.block_at : arena.block_at + block.size] = block.reshape(-1)
        # the reference first: it must change something (the arena is random)
        before = ref.copy()
        pool, blk, lens = head_runs(addrs, units, arena.block_at, **kw)
        if to_pool:
            copy_runs_reference(ref, blk, pool, lens)
        else:
            copy_runs_reference(ref, pool, blk, lens)
        assert not np.array_equal(before, ref), "the reference copied nothing"
        if to_pool:
            arena.kv.scatter(bufs, units, lo, hi, block, unit)
        else:
            arena.kv.gather(bufs, units, lo, hi, block, unit)
        where = np.flatnonzero(arena.mem != ref)
        assert where.size == 0, (case, "scatter" if to_pool else "gather", where[:8])


@pytest.mark.parametrize("i", range(len(cases())))
def test_head_runs_match_the_indexed_copies(i: int) -> None:
    """The reference runs give exactly what the host path's indexed copies (through a
    transpose) give, both directions, every byte of the arena."""
    for seed in range(3):
        check_against_reference(cases()[i], seed)


@st.composite
def geometries(draw: st.DrawFn) -> dict[str, Any]:
    heads = draw(st.integers(1, 4))
    page = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    h0 = draw(st.integers(0, heads - 1))
    model = ModelSpec(num_layers=draw(st.integers(1, 2)), total_kv_heads=heads,
                      head_dim=draw(st.integers(1, 4)), dtype=draw(st.sampled_from(list(_DT))),
                      page_size=page)  # fmt: skip
    return {
        "model": model,
        "unit": draw(st.sampled_from([u for u in range(1, page + 1) if page % u == 0])),
        "heads": (h0, draw(st.integers(h0 + 1, heads))),
        "fused": draw(st.booleans()),
        "stacked": draw(st.booleans()),
        "pad": draw(st.sampled_from([0, 2, 4, 8])),
    }


@settings(max_examples=60, deadline=None)
@given(case=geometries(), seed=st.integers(0, 2**31))
def test_head_runs_match_the_indexed_copies_for_any_geometry(
    case: dict[str, Any], seed: int
) -> None:
    """The same for any head count, head size, page and unit size, head range, fused K|V,
    stacked or not, alignment, random units and buffers (NumPy only, 60 examples, ~0.1 s)."""
    check_against_reference(case, seed)


def test_head_runs_are_token_order() -> None:
    """The block is ``[buffer, unit, token, head, head bytes]``: read back from the runs'
    pool addresses, piece ``(t, h)`` of a unit is head ``h0 + h`` of token ``k * unit + t``
    of its page (numbers written out, apart from the arena helper)."""
    pool, blk, lens = head_runs([1000], [5], 0, slot_bytes=4 * 2 * 8, per_page=2, unit_bytes=16,
                                lo=1 * 4 * 8, head_stride=32, token_stride=8, n=8, heads=1,
                                tokens=2)  # fmt: skip
    # page 2 (unit 5 = page 2, second half), head 1, tokens 2 and 3 of 4: 8-byte pieces
    assert pool.tolist() == [1000 + 2 * 64 + 32 + 2 * 8, 1000 + 2 * 64 + 32 + 3 * 8]
    assert blk.tolist() == [0, 8] and lens.tolist() == [8, 8]
    pool, _, _ = head_runs([0, 500], [0], 0, slot_bytes=64, per_page=1, unit_bytes=16, lo=0,
                           head_stride=16, token_stride=8, n=8, heads=2, tokens=2)  # fmt: skip
    assert pool.tolist() == [0, 16, 8, 24, 500, 516, 508, 524]  # token 0 heads 0 1, token 1


class _NoLaunch:
    """A copier that fails the test if anything reaches it."""

    def copy_heads(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("a launch was enqueued for a refused slice")


def test_bad_head_slice_is_refused() -> None:
    """A byte range that is not whole heads is refused, naming why, before any launch."""
    geometry = PoolGeometry(addrs=np.array([4096], dtype=np.int64), slot_bytes=128, row=16,
                            page_size=8, head_bytes=8)  # fmt: skip
    moves = HeadMajorMoves(geometry, _NoLaunch())  # type: ignore[arg-type]
    for lo, hi in ((4, 12), (0, 12), (8, 20)):
        with pytest.raises(ValueError, match="not whole heads of 8 bytes"):
            moves.pages(np.array([0]), np.array([1]), lo, hi, 1 << 20, to_pool=False,
                        stream=None)  # fmt: skip


_TESTS = str(Path(__file__).resolve().parent)

_KERNEL_CHECK = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    from test_head_mover import cases, check_against_reference
    from kvwire.movers import copy_runs_reference, head_runs
    from kvwire.movers.triton_heads import HeadCopier
    # the KVTensors wiring: its fused moves (the GPU path, interpreted) against the reference
    for case in cases():
        check_against_reference(case, 7, moves_device="cpu")
    # the kernel alone: pieces over one block (16 KiB heads), tiles of one row
    rng = np.random.default_rng(3)
    mover = HeadCopier("cpu")
    hb, heads, page = 16384, 2, 2
    mem = rng.integers(0, 256, 3 * heads * page * hb + 8 * 4 * page * hb, dtype=np.uint8)
    kw = dict(slot_bytes=heads * page * hb, per_page=1, unit_bytes=page * hb, lo=0,
              head_stride=page * hb, token_stride=hb, n=hb, heads=heads, tokens=page)
    for to_pool, units in ((False, [2, 0]), (True, [1, 2])):
        want = mem.copy()
        pool, blk, ln = head_runs([0], units, 3 * heads * page * hb, **kw)
        copy_runs_reference(want, *((blk, pool, ln) if to_pool else (pool, blk, ln)))
        assert not np.array_equal(want, mem)
        mover.copy_heads(np.array([mem.ctypes.data]), np.array(units),
                         mem.ctypes.data + 3 * heads * page * hb, **kw, to_pool=to_pool)
        assert np.array_equal(mem, want), to_pool
    print("HEADS-OK")
    """
).format(tests=_TESTS)


def test_head_mover_in_interpreter_matches_the_reference() -> None:
    """The Triton kernel (not a stand-in) under Triton's CPU interpreter, through
    :class:`KVTensors`' gather and scatter: every case above, every byte of the poisoned
    arena equal to the reference's; and one piece larger than a block."""
    pytest.importorskip("triton")
    run_interpreted(_KERNEL_CHECK, "HEADS-OK")


_PTX_CHECK = textwrap.dedent(
    """
    import re
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvwire.movers.triton_heads import _copy_heads, tile_shape

    ints = ("table_addr nunits block_addr slot_elems per_page unit_elems lo_elems head_vecs "
            "token_vecs n_vecs heads tokens").split()
    consts = ("rows", "cols", "elem", "align", "vec", "to_pool")
    sig = {**{k: "i64" for k in ints}, **{k: "constexpr" for k in consts}}
    # 256-byte heads x 16 tokens x 4 heads (issue 27's model at TP 2), 16 KiB heads,
    # one 256-byte head of one token (units of 1 token at TP 8), 16-byte heads of one token
    for n, count in ((64, 64), (4096, 32), (64, 1), (4, 1)):
        rows, cols = tile_shape(n, count, 4, 4, 128)
        for to_pool in (False, True):
            c = {"rows": rows, "cols": cols, "elem": tl.int32, "align": 16, "vec": 4,
                 "to_pool": to_pool}
            src = ASTSource(fn=_copy_heads, signature=sig, constexprs=c)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            ops = set(re.findall(r"(?:ld|st)[.]global[.][a-z0-9.]*b32", ptx.asm["ptx"]))
            assert ops == {"ld.global.v4.b32", "st.global.v4.b32"}, (n, count, to_pool, ops)
    print("PTX-OK")
    """
)


def test_head_mover_compiles_to_vector_accesses() -> None:
    """Compiled for an H100 (sm_90) on the CPU, no GPU needed: with 16-byte width every
    load and store of the head-major mover is a 16-byte vector, in both directions, for
    tiles of many short rows, of one long row, and of a single vector (a dropped length hint
    would compile to scalar accesses, as the page mover's did)."""
    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, "-c", _PTX_CHECK], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and "PTX-OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gpu_check_script_dry_run_verifies_every_byte() -> None:
    """``scripts/gpu_headmajor_mover_check.py --dry`` (the GPU call's check, on the CPU with
    tiny shapes under Triton's interpreter) runs to its verdict, so the next GPU call does not
    spend its device time on a broken script. About 6 s."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_headmajor_mover_check.py"
    out = subprocess.run(
        [sys.executable, str(script), "--dry"], capture_output=True, text=True, timeout=280
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "verified: every byte right" in out.stdout, out.stdout[-3000:]
