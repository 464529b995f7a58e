"""DP attention on prefill combined with pipeline and tensor parallelism on both sides (issue 16).

A prefill instance with ``dp`` attention DP ranks runs ``dp`` groups of TP x PP ranks that all
register with the instance's one bootstrap service, each with its ``dp_rank``; decode asks the
service for DP rank ``room % dp`` (SGLang's rule) and pairs with that group's ranks only. One
process per rank, real managers, every element and aux row verified on decode, some requests
layer-wise, chunked, with cached prefixes.
"""

from __future__ import annotations

import pytest

from kvwire.layout import ModelSpec
from kvwire.testing.cluster import RELAXED_HEARTBEAT_S, Cluster, ClusterSpec
from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty
from kvwire.testing.pair import config

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(
    ("dp", "tp", "pp", "dtp", "dpp", "mla", "backend"),
    [
        (2, 2, 2, 1, 2, False, "tcp"),  # DP x TP x PP -> TP 1 x PP 2 (gather, stages)
        (2, 1, 2, 2, 1, True, "tcp"),  # MLA: DP x PP -> TP 2 (replicated latent)
        (2, 2, 1, 4, 1, False, "nixl"),  # DP x TP 2 -> TP 4 (scatter with replication)
    ],
    ids=["dp2-tp2-pp2-to-tp1-pp2", "mla-dp2-pp2-to-tp2", "nixl-dp2-tp2-to-tp4-h2"],
)
def test_dp_ranks_serve_their_requests(
    dp: int, tp: int, pp: int, dtp: int, dpp: int, mla: bool, backend: str
) -> None:
    # 10-12 processes on the 2-core CI machine: 0.5 s beats evicted a live rank there
    # (RELAXED_HEARTBEAT_S says why); liveness has its own tests
    spec = ClusterSpec(
        model=ModelSpec(
            num_layers=4,
            total_kv_heads=1 if mla else 2,
            head_dim=8,
            dtype="int32",
            page_size=4,
            is_mla=mla,
        ),
        prefill_tp=tp,
        prefill_pp=pp,
        prefill_dp=dp,
        decode_tp=dtp,
        decode_pp=dpp,
        slots=256,
        aux_slots=64,
        config=config(heartbeat_interval_s=RELAXED_HEARTBEAT_S).model_copy(
            update={"transfer_backend": backend}
        ),
    )
    with Cluster(spec) as c:
        plans = c.plans(24, pages=(1, 6), cached_fraction=0.3, layerwise_fraction=0.4)
        served = {p.prefill_instance for p in plans}
        assert served == set(range(dp)), served  # both DP ranks take requests
        results = c.run(plans, concurrency=12, timeout_s=120)
        # only DP rank room % dp's ranks were given each request: had decode asked another
        # group, that group would never have sent and the request would have failed
        assert_all_ok(results)
        assert_tables_empty(c)
