"""Staged bulk writes for the shapes that moved by descriptors before (issue 27 item 3, issue
28): page-size conversion (equal TP and heterogeneous TP, pages growing and shrinking, a
head-major side) and MLA (TP 2 -> 1 with a dummy sender, 1 -> 2 replicated), across real
processes on the ``tcp`` backend: every element verified, and each request moved in a few
block descriptors instead of one per (layer, K/V, granule or page).

Host pools stage head slices by default; whole rows (equal TP, MLA) only with
``equal_tp="always"`` (the default rule stages them on GPU pools: ``test_staging_rule.py``).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.index.equal_tp import EqualTPMapper
from kvwire.index.head_slice import HeadSliceMapper
from kvwire.layout import ModelSpec, RankPosition
from kvwire.staging.base import QueuedChunk
from kvwire.staging.bulk_ring import dst_units
from kvwire.staging.bulk_writer import chunk_units, src_units
from kvwire.testing.cluster import FAULT_ENV, RELAXED_HEARTBEAT_S, Cluster, ClusterSpec, RoomPlan
from kvwire.testing.cluster_suite import SMALL_RING, assert_all_ok, assert_tables_empty
from kvwire.testing.kvfill import make_pool
from kvwire.testing.pair import config

#: (prefill TP, decode TP, prefill page, decode page, MLA, head-major roles)
CASES = {
    "equal-2to2-pages-4to6": (2, 2, 4, 6, False, ()),
    "equal-1to1-pages-8to2": (1, 1, 8, 2, False, ()),
    "gather-2to1-pages-2to8": (2, 1, 2, 8, False, ()),
    "scatter-1to2-pages-8to4": (1, 2, 8, 4, False, ()),
    "gather-2to1-pages-4to2-decode-hm": (2, 1, 4, 2, False, ("decode",)),
    "mla-2to1": (2, 1, 4, 4, True, ()),
    "mla-1to2": (1, 2, 4, 4, True, ()),
    "mla-2to1-pages-4to8": (2, 1, 4, 8, True, ()),
}


def _per_descriptor_rows(spec: ClusterSpec, plan: RoomPlan, pd: int, whole: bool) -> int:
    """Rows the per-descriptor path would post for ``plan``, summed over the sending
    prefill ranks: one per (layer, K/V, page) or granule for whole rows, one per (layer,
    K/V, token) for head slices (a lower bound: the sending ranks counted once)."""
    m = spec.model
    tokens = plan.num_pages * m.page_size
    senders = 1 if m.is_mla else spec.prefill_tp
    if not whole:
        return m.num_layers * 2 * tokens * max(1, spec.decode_tp // spec.prefill_tp)
    g = math.gcd(m.page_size, pd)
    kv = 1 if m.is_mla else 2
    return m.num_layers * kv * (tokens // g) * senders * max(1, spec.decode_tp // spec.prefill_tp)


@pytest.mark.parametrize("case", list(CASES))
def test_staged_convert_and_mla_across_processes(case: str) -> None:
    tp_p, tp_d, pp, pd, mla, hm = CASES[case]
    model = ModelSpec(
        num_layers=2,
        total_kv_heads=1 if mla else 4,
        head_dim=8,
        dtype="int32",
        page_size=pp,
        is_mla=mla,
    )
    cfg = config(heartbeat_interval_s=RELAXED_HEARTBEAT_S).model_copy(
        update={"staging": "bulk", "staging_options": {**SMALL_RING, "equal_tp": "always"}}
    )
    spec = ClusterSpec(
        model=model,
        prefill_tp=tp_p,
        decode_tp=tp_d,
        slots=128,
        aux_slots=64,
        decode_page_size=pd if pd != pp else None,
        head_major=hm,
        config=cfg,
    )
    with Cluster(spec) as c:
        plans = c.plans(16, pages=(2, 8), cached_fraction=0.3, layerwise_fraction=0.3)
        big = [RoomPlan(room=(1 << 40) + i, num_pages=8, chunks=[3, 5]) for i in range(4)]
        results = c.run(plans + big, concurrency=8, timeout_s=120)
        assert_all_ok(results)
        whole = mla or tp_p == tp_d
        for r in results[len(plans) :]:  # the large requests: a few blocks each
            rows = _per_descriptor_rows(spec, r.plan, pd, whole)
            assert 0 < r.descriptors < rows / 3, (r.descriptors, rows)
        assert_tables_empty(c)


@settings(max_examples=80, deadline=None)
@given(
    pp=st.integers(1, 8),
    pd=st.integers(1, 8),
    heads=st.sampled_from([(1, 1), (2, 1), (1, 2)]),
    data=st.data(),
)
def test_staged_units_are_the_granules_the_direct_path_moves(
    pp: int, pd: int, heads: tuple[int, int], data: st.DataObject
) -> None:
    """For any page sizes, TP pair, cached prefix and chunking: the source units a staged
    chunk gathers (:func:`src_units`) and the destination units decode scatters them into
    (the ask's ``dst_start``/``npages`` through :func:`dst_units`) are exactly the granule
    pairs the per-descriptor path moves (``PageConversion.stream_granules``), in order."""
    tp_p, tp_d = heads
    model = ModelSpec(num_layers=1, total_kv_heads=2, head_dim=2, dtype="int32", page_size=pp)
    src, _ = make_pool(model, RankPosition(tp_size=tp_p, tp_rank=0), 64)
    dst, _ = make_pool(model.model_copy(update={"page_size": pd}),
                       RankPosition(tp_size=tp_d, tp_rank=0), 64)  # fmt: skip
    mapper = (EqualTPMapper if tp_p == tp_d else HeadSliceMapper)(src, dst)
    p = mapper.paging
    if p is None:  # equal page sizes: units are pages
        return
    n = data.draw(st.integers(1, 6), label="prefill pages")
    tokens = n * pp
    lcm = p.lcm
    cached = data.draw(st.integers(0, (tokens - 1) // lcm), label="cached lcms") * lcm
    m = -(-(tokens - cached) // pd)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=3), label="cuts"))
    bounds = [0, *cuts, n]
    pages = np.random.default_rng(n).permutation(64)[:n].astype(np.int64)
    dst_pages = np.random.default_rng(m).permutation(64)[:m].astype(np.int64)
    for start, end in itertools.pairwise(bounds):
        stream, lo, hi = mapper.chunk_slice(
            n, dst_pages, pages[start:end], start, end, cached_tokens=cached
        )
        if not stream.size:
            continue
        sg, dg = p.stream_granules(stream, dst_pages[lo:hi], 64, 64)
        q = QueuedChunk(1, 0, mapper, int(stream.size), lo, "d", "e", 0, "p", 1.0, stream)
        count, first = chunk_units(q)
        assert np.array_equal(src_units(mapper, stream), sg)
        assert np.array_equal(dst_units(mapper, dst_pages, first, count), dg)


@pytest.mark.parametrize("case", ["gather-2to1-pages-4to2-decode-hm", "mla-2to1-pages-4to8"])
def test_lost_and_repeated_staging_messages(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every staging message (ask, grant, watermark) lost or repeated at random (25 % each)
    on page-converting and MLA links: no hang, every element verified, every per-request
    table empty afterwards (the reliability rules of docs/staging.md hold for granule
    units too)."""
    monkeypatch.setenv(FAULT_ENV, "lossy_staging")
    tp_p, tp_d, pp, pd, mla, hm = CASES[case]
    model = ModelSpec(num_layers=2, total_kv_heads=1 if mla else 4, head_dim=8, dtype="int32",
                      page_size=pp, is_mla=mla)  # fmt: skip
    cfg = config(heartbeat_interval_s=RELAXED_HEARTBEAT_S).model_copy(
        update={"staging": "bulk", "staging_options": {**SMALL_RING, "equal_tp": "always"}}
    )
    spec = ClusterSpec(model=model, prefill_tp=tp_p, decode_tp=tp_d, slots=128, aux_slots=64,
                       decode_page_size=pd, head_major=hm, config=cfg)  # fmt: skip
    with Cluster(spec) as c:
        assert_all_ok(c.run(c.plans(24, pages=(1, 8), cached_fraction=0.3), concurrency=12,
                            timeout_s=120))  # fmt: skip
        assert_tables_empty(c)
