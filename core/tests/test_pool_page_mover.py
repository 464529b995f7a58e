"""The pool-to-pool page mover (:mod:`kvwire.movers.triton_pool_pages`, cudaipc's page
writes) through Triton's CPU interpreter, against its NumPy reference
(:func:`kvwire.movers.pool_pages.copy_pool_pages_reference`, itself checked against the rows
in test_page_form.py): whole pages (equal TP), head slices (TP 2 -> 1, 1 -> 2) and head-major
pages (a piece per token and head) between two
pools of one arena, fresh random bytes, every byte of the arena compared (so nothing outside
the chunk is written). One interpreter subprocess, a few seconds."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvwire.testing.interpreted import run_interpreted

_CHECK = textwrap.dedent(
    """
    import numpy as np
    from kvwire.descriptors import ADDR
    from kvwire.index import EqualTPMapper, HeadSliceMapper, MLAMapper
    from kvwire.index.head_rows import HeadRowsMapper
    from kvwire.layout import KVLayout, ModelSpec, RankPosition
    from kvwire.movers.pool_pages import copy_pool_pages_reference
    from kvwire.movers.triton_pool_pages import PoolPageCopier

    rng = np.random.default_rng(3)
    mover = PoolPageCopier("cpu")
    SLOTS = 5
    shapes = set()

    def pools(arena, off, model, tp, rank, heads, hm=False):
        bufs = []
        shape = (SLOTS, model.page_size, heads, model.head_dim)
        if hm:
            shape = (SLOTS, heads, model.page_size, model.head_dim)
        nbytes = int(np.prod(shape)) * model.dtype_size
        for _ in range(2 * model.num_layers // (2 if model.is_mla else 1)):
            bufs.append(arena[off : off + nbytes].view(np.int16).reshape(shape))
            off += nbytes + 32
        layout = KVLayout.from_tensors(
            model, bufs, RankPosition(tp_size=tp, tp_rank=rank), head_major=hm
        )
        return layout, off

    F, T = False, True
    cases = [  # (heads, head_dim, TP src, TP dst, src rank, dst rank, mla, head-major sides)
        (4, 8, 1, 1, 0, 0, F, (F, F)), (4, 8, 2, 1, 1, 0, F, (F, F)), (4, 8, 1, 2, 0, 1, F, (F, F)),
        (2, 4, 1, 4, 0, 3, F, (F, F)), (4, 3, 2, 1, 0, 0, F, (F, F)), (1, 8, 2, 1, 0, 0, T, (F, F)),
        (64, 256, 1, 2, 0, 1, F, (F, F)),  # 16 KiB slices of 32 KiB rows: pieces over a block
        # head-major pages (one piece per token and head): equal TP with the page orders
        # apart, TP 2 -> 1 into head-major, TP 1 -> 2 both head-major, GQA replication, and
        # 6-byte heads (2-byte elements)
        (4, 8, 1, 1, 0, 0, F, (F, T)), (4, 8, 2, 1, 1, 0, F, (T, F)), (4, 8, 1, 2, 0, 1, F, (T, T)),
        (2, 4, 1, 4, 0, 3, F, (F, T)), (4, 3, 1, 1, 0, 0, F, (T, F)),
    ]
    for heads, dim, tps, tpd, rs, rd, mla, hm in cases:
        model = ModelSpec(num_layers=2, total_kv_heads=heads, head_dim=dim, dtype="bfloat16",
                          page_size=4, is_mla=mla)
        arena = rng.integers(0, 256, 2 * 4 * SLOTS * 4 * heads * dim * 2 + 4096, dtype=np.uint8)
        base = arena.ctypes.data
        hs = 1 if mla else max(1, heads // tps)
        hd = 1 if mla else max(1, heads // tpd)
        src, off = pools(arena, 16, model, tps, rs, hs, hm[0])
        dst, _ = pools(arena, off + 16, model, tpd, rd, hd, hm[1])
        cls = MLAMapper if mla else (EqualTPMapper if tps == tpd else HeadSliceMapper)
        mapper = HeadRowsMapper(src, dst) if any(hm) else cls(src, dst)
        tables = mapper.build_tables()
        chunk = mapper.page_chunk(rng.permutation(SLOTS)[:3], rng.permutation(SLOTS)[:3])
        g = chunk.geometry
        s_addr = tables.src[g.src_rows, ADDR].astype(np.int64)
        d_addr = tables.dst[g.dst_rows, ADDR].astype(np.int64)
        want = arena.copy()
        copy_pool_pages_reference(want, chunk, s_addr - base, d_addr - base)
        assert not np.array_equal(want, arena)
        orders = ("auto", "t", "h") if any(hm) else ("auto",)
        for order in orders:  # the head kernel in both piece orders
            mover.heads_order = order
            mover.copy_pages(chunk, s_addr, d_addr)
            assert np.array_equal(arena, want), (heads, dim, tps, tpd, order)
            shapes.add(mover.last_shape)
            arena[:] = rng.integers(0, 256, arena.size, dtype=np.uint8)
            want = arena.copy()
            copy_pool_pages_reference(want, chunk, s_addr - base, d_addr - base)
    # pieces over a block, whole pages, within a block, pieces per token and head
    assert shapes == {0, 1, 2, 3}, shapes

    # several chunks in one copy_batch (a worker's turn on cudaipc): two equal-TP chunks
    # (one batch launch), TP 2 -> 1 chunks of both prefill ranks into one pool (another),
    # a head-major chunk (its own launch), all pools in one arena
    model = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="bfloat16",
                      page_size=4)
    arena = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    base = arena.ctypes.data
    off = 64
    A, off = pools(arena, off, model, 1, 0, 4)
    B, off = pools(arena, off, model, 1, 0, 4)
    C0, off = pools(arena, off, model, 2, 0, 2)
    C1, off = pools(arena, off, model, 2, 1, 2)
    D, off = pools(arena, off, model, 1, 0, 4)
    E, off = pools(arena, off, model, 1, 0, 4)
    F, off = pools(arena, off, model, 1, 0, 4, True)
    assert off < arena.size
    items = []
    for mapper, sp, dp in ((EqualTPMapper(A, B), [0, 1], [2, 3]), (EqualTPMapper(A, B), [3], [4]),
                           (HeadSliceMapper(C0, D), [1, 2], [0, 1]),
                           (HeadSliceMapper(C1, D), [1, 2], [0, 1]),
                           (HeadRowsMapper(E, F), [4, 0], [1, 3])):
        tables = mapper.build_tables()
        chunk = mapper.page_chunk(np.array(sp), np.array(dp))
        g = chunk.geometry
        items.append((chunk, tables.src[g.src_rows, ADDR].astype(np.int64),
                      tables.dst[g.dst_rows, ADDR].astype(np.int64)))
    want = arena.copy()
    for chunk, s_addr, d_addr in items:
        copy_pool_pages_reference(want, chunk, s_addr - base, d_addr - base)
    assert not np.array_equal(want, arena)
    launches = mover.copy_batch(items)
    assert np.array_equal(arena, want)
    assert launches == 3, launches

    # a link's chunks come with the same pair-address arrays: their group key is made once
    # per geometry; new arrays (a pair prepared again) make it afresh; every byte right
    import kvwire.movers.triton_pool_pages as tpp
    widths = []
    real_width = tpp.page_width
    tpp.page_width = lambda *a: widths.append(1) or real_width(*a)
    for again in (items, [(c, s.copy(), d.copy()) for c, s, d in items]):
        arena[:] = rng.integers(0, 256, arena.size, dtype=np.uint8)
        want = arena.copy()
        for chunk, s_addr, d_addr in again:
            copy_pool_pages_reference(want, chunk, s_addr - base, d_addr - base)
        widths.clear()
        assert mover.copy_batch(again) == 3
        assert np.array_equal(arena, want)
        # the head-major chunk launches alone (copy_pages: its width each time); the four
        # other geometries' widths, two sides each, only for new arrays
        assert len(widths) == (1 if again is items else 9), widths
    print("POOL-PAGES-OK")
    """
)


def test_pool_page_kernel_matches_reference() -> None:
    """The Triton kernel itself (not a stand-in), whole pages and head slices, element
    widths 16 (whole pages, 16-byte slices) down to 2 (head_dim 3 in bf16: 6-byte slices),
    each compile-time shape (whole pages, pieces within a block, pieces over a block)."""
    pytest.importorskip("triton")
    run_interpreted(_CHECK, "POOL-PAGES-OK")


_PTX_CHECK = textwrap.dedent(
    """
    import itertools
    import re
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvwire.movers.triton_pool_kernels import (
        ONE_BLOCK, PIECES, WHOLE, _copy_pool_batch, _copy_pool_pages,
    )

    # integers typed as a launch types them: addresses 64-bit, the rest (small) 32-bit;
    # one chunk's kernel, and the batch kernel of several chunks' tables
    single = "table_addr npages nbuf src_slot dst_slot src_row dst_row n_vecs tokens"
    batch = "table_addr nchunks max_pages max_bufs src_row dst_row n_vecs tokens"
    for (shape, block, want), (fn, ints) in itertools.product(
        ((WHOLE, 2048, "v4"), (PIECES, 2048, "v4"), (ONE_BLOCK, 256, "v2")),
        ((_copy_pool_pages, single.split()), (_copy_pool_batch, batch.split())),
    ):
        sig = {**{k: "i64" if k.endswith("addr") else "i32" for k in ints},
               **{k: "constexpr" for k in ("block", "elem", "align", "vec", "shape")}}
        consts = {"block": block, "elem": tl.int32, "align": 16, "vec": 4, "shape": shape}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ops = set(re.findall(r"(?:ld|st)[.]global[.][a-z0-9.]*b32", ptx.asm["ptx"]))
        assert ops == {f"ld.global.{want}.b32", f"st.global.{want}.b32"}, (shape, fn, ops)
    # pieces per token and head (head-major pages): 256-byte heads in 2 KiB tiles
    from kvwire.movers.triton_pool_kernels import _copy_pool_heads
    ints = ("table_addr npages nbuf src_slot dst_slot src_tok dst_tok src_head dst_head "
            "n_vecs tokens heads").split()
    sig = {**{k: "i64" if k.endswith("addr") else "i32" for k in ints},
           **{k: "constexpr" for k in ("rows", "cols", "elem", "align", "vec", "t_inner")}}
    for t_inner in (False, True):
        consts = {"rows": 8, "cols": 64, "elem": tl.int32, "align": 16, "vec": 4,
                  "t_inner": t_inner}
        src = ASTSource(fn=_copy_pool_heads, signature=sig, constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ops = set(re.findall(r"(?:ld|st)[.]global[.][a-z0-9.]*b32", ptx.asm["ptx"]))
        assert ops == {"ld.global.v4.b32", "st.global.v4.b32"}, ("heads", t_inner, ops)
    # bulk staging's page and unit movers (gather and scatter), the same way
    from kvwire.movers.triton_pages import _copy_pages
    from kvwire.movers.triton_units import _copy_units
    for fn, names in ((_copy_pages, "npages block_addr slot_elems lo_elems row_elems"),
                      (_copy_units, "nunits block_addr slot_elems per_page unit_elems lo_elems "
                                    "row_elems")):
        ints = ["table_addr", *names.split(), "n_vecs", "tokens"]
        sig = {**{k: "i64" if k.endswith("addr") else "i32" for k in ints},
               **{k: "constexpr" for k in ("block", "elem", "align", "vec", "to_pool")}}
        for to_pool in (False, True):
            consts = {"block": 2048, "elem": tl.int32, "align": 16, "vec": 4, "to_pool": to_pool}
            src = ASTSource(fn=fn, signature=sig, constexprs=consts)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            ops = set(re.findall(r"(?:ld|st)[.]global[.][a-z0-9.]*b32", ptx.asm["ptx"]))
            assert ops == {"ld.global.v4.b32", "st.global.v4.b32"}, (fn, to_pool, ops)
    print("PTX-OK")
    """
)


def test_page_kernels_compile_to_vector_accesses() -> None:
    """Compiled for an H100 (sm_90) on the CPU, no GPU needed: with 16-byte width the
    copies of the pool page mover (every shape) and of bulk staging's page and unit movers
    (both directions) are vector loads and stores (a length hint on a kernel argument is
    dropped: the scalar accesses it gave measured 0.47x of the peer copy on whole pages
    where the run mover reached 0.59x). ~3 s of CPU."""
    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, "-c", _PTX_CHECK], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and "PTX-OK" in out.stdout, out.stderr[-3000:]


def test_batch_launches_bound_idle_programs_and_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``copy_batch`` cuts one shape's chunks into launches whose grid (chunks x most pages
    x most pairs) stays within twice the programs the chunks need, and of at most
    ``MAX_BATCH_CHUNKS`` chunks: a large chunk beside many small ones launches on its own."""
    pytest.importorskip("triton")
    import numpy as np

    from kvwire.movers import triton_pool_pages as tpp

    class Chunk:
        def __init__(self, pages: int) -> None:
            self.src_pages = np.arange(pages)

    def part(pages: int, pairs: int = 4) -> tuple[object, ...]:
        return (Chunk(pages), np.zeros(pairs, np.int64), np.zeros(pairs, np.int64), 4)

    def sizes(parts: list[tuple[object, ...]]) -> list[list[int]]:
        return [[int(p[0].src_pages.size) for p in b] for b in tpp._batches(parts)]  # type: ignore[attr-defined]

    assert sizes([part(2), part(1)]) == [[1, 2]]  # 2 x 2 x 4 programs for 12 pages' worth
    assert sizes([part(100)] + [part(1)] * 10) == [[1] * 10, [100]]
    # pairs count too: 2 x 8 x 64 programs for 528 pages' pairs pass, a third chunk does not
    assert sizes([part(8, 64), part(8, 2), part(8, 2)]) == [[8, 8], [8]]
    monkeypatch.setattr(tpp, "MAX_BATCH_CHUNKS", 3)
    assert sizes([part(4)] * 7) == [[4, 4, 4], [4, 4, 4], [4]]
