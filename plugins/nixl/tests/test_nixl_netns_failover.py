"""Transport failover across hosts with one network interface down (issue 26 item 3;
docs/failover.md): prefill and decode in separate network namespaces joined by two
networks: B on ``eth0`` (10.77.0.0/24) and A on ``eth1`` (10.78.0.0/24).

Every rank runs ``--transfer-backend tcp,nixl``: ``tcp`` (first choice) binds decode's data
endpoint to its ``eth1`` address, so its bytes cross network A only; NIXL (the fallback) is
kept by UCX to TCP on ``eth0`` (network B: UCX lists devices from ``/sys/class/net``, which
shows the root namespace's, so it only accepts a name that exists there too); the control
plane (handshake, heartbeats, bootstrap) is on network B too. Nothing is faked: the fault is
decode's ``eth1`` going down (``ip link set eth1 down``) while requests are in flight. What
crossed each network is read from the kernel's interface counters, and every element of
every request is verified.

Needs root and iproute2 (skipped with the reason elsewhere).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.session.poll import KVPoll
from kvwire.testing.cluster import Cluster, ClusterSpec, RoomPlan
from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty
from kvwire.testing.netns import NetnsBed, unavailable_reason
from kvwire.testing.netns_suite import collect_reports, wait_first_chunks

logger = logging.getLogger(__name__)

A, B = 1, 0  # interface indices: eth1 carries tcp, eth0 NIXL and the control plane
#: tcp's own transfer deadline: how long a transfer posted into the dead network waits
#: before the backend reports it FAILED and the link fails over.
TCP_TIMEOUT_S = 3.0
#: kvwire's chunk deadline: above tcp's, so that the failover, not the request, ends it.
CHUNK_TIMEOUT_S = 40.0
MODEL = ModelSpec(num_layers=4, total_kv_heads=4, head_dim=64, dtype="int32", page_size=16)


@pytest.fixture
def bed() -> Iterator[NetnsBed]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with NetnsBed(("prefill", "decode"), extra_subnets=("10.78.0",)) as bed:
        yield bed


def role_config(bed: NetnsBed, node: str) -> KVWireConfig:
    options: dict[str, Any] = {
        "tcp": {"host": bed.addrs[node][A], "transfer_timeout_s": TCP_TIMEOUT_S},
        "nixl": {"ucx_env": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": bed.devs[node][B]}},
    }
    return KVWireConfig(
        transfer_backend="tcp,nixl",
        transfer_backend_options=options,
        control=ControlOptions(
            host=bed.addrs[node][B],
            bootstrap_host=bed.addrs["prefill"][B],
            heartbeat_interval_s=0.5,
            heartbeat_misses=6,
            handshake_timeout_s=20.0,
            waiting_timeout_s=90.0,
            bootstrap_timeout_s=30.0,
            transfer_timeout_s=CHUNK_TIMEOUT_S,
            failover_probe_s=0.3,
        ),
    )


def moved(bed: NetnsBed) -> tuple[int, int]:
    """Bytes that crossed decode's interface on network A and on network B so far."""
    return bed.iface_bytes("decode", A), bed.iface_bytes("decode", B)


def prefill_stats(c: Cluster) -> dict[str, Any]:
    return c.rank_stats()[c.rank("prefill").name]


@pytest.mark.slow
def test_one_interface_down_fails_over_and_back(bed: NetnsBed) -> None:
    spec = ClusterSpec(
        model=MODEL,
        slots=256,
        aux_slots=64,
        config=role_config(bed, "prefill"),
        role_config={n: role_config(bed, n) for n in ("prefill", "decode")},
        netns={n: bed.ns[n] for n in ("prefill", "decode")},
    )
    with Cluster(spec) as c:
        # 1. healthy: the link takes tcp, and its bytes cross network A
        a0, b0 = moved(bed)
        results = c.run(c.plans(12, pages=(8, 16), max_chunks=3, seed=1), concurrency=6)
        assert_all_ok(results)
        data = sum(r.bytes for r in results)
        a1, b1 = moved(bed)
        stats = prefill_stats(c)
        assert list(stats["links"].values()) == ["tcp"], stats
        assert (stats["failovers"], stats["recoveries"]) == (0, 0), stats
        assert a1 - a0 >= data, (a1 - a0, data)
        assert b1 - b0 < data / 4, f"network B carried {b1 - b0} B of {data} B of KV"

        # 2. requests in flight (chunk 0 landed over A), then decode's eth1 (A) goes down
        rooms = {100 + i for i in range(4)}
        for room in sorted(rooms):
            # held 6 s before the last chunk: the cut below must come first even when this
            # driver reads the ranks' pipes late (1.5 s left a loaded host too little)
            plan = RoomPlan(room=room, num_pages=12, chunks=[4, 8], stall_s=6.0)
            for p in c.ranks_of(plan):
                p.conn.send(("start", plan.model_dump()))
        wait_first_chunks(c, rooms)
        bed.link("decode", up=False, iface=A)
        t_down = time.monotonic()
        # their last chunks are posted over tcp into the dead network, fail after tcp's
        # deadline and are sent again over NIXL: every request completes, verified
        reports = collect_reports(c, rooms, CHUNK_TIMEOUT_S)
        for key, rep in reports.items():
            assert rep.status == int(KVPoll.Success), (key, rep)
            assert rep.mismatches == 0 and rep.aux_ok, (key, rep)
        logger.info("in-flight requests done over the fallback %.2fs after the cut",
                    time.monotonic() - t_down)  # fmt: skip
        stats = prefill_stats(c)
        assert stats["failovers"] == 1, stats
        assert list(stats["links"].values()) == ["nixl"], stats

        # 3. later requests go straight to NIXL over network B; the probe does not take tcp
        #    back while network A is down (its connection check fails)
        a2, b2 = moved(bed)
        results = c.run(c.plans(12, pages=(8, 16), max_chunks=3, seed=2), concurrency=6)
        assert_all_ok(results)
        data = sum(r.bytes for r in results)
        a3, b3 = moved(bed)
        assert a3 == a2, f"decode's interface on A is down but counted {a3 - a2} B"
        assert b3 - b2 >= data, (b3 - b2, data)
        stats = prefill_stats(c)
        assert (stats["failovers"], stats["recoveries"]) == (1, 0), stats
        assert list(stats["links"].values()) == ["nixl"], stats

        # 4. network A comes back: the probe reconnects tcp (a recovery), and new transfers cross
        #    network A again
        bed.link("decode", up=True, iface=A)
        t_up = time.monotonic()
        deadline = t_up + 90.0  # the probe's back-off doubles while the link is down
        while (stats := prefill_stats(c))["recoveries"] < 1:
            assert time.monotonic() < deadline, f"no recovery 90 s after network A came up: {stats}"
            time.sleep(0.2)
        logger.info("tcp taken back %.2fs after network A came up", time.monotonic() - t_up)
        assert stats["failovers"] == 1, stats
        assert list(stats["links"].values()) == ["tcp"], stats
        a4, b4 = moved(bed)
        results = c.run(c.plans(12, pages=(8, 16), max_chunks=3, seed=3), concurrency=6)
        assert_all_ok(results)
        data = sum(r.bytes for r in results)
        a5, b5 = moved(bed)
        assert a5 - a4 >= data, (a5 - a4, data)
        assert b5 - b4 < data / 4, f"network B carried {b5 - b4} B of {data} B of KV"
        stats = prefill_stats(c)
        assert (stats["failovers"], stats["recoveries"]) == (1, 1), stats
        # nothing failed, nothing is left on either side
        assert_tables_empty(c, timeout_s=CHUNK_TIMEOUT_S)
