"""Head-major pages (``[slots, heads, page, dim]``) on either side (issue 16): the mapper
choice, refusals and real transfers across processes. The property test against the element
encoding (every head of every token lands where decode's own page order puts it) covers page
orders together with the ways a side keeps K and V: ``test_kv_fused.py``."""

from __future__ import annotations

import pytest

from kvwire.errors import LayoutError
from kvwire.index import EqualTPMapper, HeadSliceMapper, default_mapper_name
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.testing.cluster import RELAXED_HEARTBEAT_S, Cluster, ClusterSpec, RoomPlan
from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty
from kvwire.testing.kvfill import make_pool
from kvwire.testing.pair import config


def _model(heads: int, page: int = 4, mla: bool = False) -> ModelSpec:
    return ModelSpec(
        num_layers=2, total_kv_heads=heads, head_dim=4, dtype="int32", page_size=page, is_mla=mla
    )


def test_mapper_choice_and_refusals() -> None:
    m = _model(4)
    tm, _ = make_pool(m, RankPosition(tp_size=2, tp_rank=0), 4)
    hm, _ = make_pool(m, RankPosition(tp_size=2, tp_rank=0), 4, head_major=True)
    hm1, _ = make_pool(m, RankPosition(), 4, head_major=True)
    assert default_mapper_name(tm, tm) == "equal_tp"
    assert default_mapper_name(hm, hm) == "equal_tp"  # same order: whole pages
    assert default_mapper_name(tm, hm) == "head_rows"
    assert default_mapper_name(hm, tm) == "head_rows"
    assert default_mapper_name(hm, hm1) == "head_rows"  # TP 2 -> 1, head-major
    hm8, _ = make_pool(_model(4, page=8), RankPosition(tp_size=2, tp_rank=0), 4, head_major=True)
    assert default_mapper_name(hm, hm8) == "head_rows"  # another page size: token by token
    with pytest.raises(LayoutError, match="head_rows"):
        EqualTPMapper(hm, hm8)
    with pytest.raises(LayoutError, match="head_rows"):
        EqualTPMapper(tm, hm)
    with pytest.raises(LayoutError, match="head_rows"):
        HeadSliceMapper(hm, hm1)
    with pytest.raises(ValueError, match="MLA"):  # pydantic wraps the LayoutError
        make_pool(_model(1, mla=True), RankPosition(), 4, head_major=True)
    # the same bytes as a serialised layout: the flag travels, and is absent when False
    assert KVLayout.model_validate_json(hm.model_dump_json()).head_major
    assert "head_major" not in tm.model_dump_json()


@pytest.mark.parametrize(
    ("tp", "head_major", "decode_page", "staging"),
    [
        ((2, 1), ("decode",), None, "direct"),
        ((1, 2), ("prefill",), None, "direct"),
        ((2, 2), ("prefill",), 2, "direct"),
        ((2, 1), ("prefill", "decode"), None, "bulk"),
        ((2, 1), ("prefill",), None, "bulk"),
        ((1, 2), ("decode",), None, "bulk"),
        ((2, 1), ("prefill",), None, "bulk-views"),
    ],
    ids=[
        "gather-decode-hm",
        "scatter-prefill-hm",
        "equal-prefill-hm-pages-4to2",
        "bulk-gather-both-hm",
        "bulk-gather-prefill-hm",
        "bulk-scatter-decode-hm",
        "bulk-without-kv-tensors",
    ],
)
def test_across_processes(
    tp: tuple[int, int], head_major: tuple[str, ...], decode_page: int | None, staging: str
) -> None:
    """Real managers and the tcp backend, one process per rank, some requests layer-wise:
    every element verified in decode's page order (``bulk``: staged, a few block writes per
    chunk; ``bulk-views``: the same with no ``kv_tensors`` handed to the managers, as under
    an engine adapter: the strategy gathers and scatters through views of the layout's
    buffers)."""
    views = staging == "bulk-views"
    staging = "bulk" if views else staging
    spec = ClusterSpec(
        model=ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=4),
        prefill_tp=tp[0],
        decode_tp=tp[1],
        slots=128,
        aux_slots=64,
        head_major=head_major,
        decode_page_size=decode_page,
        # relaxed beats: faster ones evicted live ranks on a loaded 2-core host
        config=config(heartbeat_interval_s=RELAXED_HEARTBEAT_S).model_copy(
            update={"staging": staging}
        ),
        kv_tensors=not views,
    )
    with Cluster(spec) as c:
        plans = c.plans(16, pages=(1, 6), cached_fraction=0.3, layerwise_fraction=0.5)
        plans.append(RoomPlan(room=plans[0].room ^ 1, num_pages=5, chunks=[2, 0, 3]))
        results = c.run(plans, concurrency=8, timeout_s=90)
        assert_all_ok(results)
        if staging == "bulk":  # staged: a few block writes, not one row per (token, head)
            descs, pages = sum(r.descriptors for r in results), sum(p.num_pages for p in plans)
            assert descs < 8 * pages, (descs, pages)
        assert_tables_empty(c)
