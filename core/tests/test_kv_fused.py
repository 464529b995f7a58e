"""K and V in one buffer per layer on either side (issue 16): side by side in each row
(``KVLayout.kv_fused``, vLLM's cache) or K's page then V's page in each slot
(``KVLayout.kv_in_slot``, FlashInfer / TensorRT-LLM style): the mapper choice, refusals, the
wire, a property test against the element encoding (every K and V element of every head of
every token must land where decode's own layout puts it), and real transfers across
processes."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import LayoutError
from kvwire.index import EqualTPMapper, HeadSliceMapper, default_mapper_name, source_ranks
from kvwire.index.head_rows import HeadRowsMapper
from kvwire.index.planes import split_kv
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.testing.cluster import RELAXED_HEARTBEAT_S, Cluster, ClusterSpec
from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty
from kvwire.testing.kvfill import count_mismatches, fill_pages, make_pool, move_chunk
from kvwire.testing.pair import config

MAPPERS = {"head_rows": HeadRowsMapper, "equal_tp": EqualTPMapper, "head_slice": HeadSliceMapper}


def _model(heads: int = 4, page: int = 4, mla: bool = False) -> ModelSpec:
    return ModelSpec(
        num_layers=2, total_kv_heads=heads, head_dim=4, dtype="int32", page_size=page, is_mla=mla
    )


def test_layout_mapper_choice_and_refusals() -> None:
    r2 = RankPosition(tp_size=2, tp_rank=0)
    fused, arrays = make_pool(_model(), r2, 4, kv_fused=True)
    assert len(fused.buffers) == 2 and arrays[0].shape == (4, 4, 2, 2, 4)
    assert fused.head_bytes == 2 * 4 * 4 and fused.token_row_bytes == 2 * 32
    sep, _ = make_pool(_model(), r2, 4)
    fused1, _ = make_pool(_model(), RankPosition(), 4, kv_fused=True)
    fused_hm, _ = make_pool(_model(), r2, 4, kv_fused=True, head_major=True)
    assert default_mapper_name(fused, fused) == "equal_tp"  # whole pages, K|V together
    assert default_mapper_name(fused, fused1) == "head_slice"  # K|V head runs
    assert default_mapper_name(fused, fused_hm) == "head_rows"
    assert default_mapper_name(fused, sep) == "head_rows"
    assert default_mapper_name(sep, fused) == "head_rows"
    with pytest.raises(LayoutError, match="head_rows"):
        EqualTPMapper(fused, sep)
    with pytest.raises(LayoutError, match="head_rows"):
        HeadSliceMapper(sep, fused1)
    # a wrong buffer count or slot size names kv_fused
    with pytest.raises(ValueError, match=re.escape("one K|V buffer per layer (kv_fused)")):
        KVLayout(model=_model(), rank=r2, buffers=sep.buffers, kv_fused=True)
    one = _model().model_copy(update={"num_layers": 1})
    k_v = (make_pool(one, r2, 4, kv_fused=True)[0], make_pool(one, r2, 4, kv_fused=True)[0])
    with pytest.raises(ValueError, match=r"\(K\|V\)|kv_fused"):  # fused slots, flag unset
        KVLayout(model=one, rank=r2, buffers=(k_v[0].buffers[0], k_v[1].buffers[0]))
    with pytest.raises(ValueError, match="MLA"):
        make_pool(_model(1, mla=True), RankPosition(), 4, kv_fused=True)
    # the flag travels on the wire and is absent when False (older peers parse the layout)
    assert KVLayout.model_validate_json(fused.model_dump_json()).kv_fused
    assert "kv_fused" not in sep.model_dump_json()
    assert fused.compatibility_hash() == sep.compatibility_hash()  # the same model


def test_plane_view() -> None:
    """A fused pool seen as K and V planes: K plane at the buffer, V plane one head later,
    heads ``2 x head_dim`` apart; the view is never a real layout (nothing to register)."""
    lay, arrays = make_pool(_model(), RankPosition(tp_size=2), 4, kv_fused=True)
    view = split_kv(lay)
    assert len(view.buffers) == 4 and view.head_bytes == 16 and view.elem_pitch == 32
    assert view.bases.tolist() == [
        arrays[0].ctypes.data,
        arrays[1].ctypes.data,
        arrays[0].ctypes.data + 16,
        arrays[1].ctypes.data + 16,
    ]
    assert view.buffer_keys.tolist() == [[0, 0], [1, 0], [0, 1], [1, 1]]
    assert view.byte_offsets([1], [1]).tolist() == [[(1 * 2 + 1) * 32]]
    assert split_kv(split_kv(lay)) is not lay and split_kv(view) is view


#: how a side keeps K and V: separate buffers, side by side in rows, or two pages per slot
KINDS = {"sep": {}, "rows": {"kv_fused": True}, "slot": {"kv_in_slot": True}}


def test_in_slot_layout_and_refusals() -> None:
    r2 = RankPosition(tp_size=2, tp_rank=0)
    lay, arrays = make_pool(_model(), r2, 4, kv_in_slot=True)
    assert len(lay.buffers) == 2 and arrays[0].shape == (4, 2, 4, 2, 4)
    assert lay.slot_bytes == 2 * lay.page_bytes == 2 * 4 * 2 * 4 * 4
    view = split_kv(lay)  # K page at the slot, V page one page later, ordinary rows
    assert view.bases.tolist() == [
        arrays[0].ctypes.data,
        arrays[1].ctypes.data,
        arrays[0].ctypes.data + lay.page_bytes,
        arrays[1].ctypes.data + lay.page_bytes,
    ]
    assert view.elem_pitch == view.head_bytes == 16 and view.slot_bytes == lay.slot_bytes
    sep, _ = make_pool(_model(), r2, 4)
    assert default_mapper_name(lay, sep) == default_mapper_name(lay, lay) == "equal_tp"
    mapper = EqualTPMapper(lay, sep)  # whole K and V pages, one page long each
    assert mapper.splits_kv and not mapper.interleaved
    assert set(mapper.build_tables().src[:, 1].tolist()) == {lay.page_bytes}
    with pytest.raises(ValueError, match="pick one"):
        make_pool(_model(), r2, 4, kv_in_slot=True, kv_fused=True)
    one = _model().model_copy(update={"num_layers": 1})
    k_v = (make_pool(one, r2, 4, kv_in_slot=True)[0], make_pool(one, r2, 4, kv_in_slot=True)[0])
    with pytest.raises(ValueError, match="kv_in_slot"):  # 2 pages per slot, flag unset
        KVLayout(model=one, rank=r2, buffers=(k_v[0].buffers[0], k_v[1].buffers[0]))
    assert KVLayout.model_validate_json(lay.model_dump_json()).kv_in_slot
    assert "kv_in_slot" not in sep.model_dump_json()


@settings(max_examples=120, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (4, 1)]),
    kinds=st.tuples(st.sampled_from(sorted(KINDS)), st.sampled_from(sorted(KINDS))),
    orders=st.sampled_from([(False, False), (True, False), (False, True), (True, True)]),
    pages=st.sampled_from([(4, 4), (4, 2), (2, 4)]),
    npages=st.integers(1, 3),
)
def test_every_k_and_v_element_lands(
    heads: int,
    tp: tuple[int, int],
    kinds: tuple[str, str],
    orders: tuple[bool, bool],
    pages: tuple[int, int],
    npages: int,
) -> None:
    """Random TP pairs (GQA replication when heads < TP), K/V kept separately, side by side
    in rows or as two pages per slot on each side, page orders and page sizes, with the
    default mapper: after every source rank's rows are copied, each decode rank holds exactly
    its heads' K and V of every token, in its own layout (checked against the
    layer/K-V/head/position encoding)."""
    tp_s, tp_d = tp
    (k_s, k_d), (hm_s, hm_d), (ps_s, ps_d) = kinds, orders, pages
    tokens = npages * ps_s
    dpages = -(-tokens // ps_d)
    for dr in range(tp_d):
        dlay, darr = make_pool(
            _model(heads, ps_d),
            RankPosition(tp_size=tp_d, tp_rank=dr),
            8,
            head_major=hm_d,
            **KINDS[k_d],
        )
        for sr in source_ranks(dr, tp_s, tp_d):
            slay, sarr = make_pool(
                _model(heads, ps_s),
                RankPosition(tp_size=tp_s, tp_rank=sr),
                8,
                head_major=hm_s,
                **KINDS[k_s],
            )
            sp = np.arange(npages) + 2
            fill_pages(slay, sarr, sp, 0)
            name = default_mapper_name(slay, dlay)
            mapper = MAPPERS[name](slay, dlay)
            if mapper.is_dummy:
                continue
            dp = np.arange(dpages) + 1
            src_units, lo, hi = mapper.chunk_slice(npages, dp, sp, 0, npages, 0)
            move_chunk(mapper, sarr, darr, src_units, dp[lo:hi])
        full = tokens // ps_d
        assert count_mismatches(dlay, darr, np.arange(full) + 1, 0) == 0, (dr, name)


@pytest.mark.parametrize(
    ("tp", "fused", "head_major", "decode_page", "staging"),
    [
        ((2, 1), ("slot:prefill", "decode"), (), None, "direct"),
        ((1, 2), ("slot:prefill", "slot:decode"), ("decode",), 2, "bulk"),
        ((2, 1), ("prefill", "decode"), (), None, "direct"),
        ((1, 2), ("prefill", "decode"), ("prefill", "decode"), None, "direct"),
        ((2, 1), ("decode",), (), None, "direct"),
        ((1, 2), ("prefill",), ("decode",), 2, "direct"),
        ((2, 1), ("prefill", "decode"), (), None, "bulk"),
        ((1, 2), ("decode",), (), None, "bulk"),
    ],
    ids=[
        "gather-prefill-in-slot-decode-fused",
        "scatter-both-in-slot-decode-hm-pages-4to2-bulk-unstaged",
        "gather-both-fused",
        "scatter-both-fused-hm",
        "gather-decode-fused",
        "scatter-prefill-fused-decode-hm-pages-4to2",
        "bulk-gather-both-fused",
        "bulk-scatter-decode-fused-unstaged",
    ],
)
def test_across_processes(
    tp: tuple[int, int],
    fused: tuple[str, ...],
    head_major: tuple[str, ...],
    decode_page: int | None,
    staging: str,
) -> None:
    """Real managers and the tcp backend, one process per rank, some requests layer-wise:
    every K and V element verified in decode's layout. ``bulk`` stages a link whose two sides
    are both fused (a head is ``2 x head_dim`` on both); a link fused on one side only moves
    row by row (the K and V planes interleave)."""
    spec = ClusterSpec(
        model=ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=4),
        prefill_tp=tp[0],
        decode_tp=tp[1],
        slots=128,
        aux_slots=64,
        kv_fused=tuple(r for r in fused if ":" not in r),
        kv_in_slot=tuple(r.split(":")[1] for r in fused if ":" in r),
        head_major=head_major,
        decode_page_size=decode_page,
        # relaxed beats: faster ones evicted live ranks on a loaded 2-core host
        config=config(heartbeat_interval_s=RELAXED_HEARTBEAT_S).model_copy(
            update={"staging": staging}
        ),
    )
    with Cluster(spec) as c:
        plans = c.plans(16, pages=(1, 6), cached_fraction=0.3, layerwise_fraction=0.5)
        results = c.run(plans, concurrency=8, timeout_s=90)
        assert_all_ok(results)
        descs, npages = sum(r.descriptors for r in results), sum(p.num_pages for p in plans)
        in_slot = any(":" in r for r in fused)
        if staging == "bulk" and len(fused) == 2 and not in_slot:  # staged: block writes
            assert descs < 8 * npages, (descs, npages)
        elif len(fused) == 1 or in_slot:  # rows of heads (or pages of K and of V)
            assert descs >= 2 * 2 * npages, (descs, npages)
        assert_tables_empty(c)
