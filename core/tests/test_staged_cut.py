"""A staged chunk longer than one staging buffer is cut into chunks the buffer holds
(issue 27 item 3: staged bulk writes for large requests), across real processes on the
``tcp`` backend: every element verified, each large request moved in a few block descriptors
instead of falling back to one per (layer, K/V, page or token), the decode ring wrapping
within one request (a request larger than the ring waits for its own earlier chunks'
scatters), and nothing left in any table.

The buffer here holds two pages of whole rows (four of head slices) and the ring eight whole-row
pages, so a 12-page chunk is cut in 3-6 staged chunks and never fits the ring at once."""

from __future__ import annotations

import pytest

from kvwire.layout import ModelSpec
from kvwire.testing.cluster import RELAXED_HEARTBEAT_S, Cluster, ClusterSpec, RoomPlan
from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty
from kvwire.testing.pair import config

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=2)
#: A whole-row page is 1 KiB (2 layers x K/V x 2 tokens x 128 B), a head slice of TP 2 -> 1
#: half that.
CUT = {"ring_bytes": 8192, "buffer_bytes": 2048, "block_bytes": 1024, "equal_tp": "always"}
#: (prefill TP, decode TP, decode page size)
CASES = {
    "heads-2to1": (2, 1, None),
    "equal-1to1": (1, 1, None),
    "equal-1to1-pages-2to4": (1, 1, 4),
    "heads-1to2": (1, 2, None),
}


def _per_descriptor_rows(spec: ClusterSpec, pages: int) -> int:
    """Rows the unstaged path posts for one request of ``pages`` prefill pages (a lower
    bound, summed over the sending ranks): one per (layer, K/V, page) for whole rows, one per
    (layer, K/V, token) for head slices."""
    m = spec.model
    pairs = m.num_layers * 2
    if spec.prefill_tp == spec.decode_tp:
        return pairs * pages
    return pairs * pages * m.page_size * max(spec.prefill_tp, spec.decode_tp)


@pytest.mark.parametrize("case", list(CASES))
def test_a_chunk_longer_than_the_buffer_is_staged_in_pieces(case: str) -> None:
    tp_p, tp_d, pd = CASES[case]
    cfg = config(heartbeat_interval_s=RELAXED_HEARTBEAT_S).model_copy(
        update={"staging": "bulk", "staging_options": CUT}
    )
    spec = ClusterSpec(
        model=MODEL,
        prefill_tp=tp_p,
        decode_tp=tp_d,
        slots=160,
        aux_slots=64,
        decode_page_size=pd,
        config=cfg,
    )
    with Cluster(spec) as c:
        plans = c.plans(12, pages=(1, 6), cached_fraction=0.3, layerwise_fraction=0.2)
        big = [RoomPlan(room=(1 << 40) + i, num_pages=12, chunks=[12]) for i in range(6)]
        big += [RoomPlan(room=(1 << 41) + i, num_pages=11, chunks=[5, 6]) for i in range(2)]
        results = c.run(plans + big, concurrency=6, timeout_s=120)
        assert_all_ok(results)
        for r in results[len(plans) :]:
            rows = _per_descriptor_rows(spec, r.plan.num_pages)
            assert 0 < r.descriptors <= rows / 3, (r.descriptors, rows)
        assert_tables_empty(c)
