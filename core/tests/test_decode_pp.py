"""Pipeline parallelism on decode: every decode stage gets its layers from whichever prefill
stages hold them.

A simulated prefill instance (TP x PP) and decode instance (TP x PP), each stage holding a
random contiguous layer range, move one request through the core mappers, pairing ranks only
through :class:`~kvwire.index.topology.Topology` (as the session does). Every decode rank must
end up with exactly its layers and heads, each byte written once, and a prefill stage sharing
no layer with a decode stage must be a dummy for it (no KV, still a sender).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from kvwire.index import EqualTPMapper, HeadSliceMapper, IndexMapper, MLAMapper
from kvwire.index.base import default_mapper_name
from kvwire.index.topology import Topology
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.session.handshake import handshake_problems, layout_topology

MAPPERS: dict[str, type[IndexMapper]] = {
    "equal_tp": EqualTPMapper,
    "mla": MLAMapper,
    "head_slice": HeadSliceMapper,
}
U64 = np.uint64


def value(
    layer: int, kv: int, heads: NDArray[np.int64], pos: NDArray[np.int64], nb: int
) -> NDArray[np.uint8]:
    x = (
        np.asarray(pos, dtype=U64)[..., None, None] * U64(2654435761)
        + np.asarray(heads, dtype=U64)[:, None] * U64(40503)
        + np.arange(nb, dtype=U64) * U64(97)
        + U64(layer * 7919 + kv * 104729 + 1)
    )
    x ^= x >> U64(13)
    x *= U64(0x9E3779B97F4A7C15)
    x ^= x >> U64(31)
    return (x & U64(0xFF)).astype(np.uint8)


class Rank:
    def __init__(
        self,
        model: ModelSpec,
        tp: int,
        r: int,
        pp: int,
        p: int,
        layers: tuple[int, int],
        slots: int,
    ) -> None:
        h = model.total_kv_heads
        local = 1 if model.is_mla else max(1, h // tp)
        self.heads = (r // max(1, tp // h)) * local + np.arange(local, dtype=np.int64)
        kinds = (0,) if model.is_mla else (0, 1)
        self.keys = [(layer, kv) for kv in kinds for layer in range(*layers)]
        shape = (slots, model.page_size, local, model.head_dim * model.dtype_size)
        self.arrays = [np.zeros(shape, dtype=np.uint8) for _ in self.keys]
        pos = RankPosition(tp_size=tp, tp_rank=r, pp_size=pp, pp_rank=p)
        self.layout = KVLayout.from_tensors(model, self.arrays, pos, layers[0], layers[1])

    def locate(self, addr: int) -> tuple[NDArray[np.uint8], int]:
        for arr in self.arrays:
            off = addr - arr.ctypes.data
            if 0 <= off < arr.nbytes:
                return arr.reshape(-1), off
        raise AssertionError(f"address {addr:#x} is in no buffer of this rank")


def splits(draw: st.DrawFn, layers: int, stages: int) -> list[tuple[int, int]]:
    cuts = sorted(
        draw(
            st.lists(
                st.integers(1, layers - 1), min_size=stages - 1, max_size=stages - 1, unique=True
            )
        )
    )
    b = [0, *cuts, layers]
    return list(itertools.pairwise(b))


@st.composite
def shapes(draw: st.DrawFn) -> dict[str, object]:
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from((1, 2, 4)))
    tps = [
        (a, b)
        for a in (1, 2, 4)
        for b in (1, 2, 4)
        if (a % b == 0 or b % a == 0)
        and (mla or ((heads % a == 0 or a % heads == 0) and (heads % b == 0 or b % heads == 0)))
    ]
    tp_s, tp_d = draw(st.sampled_from(tps))
    layers = draw(st.integers(2, 5))
    pp_s, pp_d = draw(st.integers(1, min(3, layers))), draw(st.integers(1, min(3, layers)))
    return {
        "model": ModelSpec(
            num_layers=layers,
            total_kv_heads=heads,
            head_dim=draw(st.integers(1, 3)),
            dtype="uint8",
            page_size=draw(st.integers(1, 3)),
            is_mla=mla,
        ),
        "tp": (tp_s, tp_d),
        "src_stages": splits(draw, layers, pp_s),
        "dst_stages": splits(draw, layers, pp_d),
        "pages": draw(st.integers(1, 4)),
    }


def move(shape: dict[str, object]) -> None:
    model = shape["model"]
    assert isinstance(model, ModelSpec)
    tp_s, tp_d = shape["tp"]  # type: ignore[misc]
    s_st: list[tuple[int, int]] = shape["src_stages"]  # type: ignore[assignment]
    d_st: list[tuple[int, int]] = shape["dst_stages"]  # type: ignore[assignment]
    n: int = shape["pages"]  # type: ignore[assignment]
    ps, nb = model.page_size, model.head_dim * model.dtype_size
    src = {
        (p, r): Rank(model, tp_s, r, len(s_st), p, s_st[p], n + 1)
        for p in range(len(s_st))
        for r in range(tp_s)
    }
    dst = {
        (q, r): Rank(model, tp_d, r, len(d_st), q, d_st[q], n + 2)
        for q in range(len(d_st))
        for r in range(tp_d)
    }
    pages = np.arange(n, dtype=np.int64)[::-1] + 1
    dpages = np.arange(n, dtype=np.int64) + 2
    pos = np.arange(n * ps, dtype=np.int64).reshape(n, ps)
    for rk in src.values():
        for arr, (layer, kv) in zip(rk.arrays, rk.keys, strict=True):
            arr[pages] = value(layer, kv, rk.heads, pos, nb)
    writes = {k: [np.zeros(a.size, dtype=np.int32) for a in rk.arrays] for k, rk in dst.items()}
    topo = Topology(tp_s, len(s_st), tp_d, len(d_st))
    assert topo.problems() == []
    for r in range(tp_s):
        assert topo.fan_out(r) == len(topo.targets(r)) * len(d_st)
    for (q, d), drk in dst.items():
        senders = topo.sources(d)
        assert len(senders) == len(s_st) * len({t for t, _ in senders})
        assert layout_topology(src[(0, senders[0][0])].layout, drk.layout) == topo
        for t, p in senders:
            srk = src[(p, t)]
            assert handshake_problems(srk.layout, drk.layout, "tcp", "tcp") == []
            mapper = MAPPERS[default_mapper_name(srk.layout, drk.layout)](srk.layout, drk.layout)
            common = max(s_st[p][0], d_st[q][0]) < min(s_st[p][1], d_st[q][1])
            if not common:
                assert mapper.is_dummy, f"prefill stage {s_st[p]} shares no layer with {d_st[q]}"
            src_u, lo, hi = mapper.chunk_slice(n, dpages, pages, 0, n)
            si, di = mapper.map_chunk(src_u, dpages[lo:hi])
            if mapper.is_dummy:
                assert si.size == 0
                continue
            tables = mapper.build_tables()
            for (sa, ln), (da, dl) in zip(
                tables.src[si, :2].tolist(), tables.dst[di, :2].tolist(), strict=True
            ):
                assert ln == dl
                s_arr, so = srk.locate(sa)
                d_arr, do = drk.locate(da)
                d_arr[do : do + ln] = s_arr[so : so + ln]
                w = writes[(q, d)][[a.ctypes.data for a in drk.arrays].index(d_arr.ctypes.data)]
                w[do : do + ln] += 1
    for (q, d), drk in dst.items():
        for b, (arr, (layer, kv)) in enumerate(zip(drk.arrays, drk.keys, strict=True)):
            np.testing.assert_array_equal(
                arr[dpages],
                value(layer, kv, drk.heads, pos, nb),
                err_msg=f"decode stage {q} rank {d} layer {layer}",
            )
            w = writes[(q, d)][b].reshape(arr.shape)
            assert (w[dpages] == 1).all(), "a byte was written other than once"
            assert w.sum() == w[dpages].sum(), "written outside the request's pages"


@settings(max_examples=40, deadline=None)
@given(shape=shapes())
def test_decode_stages_get_their_layers(shape: dict[str, object]) -> None:
    move(shape)


def test_named_shapes() -> None:
    m = ModelSpec(num_layers=4, total_kv_heads=2, head_dim=2, dtype="uint8", page_size=2)
    for tp in ((2, 1), (1, 2), (2, 2)):
        move(
            {
                "model": m,
                "tp": tp,
                "src_stages": [(0, 1), (1, 4)],
                "dst_stages": [(0, 2), (2, 4)],
                "pages": 3,
            }
        )
        move(
            {
                "model": m,
                "tp": tp,
                "src_stages": [(0, 4)],
                "dst_stages": [(0, 1), (1, 2), (2, 4)],
                "pages": 2,
            }
        )


def test_decode_without_pp_must_hold_every_layer() -> None:
    m = ModelSpec(num_layers=2, total_kv_heads=1, head_dim=2, dtype="uint8", page_size=1)
    pre = Rank(m, 1, 0, 1, 0, (0, 2), 2).layout
    part = Rank(m, 1, 0, 1, 0, (0, 2), 2)
    lay = KVLayout.from_tensors(m, part.arrays[:1] + part.arrays[2:3], RankPosition(), 0, 1)
    problems = handshake_problems(pre, lay, "tcp", "tcp")
    assert any("without pipeline parallelism must hold all 2 layers" in p for p in problems)
    staged = KVLayout.from_tensors(
        m, part.arrays[:1] + part.arrays[2:3], RankPosition(pp_size=2), 0, 1
    )
    assert handshake_problems(pre, staged, "tcp", "tcp") == []


def test_topology_counts_every_decode_stage() -> None:
    topo = Topology(prefill_tp=4, prefill_pp=2, decode_tp=2, decode_pp=3)
    assert topo.problems() == []
    assert topo.targets(3) == [1] and topo.fan_out(3) == 3
    assert topo.sources(1) == [(2, 0), (3, 0), (2, 1), (3, 1)]
    assert topo.aux_sender(1) == topo.sender_id(2, 1)
    with pytest.raises(Exception, match="one must divide"):
        Topology(3, 1, 2, 2).check()
