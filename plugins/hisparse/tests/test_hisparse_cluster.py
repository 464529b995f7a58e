"""The HiSparse path end to end (real processes): decode ranks with a host pool of page size 1
or 2 (prefill's is 4) serve HiSparse and regular requests side by side; every element is checked
in the host pool; the engine hooks run exactly once per request on success, failure and abort.

Each backend runs both host-pool paths of the ``hisparse`` host staging: ``engine`` (the pool is
private memory, so the backend writes it) and ``mapped`` (the pool is a SharedHostPool on this
host, so prefill copies into it itself), and the test checks which one prefill chose."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import ClassVar

import numpy as np
import pytest

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.session.poll import KVPoll
from kvwire.testing.cluster import RELAXED_HEARTBEAT_S, Cluster, ClusterSpec, RoomPlan
from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty

MODEL = ModelSpec(num_layers=3, total_kv_heads=2, head_dim=8, dtype="int32", page_size=4)


def mixed_plans(n: int, units: int, seed: int) -> list[RoomPlan]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        pages = int(rng.integers(1, 7))
        cut = int(rng.integers(0, pages + 1))
        chunks = [cut, pages - cut]
        hisparse = i % 2 == 0
        out.append(
            RoomPlan(
                room=secrets.randbits(63),
                num_pages=pages,
                chunks=chunks,
                hisparse=hisparse,
                trim=int(rng.integers(0, units)) if hisparse else 0,
                cached_pages=0 if hisparse else int(rng.integers(0, 2)),
                layerwise=i % 4 < 2,  # both paths, layer-wise and per chunk
            )
        )
    return out


class _HiSparse:
    backend_name: ClassVar[str] = "tcp"
    #: (host page size, shared pool) per cluster: each backend runs both paths.
    shapes: ClassVar[list[tuple[int, bool]]] = [(1, False), (2, True)]

    @pytest.fixture(scope="class", params=[0, 1], ids=["first", "second"])
    @classmethod
    def cluster(cls, request: pytest.FixtureRequest) -> Iterator[Cluster]:
        page, shared = cls.shapes[request.param]
        spec = ClusterSpec(
            model=MODEL,
            slots=128,
            aux_slots=64,
            host_page_size=page,
            host_shared=shared,
            config=KVWireConfig(
                transfer_backend=cls.backend_name,
                control=ControlOptions(heartbeat_interval_s=RELAXED_HEARTBEAT_S),
            ),
        )
        with Cluster(spec) as c:
            yield c

    def test_mixed_requests_verified_with_hooks(self, cluster: Cluster) -> None:
        units = MODEL.page_size // (cluster.spec.host_page_size or 1)
        plans = mixed_plans(40, units, seed=cluster.spec.host_page_size or 0)
        results = cluster.run(plans, concurrency=16, timeout_s=120)
        assert_all_ok(results)
        ph = cluster.spec.host_page_size or 1
        for res in results:
            (dec,) = [r for r in res.reports if r.role == "decode"]
            if res.plan.hisparse:
                n = res.plan.num_pages * units - res.plan.trim
                assert dec.hooks == (f"prealloc:{n}", f"admit:{n * ph}"), dec.hooks
            else:
                assert dec.hooks == ()
        assert_tables_empty(cluster)
        want = "mapped" if cluster.spec.host_shared else "engine"
        paths = cluster.host_paths()
        assert paths and all(list(p.values()) == [want] for p in paths.values()), paths

    def test_the_aux_row_rides_in_the_last_note(self, cluster: Cluster) -> None:
        """A request sent whole (one last send) moves its KV and nothing else on either host
        path: the aux row rides in the last chunk's note (protocol 1.11), also when that note
        follows prefill's own copy into a shared pool (``mapped``), and lands right (the
        cluster checks every aux row)."""
        page_bytes = 2 * MODEL.num_layers * MODEL.page_size * MODEL.total_kv_heads
        page_bytes *= MODEL.head_dim * 4
        plans = [
            RoomPlan(room=secrets.randbits(63), num_pages=p, chunks=[p], hisparse=True)
            for p in (1, 3, 4)
        ]
        results = cluster.run(plans, concurrency=3, timeout_s=60)
        assert_all_ok(results)
        for res in results:
            (pre,) = [r for r in res.reports if r.role == "prefill"]
            (dec,) = [r for r in res.reports if r.role == "decode"]
            assert dec.aux_ok and pre.bytes == res.plan.num_pages * page_bytes, pre.bytes
        assert_tables_empty(cluster)

    @pytest.mark.parametrize("side", ["prefill", "decode"])
    def test_abort_abandons_exactly_once(self, cluster: Cluster, side: str) -> None:
        plan = RoomPlan(
            room=secrets.randbits(63),
            num_pages=4,
            chunks=[2, 2],
            hisparse=True,
            stall_s=2.0,
            prefill_abort=side == "prefill",
            decode_abort=side == "decode",
        )
        (res,) = cluster.run([plan], timeout_s=60)
        (dec,) = [r for r in res.reports if r.role == "decode"]
        assert dec.status == int(KVPoll.Failed)
        units = MODEL.page_size // (cluster.spec.host_page_size or 1)
        assert dec.hooks == (f"prealloc:{4 * units}", "abandon"), dec.hooks
        assert_tables_empty(cluster)


class TestHiSparseTcp(_HiSparse):
    backend_name = "tcp"


class TestHiSparseNixl(_HiSparse):
    backend_name = "nixl"
    shapes: ClassVar[list[tuple[int, bool]]] = [(1, True), (2, False)]
