"""Staged bulk writes for the shapes that moved by descriptors before (issue 27 item 3, issue
28): page-size conversion (equal TP and heterogeneous TP, pages growing and shrinking, a
head-major side) and MLA (TP 2 -> 1 with a dummy sender, 1 -> 2 replicated), across real
processes on the ``tcp`` backend: every element verified, and each request moved in a few
block descriptors instead of one per (layer, K/V, granule or page).

Host pools stage head slices by default; whole rows (equal TP, MLA) only with
``equal_tp="always"`` (the default rule stages them on GPU pools: ``test_staging_rule.py``).
"""

from __future__ import annotations

import math

import pytest

from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster, ClusterSpec, RoomPlan
from kvwire.testing.cluster_suite import SMALL_RING, assert_all_ok, assert_tables_empty
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
    cfg = config(heartbeat_interval_s=0.5).model_copy(
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
