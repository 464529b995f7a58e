"""The request path under load, with DEFAULT control settings (1 s heartbeats, 3 misses, default
deadlines and workers), on every transfer backend installed here: tcp always, nixl and mooncake
when their plugins resolve (skipped otherwise).

* ``test_phase_at_concurrency_64``: the ``kvwire demo`` phases 1:4 (head scatter), 2:1 (head
  gather) and 2x2:1 (2 prefill TP x 2 prefill PP -> 1 decode), each a real cluster of processes
  with 64 requests in flight at once (checked from the results' start and end times); every
  request succeeds on every rank, every element and aux row is verified, no rank evicted a
  peer, and every per-request table is empty afterwards.
* ``test_two_prefill_two_decode_instances_default_names``: two prefill instances and two decode
  instances of the same shape, managers created WITHOUT ``agent_name`` (the unique default
  names an engine following docs/engine-integration.md gets), serving one workload spread over
  every (prefill, decode) instance pair concurrently; 0 failed, every element verified.

Sizes keep the file within about three minutes on two cores for all three backends: mooncake
costs about 32 us per descriptor, so its requests are smaller (same 64 in flight).
"""

from __future__ import annotations

import re
import time

import pytest

from kvwire.config import KVWireConfig
from kvwire.demo import parse_phase
from kvwire.layout import ModelSpec
from kvwire.plugins import Kind, get_registry
from kvwire.testing.cluster import Cluster, ClusterSpec, RequestResult
from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty

BACKENDS = ("tcp", "nixl", "mooncake")
PHASES = ("1:4", "2:1", "2x2:1")
CONCURRENCY = 64
#: backend -> (requests, largest request in pages): 64 in flight for every backend.
SIZES = {"tcp": (128, 8), "nixl": (128, 8), "mooncake": (64, 4)}
MODEL = ModelSpec(num_layers=4, total_kv_heads=4, head_dim=16, dtype="int32", page_size=4)
DEFAULT_NAME = re.compile(r"^(prefill|decode)-dp\d+-pp\d+-tp\d+-[0-9a-f]{8}$")


def require_backend(name: str) -> None:
    """Skip unless the backend's plugin is installed and imports here."""
    obj, err = get_registry().try_resolve(Kind.BACKEND, name)
    if obj is None:
        pytest.skip(f"backend {name!r} is not usable here: {err}")


def max_in_flight(results: list[RequestResult]) -> int:
    """Most requests in flight at once (from the parent's start and end times)."""
    events = sorted([(r.t_start, 1) for r in results] + [(r.t_end, -1) for r in results])
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def assert_no_evictions(c: Cluster) -> None:
    stats = c.rank_stats()
    evicted = {name: s["evictions"] for name, s in stats.items() if s["evictions"]}
    assert not evicted, f"peers evicted under load with default heartbeats: {evicted}"


def summary(name: str, results: list[RequestResult], wall_s: float) -> str:
    lat = sorted(r.latency_s for r in results)
    return (
        f"{name}: {len(results)} requests in {wall_s:.2f}s, {max_in_flight(results)} in flight, "
        f"p50 {lat[len(lat) // 2] * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms, "
        f"{sum(r.bytes for r in results) / 1e6:.1f} MB, "
        f"{sum(r.descriptors for r in results) / len(results):.0f} descriptors/request"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_phase_at_concurrency_64(backend: str, phase: str) -> None:
    require_backend(backend)
    tp, pp, td, dpp = parse_phase(phase)
    requests, max_pages = SIZES[backend]
    spec = ClusterSpec(
        model=MODEL,
        prefill_tp=tp,
        prefill_pp=pp,
        decode_tp=td,
        decode_pp=dpp,
        slots=2 * CONCURRENCY * max_pages + 8,
        aux_slots=2 * CONCURRENCY + 8,
        config=KVWireConfig(transfer_backend=backend),
    )
    with Cluster(spec) as c:
        plans = c.plans(requests, pages=(1, max_pages), max_chunks=3, cached_fraction=0.2)
        t0 = time.monotonic()
        results = c.run(plans, concurrency=CONCURRENCY, timeout_s=90)
        print(summary(f"{backend} {phase}", results, time.monotonic() - t0))
        assert_all_ok(results)
        assert max_in_flight(results) == CONCURRENCY
        assert_no_evictions(c)
        assert_tables_empty(c)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_prefill_two_decode_instances_default_names(backend: str) -> None:
    require_backend(backend)
    requests, max_pages = SIZES[backend]
    spec = ClusterSpec(
        model=MODEL,
        prefill_tp=2,
        decode_tp=1,
        prefill_instances=2,
        decode_instances=2,
        default_names=True,
        slots=2 * CONCURRENCY * max_pages + 8,
        aux_slots=2 * CONCURRENCY + 8,
        config=KVWireConfig(transfer_backend=backend),
    )
    with Cluster(spec) as c:
        agents = [p.agent for p in c.procs]
        assert len(set(agents)) == len(agents), agents
        assert all(DEFAULT_NAME.match(a) for a in agents), agents
        # same-shape instances share every name but the random suffix
        assert {a.rsplit("-", 1)[0] for a in agents if a.startswith("prefill")} == {
            "prefill-dp0-pp0-tp0",
            "prefill-dp0-pp0-tp1",
        }
        assert len(set(c.bootstrap_addrs)) == 2
        plans = c.plans(requests, pages=(1, max_pages), max_chunks=3, cached_fraction=0.2)
        pairs = {(p.prefill_instance, p.decode_instance) for p in plans}
        assert pairs == {(0, 0), (0, 1), (1, 0), (1, 1)}, pairs
        t0 = time.monotonic()
        results = c.run(plans, concurrency=CONCURRENCY, timeout_s=90)
        print(summary(f"{backend} 2x(2:1)->2x1", results, time.monotonic() - t0))
        assert_all_ok(results)
        for r in results:  # every rank of the chosen instances reported, and no other
            ranks = {(rep.role, rep.inst) for rep in r.reports}
            assert ranks == {
                ("prefill", r.plan.prefill_instance),
                ("decode", r.plan.decode_instance),
            }, (r.plan, r.reports)
            assert len(r.reports) == 3
        assert max_in_flight(results) == CONCURRENCY
        assert_no_evictions(c)
        assert_tables_empty(c)
