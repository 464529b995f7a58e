"""A page write that sums what it copies (issue 26 item 1): the pool page mover's summed
kernel (``_copy_pool_pages_summed``: the copy's programs and ``hash_pages``' programs in
one launch) and the :class:`~kvwire.integrity_orders.SumsOrder` that hands a chunk's sums from
prefill's worker to the writer (``cudaipc`` declares ``summed_writes``).

The kernel runs under Triton's CPU interpreter over host memory (one subprocess): every
byte of the arena compared with the NumPy reference of the copy, and the sums equal to the
host hasher's over the same rows keyed by decode's addresses, for whole pages, head slices
both ways and an MLA sender; layer ranges; the lane's page slots reused past their number;
a flipped source byte changes its layer's sum only. The order's states (take, launched,
abandon, start, called) are checked in process with stand-in plans (no device needed).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

from kvwire.testing.interpreted import run_interpreted

_FUSED = textwrap.dedent(
    """
    import numpy as np
    from kvwire.descriptors import ADDR
    from kvwire.index import EqualTPMapper, HeadSliceMapper, MLAMapper
    from kvwire.integrity import RowHasher, mismatched_layers
    from kvwire.integrity_device import DeviceRowHasher
    from kvwire.integrity_lanes import PAGE_SLOTS
    from kvwire.layout import KVLayout, ModelSpec, RankPosition
    from kvwire.movers.pool_pages import copy_pool_pages_reference
    from kvwire.movers.triton_pool_pages import PoolPageCopier
    from kvwire.page_form import page_sides

    rng = np.random.default_rng(5)
    mover = PoolPageCopier("cpu")
    SLOTS = 6

    def pools(arena, off, model, tp, rank, heads):
        bufs = []
        shape = (SLOTS, model.page_size, heads, model.head_dim)
        nbytes = int(np.prod(shape)) * model.dtype_size
        for _ in range(2 * model.num_layers // (2 if model.is_mla else 1)):
            bufs.append(arena[off : off + nbytes].view(np.int16).reshape(shape))
            off += nbytes + 64
        layout = KVLayout.from_tensors(
            model, bufs, RankPosition(tp_size=tp, tp_rank=rank)
        )
        return layout, off

    def vram(lay):
        kinds = tuple(b.model_copy(update={"kind": 1}) for b in lay.buffers)
        return lay.model_copy(update={"buffers": kinds})

    F, T = False, True
    cases = [  # (heads, head_dim, TP src, TP dst, src rank, dst rank, mla)
        (4, 8, 1, 1, 0, 0, F), (4, 8, 2, 1, 1, 0, F), (4, 8, 1, 2, 0, 1, F),
        (4, 3, 2, 1, 0, 0, F), (1, 8, 2, 1, 0, 0, T),
    ]
    fused = 0
    for case, (heads, dim, tps, tpd, rs, rd, mla) in enumerate(cases):
        model = ModelSpec(num_layers=3, total_kv_heads=heads, head_dim=dim, dtype="bfloat16",
                          page_size=4, is_mla=mla)
        arena = rng.integers(0, 256, 2 * 6 * SLOTS * 4 * heads * dim * 2 + 8192, dtype=np.uint8)
        base = arena.ctypes.data
        hs = 1 if mla else max(1, heads // tps)
        hd = 1 if mla else max(1, heads // tpd)
        src, off = pools(arena, 16, model, tps, rs, hs)
        dst, _ = pools(arena, off + 16, model, tpd, rd, hd)
        cls = MLAMapper if mla else (EqualTPMapper if tps == tpd else HeadSliceMapper)
        mapper = cls(src, dst)
        tables = mapper.build_tables()
        s_side, d_side = page_sides(mapper.page_geometry, tables.src, tables.dst)
        hasher = DeviceRowHasher(vram(src), device="cpu")
        host = RowHasher(src)
        # (first case) more chunks than a lane has page slots: the kernel's last program
        # zeroes each slot's sums for its next launch; every case: each program order
        for round_ in range(PAGE_SLOTS + 1 if case == 0 else 3):
            sp, dp = rng.permutation(SLOTS)[:3], rng.permutation(SLOTS)[:3]
            chunk = mapper.page_chunk(sp, dp)
            g = chunk.geometry
            s_addr = tables.src[g.src_rows, ADDR].astype(np.int64)
            d_addr = tables.dst[g.dst_rows, ADDR].astype(np.int64)
            si, di = mapper.map_chunk(sp, dp)
            layers = None if round_ % 3 else range(1, 3)
            want_sums = host.sums(tables.src, si, tables.dst[di, ADDR], layers)
            assert want_sums and (layers is None or set(want_sums) == {1, 2}), want_sums
            want = arena.copy()
            copy_pool_pages_reference(want, chunk, s_addr - base, d_addr - base)
            assert not np.array_equal(want, arena)
            order = hasher.sums_order(s_side, chunk.src_pages, d_side, chunk.dst_pages, layers)
            args = order.take()
            assert args is not None and mover.sums_fit(chunk, args)
            mover.sum_order = ("alternate", "after", "before")[round_ % 3]
            mover.sum_block = (1024, 16)[round_ % 2]
            assert order.take() is None  # taken once
            mover.copy_pages(chunk, s_addr, d_addr, sums=args)
            order.launched(None)
            order.start()  # launched: starts nothing
            assert np.array_equal(arena, want), (heads, dim, tps, tpd)
            assert order() == want_sums, (heads, dim, tps, tpd, round_)
            fused += 1
            arena[:] = rng.integers(0, 256, arena.size, dtype=np.uint8)
        # a flipped byte in the last page of the last pair's chunk: its layer's sum only
        sp, dp = np.array([1, 4]), np.array([2, 0])
        chunk = mapper.page_chunk(sp, dp)
        g = chunk.geometry
        s_addr = tables.src[g.src_rows, ADDR].astype(np.int64)
        d_addr = tables.dst[g.dst_rows, ADDR].astype(np.int64)
        si, di = mapper.map_chunk(sp, dp)
        want_sums = host.sums(tables.src, si, tables.dst[di, ADDR])
        last = int(s_addr[-1]) - base + int(sp[-1]) * g.src_slot + (g.tokens - 1) * g.src_row
        arena[last + g.n - 1] ^= 0x40
        order = hasher.sums_order(s_side, chunk.src_pages, d_side, chunk.dst_pages)
        mover.copy_pages(chunk, s_addr, d_addr, sums=order.take())
        order.launched(None)
        pair = int(g.src_rows[-1])
        assert mismatched_layers(want_sums, order()) == [model.num_layers - 1], pair
        # abandoned (a launch that never happened), then started on its own: same sums
        arena[last + g.n - 1] ^= 0x40
        order = hasher.sums_order(s_side, chunk.src_pages, d_side, chunk.dst_pages)
        assert order.take() is not None
        order.abandon()
        order.start()
        assert order.take() is None and order() == want_sums
    assert fused == PAGE_SLOTS + 1 + 3 * (len(cases) - 1)

    # 70 layers: 141 sums and counts, more than the last program moves in one step
    model = ModelSpec(num_layers=70, total_kv_heads=1, head_dim=4, dtype="bfloat16",
                      page_size=2)
    arena = rng.integers(0, 256, 1 << 18, dtype=np.uint8)
    src, off = pools(arena, 64, model, 1, 0, 1)
    dst, _ = pools(arena, off + 64, model, 1, 0, 1)
    mapper = EqualTPMapper(src, dst)
    tables = mapper.build_tables()
    s_side, d_side = page_sides(mapper.page_geometry, tables.src, tables.dst)
    hasher = DeviceRowHasher(vram(src), device="cpu")
    for _ in range(2):  # the second launch reuses what the first one's last program zeroed
        sp, dp = rng.permutation(SLOTS)[:1], rng.permutation(SLOTS)[:1]
        chunk = mapper.page_chunk(sp, dp)
        g = chunk.geometry
        si, di = mapper.map_chunk(sp, dp)
        want_sums = RowHasher(src).sums(tables.src, si, tables.dst[di, ADDR])
        order = hasher.sums_order(s_side, chunk.src_pages, d_side, chunk.dst_pages)
        mover.copy_pages(chunk, tables.src[g.src_rows, ADDR].astype(np.int64),
                         tables.dst[g.dst_rows, ADDR].astype(np.int64), sums=order.take())
        order.launched(None)
        assert len(want_sums) == 70 and order() == want_sums
        assert hasher.page_sums(s_side, sp, d_side, dp) == want_sums

    # sums of another page count than the copy's: refused (cudaipc then starts them alone)
    chunk = mapper.page_chunk(np.array([0, 2]), np.array([1, 3]))
    g = chunk.geometry
    s_addr = tables.src[g.src_rows, ADDR].astype(np.int64)
    d_addr = tables.dst[g.dst_rows, ADDR].astype(np.int64)
    order = hasher.sums_order(s_side, np.array([0, 2, 4]), d_side, np.array([1, 3, 5]))
    args = order.take()
    assert args is not None and not mover.sums_fit(chunk, args)
    try:
        mover.copy_pages(chunk, s_addr, d_addr, sums=args)
    except ValueError:
        pass
    else:
        raise AssertionError("sums of three pages launched with a copy of two")
    print("SUMMED-WRITES-OK")
    """
)


def test_the_summed_page_kernel_copies_and_sums_like_the_references() -> None:
    """The summed kernel itself (Triton's interpreter): copies every byte as the reference
    does, writes nothing else, and its sums equal the host hasher's for whole pages, head
    slices (TP 2 -> 1, 1 -> 2, 6-byte slices) and MLA, with and without a layer range, in
    each program order and two sum tiles, over more chunks than a lane has slots; a flipped
    byte is caught in its layer; an abandoned order starts on its own; sums of another page
    count are refused."""
    pytest.importorskip("triton")
    run_interpreted(_FUSED, "SUMMED-WRITES-OK")


_PTX = textwrap.dedent(
    """
    import re
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvwire.integrity_kernels import hash_pages
    from kvwire.movers.triton_pool_kernels import ONE_BLOCK, PIECES, WHOLE, _copy_pool_pages_summed

    target = GPUTarget("cuda", 90, 32)
    ints = ("table_addr npages nbuf src_slot dst_slot src_row dst_row n_vecs tokens "
            "pairs_addr consts_addr out_addr result_addr sum_pairs sum_tokens cells read_slot "
            "read_row key_slot key_row num_layers lo hi").split()
    const = ("block", "elem", "align", "vec", "shape", "sum_block", "inline_weights", "mode",
             "order")
    # as a launch types them: addresses 64-bit, small integers 32-bit
    sig = {**{k: "i64" if k.endswith("addr") else "i32" for k in ints},
           **{k: "constexpr" for k in const}}
    for shape, block, want in ((WHOLE, 2048, "v4"), (PIECES, 2048, "v4"), (ONE_BLOCK, 256, "v2")):
        for order in (0, 1, 2):
            consts = {"block": block, "elem": tl.int32, "align": 16, "vec": 4, "shape": shape,
                      "sum_block": 1024, "inline_weights": False, "mode": 0, "order": order}
            src = ASTSource(fn=_copy_pool_pages_summed, signature=sig, constexprs=consts)
            ptx = triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]
            ops = set(re.findall(r"(?:ld|st)[.]global[.][a-z0-9.]*b32", ptx))
            assert {f"ld.global.{want}.b32", f"st.global.{want}.b32"} <= ops, (shape, order, ops)
            assert "atom.global" in ptx, (shape, order)
    ints = ("pairs_addr num_pairs call_addr consts_addr out_addr result_addr num_pages tokens "
            "cells read_slot read_row key_slot key_row num_layers lo hi").split()
    sig = {**{k: "i64" if k.endswith("addr") else "i32" for k in ints},
           **{k: "constexpr" for k in ("block", "inline_weights", "mode")}}
    for mode in (0, 1, 2):
        src = ASTSource(fn=hash_pages, signature=sig,
                        constexprs={"block": 1024, "inline_weights": mode == 1, "mode": mode})
        triton.compile(src, target=target, options={"num_warps": 4})
    from kvwire.integrity_kernels import hash_rows
    ints = "info_addr num_info call_addr consts_addr out_addr num_rows num_layers lo hi".split()
    sig = {**{k: "i64" if k.endswith("addr") else "i32" for k in ints},
           **{k: "constexpr" for k in ("block", "inline_weights", "per_layer", "indexed")}}
    for per_layer in (False, True):
        for indexed in (False, True):
            consts = {"block": 1024, "inline_weights": indexed, "per_layer": per_layer,
                      "indexed": indexed}
            src = ASTSource(fn=hash_rows, signature=sig, constexprs=consts)
            triton.compile(src, target=target, options={"num_warps": 4})
    print("SUMMED-PTX-OK")
    """
)


def test_the_summed_and_page_sum_kernels_compile_for_a_gpu() -> None:
    """Compiled for an H100 (sm_90) on the CPU, no GPU needed (Triton's interpreter does not
    type-check as its compiler does): the summed kernel in every copy shape and program
    order keeps the copy's vector loads and stores (as the plain copy's) and its sums'
    atomics; the page sums kernel in every read mode, the row sums kernel in each form.
    Addresses are 64-bit, other integers 32-bit, as Triton types them at a launch."""
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", _PTX], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "SUMMED-PTX-OK" in out.stdout, out.stderr[-3000:]


class _Lane:
    """A lane stand-in: records the stream a launch was said to run on."""

    def __init__(self) -> None:
        self.streams: list[Any] = []

    def later(self, slot: Any, finish: Any, stream: Any = None) -> Any:
        self.streams.append(stream)
        return lambda: finish(np.array([7, 1], dtype=np.int64))


def _order(plan: Any, started: list[int]) -> Any:
    from kvwire.integrity_orders import SumsOrder

    def start() -> Any:
        started.append(1)
        return lambda: {0: 99}

    return SumsOrder(2, None, plan, start, lambda got: {0: int(got[0])})


def test_a_sums_order_goes_to_one_launch_only() -> None:
    """Taken and launched: the writer's stream is recorded, the result read from its slot,
    and start() after it launches nothing; taken twice gives None; not taken: start() once
    (a second start and the call do not start again); a plan with nothing to sum leaves it
    to start(); abandoned: new again, then started; taken and never launched: calling it
    raises (a writer's bug is not a hang)."""
    pytest.importorskip("torch")
    lane, started = _Lane(), []
    o = _order(lambda: (lane, "slot", "args"), started)
    assert o.take() == "args" and o.take() is None
    o.launched("stream-1")
    o.start()
    assert o() == {0: 7} and lane.streams == ["stream-1"] and not started

    o = _order(lambda: (lane, "slot", "args"), started)
    o.start()
    o.start()
    assert o.take() is None and o() == {0: 99} and started == [1]

    o = _order(lambda: None, started)
    assert o.take() is None and o() == {0: 99} and started == [1, 1]

    o = _order(lambda: (lane, "slot", "args"), started)
    assert o.take() == "args"
    o.abandon()
    assert o() == {0: 99} and started == [1, 1, 1]

    o = _order(lambda: (lane, "slot", "args"), started)
    o.take()
    with pytest.raises(RuntimeError, match="taken by a write never launched"):
        o()


def test_backends_that_do_not_sum_start_the_order_at_submit() -> None:
    """The capability: ``cudaipc`` and a list of backends sum (or pass on) the order
    themselves; ``tcp`` does not, so its template starts the order at submit, before the
    note is made."""
    from kvwire.backends.multi import MultiBackend
    from kvwire.backends.tcp import TcpBackend
    from kvwire.transfers import LaterNote, note_sums, start_sums

    assert MultiBackend.capabilities.summed_writes
    assert not TcpBackend.capabilities.summed_writes
    cudaipc = pytest.importorskip("kvwire_cudaipc.backend")
    assert cudaipc.CudaIpcBackend.capabilities.summed_writes
    started: list[int] = []
    o = _order(lambda: None, started)
    note = LaterNote(lambda: b"n", o)
    assert note_sums(note) is o and note_sums(b"x") is None and note_sums(None) is None
    start_sums(note)
    start_sums(b"x")
    assert started == [1]
