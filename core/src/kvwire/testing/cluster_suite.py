"""End-to-end cluster tests for any backend, for pytest.

A backend plugin proves that the whole control plane works over it with a few lines::

    from kvwire.testing.cluster_suite import ClusterConformance, ClusterFailures

    class TestMyCluster(ClusterConformance):
        backend_name = "my-backend"

    class TestMyFailures(ClusterFailures):
        backend_name = "my-backend"

Every test spawns real processes (:mod:`kvwire.testing.cluster`): a prefill instance whose
rank 0 runs the bootstrap service, and one or two decode instances. Each rank has its own
backend agent and KV pool, and every element a decode rank receives is checked against the
encoding of its (layer, K/V, global head, position, dim).

:class:`ClusterConformance` (one cluster per topology, class-scoped):

* ``test_workload_verified``: 64 concurrent requests (``requests``) with chunked prefill
  (1-3 chunks, empty chunks included), random page allocations on both sides and, for a third
  of them, a prefix (sometimes all of it) already cached on decode; every request succeeds on
  every rank, every element and aux row is verified.
* ``test_room_tables_empty``: after the workload every per-room table on every rank is empty.

Topologies (``topologies`` selects a subset): equal TP (2->2), prefill larger (2->1, head
gather), decode larger (1->2, head scatter), total KV heads below TP on both sides (4->2 and
1->4 with 2 heads, replication), MLA with dummy senders (2->1), pipeline fan-in (2 PP stages x
1 TP -> 1).

:class:`ClusterFailures` (short heartbeats):

* ``test_decode_killed_mid_transfer``: a decode rank is SIGKILLed while a prefill rank holds its
  request's last chunk: the prefill room fails within a few heartbeat intervals (or sooner, by
  the engine's own error), naming the lost peer, and the prefill rank keeps serving requests
  for the other decode instance.
* ``test_prefill_killed``: decode rooms fail within a few heartbeat intervals, not after the
  waiting timeout.
* ``test_abort[prefill]`` / ``test_abort[decode]``: both sides end Failed, the error says
  who aborted, and per-room tables are empty afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.session.poll import KVPoll
from kvwire.testing.cluster import (
    FAULT_ENV,
    RELAXED_HEARTBEAT_S,
    Cluster,
    ClusterSpec,
    RequestResult,
    RoomPlan,
)

__all__ = [
    "HETERO_TOPOLOGIES",
    "TOPOLOGIES",
    "BulkEqualTPConformance",
    "BulkStagingConformance",
    "BulkStagingFaults",
    "ClusterConformance",
    "ClusterFailures",
    "assert_all_ok",
    "assert_tables_empty",
]

#: name -> (prefill_tp, prefill_pp, decode_tp, total_kv_heads, is_mla)
TOPOLOGIES: dict[str, tuple[int, int, int, int, bool]] = {
    "equal-2to2": (2, 1, 2, 4, False),
    "gather-2to1": (2, 1, 1, 4, False),
    "scatter-1to2": (1, 1, 2, 4, False),
    "gather-replicated-4to2-h2": (4, 1, 2, 2, False),
    "scatter-replicated-1to4-h2": (1, 1, 4, 2, False),
    "mla-2to1": (2, 1, 1, 1, True),
    "pp2-1to1": (1, 2, 1, 4, False),
}


#: The topologies where MHA/GQA heads are sliced (what bulk staging is for).
HETERO_TOPOLOGIES = (
    "gather-2to1",
    "scatter-1to2",
    "gather-replicated-4to2-h2",
    "scatter-replicated-1to4-h2",
)

#: Equal-TP topologies (whole pages), which bulk staging stages on GPU pools by its rule, and
#: everywhere with ``equal_tp="always"``.
EQUAL_TOPOLOGIES = ("equal-2to2", "pp2-1to1")

#: Bulk staging sizes small enough that a workload wraps the ring many times.
SMALL_RING = {"ring_bytes": 256 * 1024, "buffer_bytes": 64 * 1024, "block_bytes": 4096}


def assert_tables_empty(c: Cluster, timeout_s: float = 10.0) -> None:
    """Every live rank's per-request tables become empty (waiting briefly for late
    confirmations such as WritesDone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {
            name: {k: v for k, v in t.items() if v and not k.startswith("drop")}
            for name, t in c.room_tables().items()
        }
        left = {name: t for name, t in left.items() if t}
        if not left:
            return
        assert time.monotonic() < deadline, f"per-request state left behind: {left}"
        time.sleep(0.2)


def assert_all_ok(results: list[RequestResult]) -> None:
    """Every request succeeded on every rank with every element and aux row verified."""
    bad = [r for r in results if not r.ok]
    assert not bad, (
        f"{len(bad)} of {len(results)} requests failed or were corrupted; first: "
        f"{bad[0].plan} -> {bad[0].reports}"
    )
    assert sum(r.mismatches for r in results) == 0


def _next_report(conn: Any, timeout_s: float) -> tuple[Any, int]:
    """The next request report a rank process sends (progress messages skipped)."""
    deadline = time.monotonic() + timeout_s
    while conn.poll(max(0.0, deadline - time.monotonic())):
        msg = conn.recv()
        if msg[0] == "done":
            return msg[1], msg[2]
    raise AssertionError(f"no request report within {timeout_s:.1f}s")


class _Base:
    backend_name: ClassVar[str] = "tcp"
    backend_options: ClassVar[dict[str, Any]] = {}

    staging: ClassVar[str] = "direct"
    staging_options: ClassVar[dict[str, Any]] = {}

    @classmethod
    def config(cls, **control: Any) -> KVWireConfig:
        return KVWireConfig(
            transfer_backend=cls.backend_name,
            transfer_backend_options=dict(cls.backend_options),
            staging=cls.staging,
            staging_options=dict(cls.staging_options),
            control=ControlOptions(**control),
        )


class ClusterConformance(_Base):
    """Verified end-to-end transfers over several TP/PP topologies."""

    requests: ClassVar[int] = 64
    concurrency: ClassVar[int] = 64
    #: Names from :data:`TOPOLOGIES` to run (all by default).
    topologies: ClassVar[tuple[str, ...]] = tuple(TOPOLOGIES)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """One class-scoped cluster per selected topology."""
        if "cluster" in metafunc.fixturenames:
            unknown = set(self.topologies) - set(TOPOLOGIES)
            assert not unknown, f"unknown topologies {unknown}; known: {list(TOPOLOGIES)}"
            metafunc.parametrize(
                "cluster", self.topologies, indirect=True, scope="class", ids=self.topologies
            )

    @pytest.fixture(scope="class")
    @classmethod
    def cluster(cls, request: pytest.FixtureRequest) -> Iterator[Cluster]:
        tp, pp, td, heads, mla = TOPOLOGIES[request.param]
        model = ModelSpec(
            num_layers=4,
            total_kv_heads=heads,
            head_dim=16,
            dtype="int32",
            page_size=4,
            is_mla=mla,
        )
        spec = ClusterSpec(
            model=model,
            prefill_tp=tp,
            prefill_pp=pp,
            decode_tp=td,
            slots=512,
            aux_slots=128,
            config=cls.config(),
        )
        with Cluster(spec) as c:
            yield c

    def test_workload_verified(self, cluster: Cluster) -> None:
        plans = cluster.plans(
            self.requests, pages=(0, 8), max_chunks=3, cached_fraction=0.35, layerwise_fraction=0.4
        )
        plans.append(  # a request whose whole prefix is cached on decode
            RoomPlan(room=plans[0].room ^ 1, num_pages=3, chunks=[2, 1], cached_pages=3)
        )
        plans.append(  # chunked prefill with an empty chunk in the middle
            RoomPlan(room=plans[0].room ^ 2, num_pages=7, chunks=[3, 0, 4])
        )
        results = cluster.run(plans, concurrency=self.concurrency, timeout_s=180)
        assert_all_ok(results)
        moved = sum(r.bytes for r in results)
        assert moved > 0

    def test_room_tables_empty(self, cluster: Cluster) -> None:
        cluster.run(cluster.plans(8, seed=99), concurrency=8)
        assert_tables_empty(cluster)


class ClusterFailures(_Base):
    """Failure handling across processes: dead peers, aborts."""

    #: 0.2 s evicted live ranks at load 25-35, and 0.5 s a live rank of a loaded CI host
    heartbeat_interval_s: ClassVar[float] = RELAXED_HEARTBEAT_S
    heartbeat_misses: ClassVar[int] = 3

    def spec(self, decode_instances: int = 1) -> ClusterSpec:
        model = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype="int32", page_size=2)
        return ClusterSpec(
            model=model,
            decode_instances=decode_instances,
            slots=128,
            aux_slots=64,
            config=self.config(
                heartbeat_interval_s=self.heartbeat_interval_s,
                heartbeat_misses=self.heartbeat_misses,
                waiting_timeout_s=60.0,
                bootstrap_timeout_s=30.0,
            ),
        )

    @property
    def detect_s(self) -> float:
        """How fast a dead peer must be noticed: a few heartbeat intervals, plus slack."""
        return self.heartbeat_interval_s * (self.heartbeat_misses + 2) + 3.0

    @staticmethod
    def _report(res: RequestResult, role: str) -> Any:
        return next(r for r in res.reports if r.role == role)

    @pytest.mark.parametrize("layerwise", [False, True], ids=["per_chunk", "layerwise"])
    def test_decode_killed_mid_transfer(self, layerwise: bool) -> None:
        """Decode dies while prefill stalls before its last chunk (``layerwise``: the last
        chunk is sent layer-wise and its pass is still running: its layers are not marked)."""
        with Cluster(self.spec(decode_instances=2)) as c:
            victim = RoomPlan(
                room=11, num_pages=4, chunks=[2, 2], stall_s=60.0, layerwise=layerwise
            )
            for p in c.ranks_of(victim):
                p.conn.send(("start", victim.model_dump()))
            c.wait_sent(11)  # decode has asked; prefill sent the first chunk and stalls
            t_kill = time.monotonic()
            c.kill("decode", inst=0)
            prefill = c.procs[0]
            rep, room = _next_report(prefill.conn, self.detect_s)
            took = time.monotonic() - t_kill
            assert room == 11
            assert rep.status == int(KVPoll.Failed)
            # found through its closed control connection ("peer ... lost") or by the
            # engine's own transfer error, never by waiting out its silence; either way the
            # error names the dead peer
            assert rep.error and "decode0-pp0-tp0" in rep.error, rep.error
            assert "no heartbeat" not in rep.error, rep.error
            assert took < self.detect_s
            # prefill keeps serving the other decode instance
            plans = [p.model_copy(update={"decode_instance": 1}) for p in c.plans(8)]
            assert_all_ok(c.run(plans, concurrency=8, ignore_dead=True))
            assert_tables_empty(c)

    def test_prefill_killed(self) -> None:
        with Cluster(self.spec()) as c:
            plan = RoomPlan(room=12, num_pages=4, chunks=[2, 2], stall_s=60.0)
            for p in c.ranks_of(plan):
                p.conn.send(("start", plan.model_dump()))
            c.wait_sent(12)
            t_kill = time.monotonic()
            c.kill("prefill")
            decode = next(p for p in c.procs if p.role == "decode")
            rep, room = _next_report(decode.conn, self.detect_s)
            assert room == 12
            assert rep.status == int(KVPoll.Failed)
            assert "lost" in (rep.error or ""), rep.error
            assert "no heartbeat" not in (rep.error or ""), rep.error  # its connection closed
            assert time.monotonic() - t_kill < self.detect_s  # far below waiting_timeout_s=60

    @pytest.mark.parametrize("side", ["prefill", "decode"])
    def test_abort(self, side: str) -> None:
        with Cluster(self.spec()) as c:
            plan = RoomPlan(
                room=13,
                num_pages=6,
                chunks=[2, 2, 2],
                stall_s=3.0,
                prefill_abort=side == "prefill",
                decode_abort=side == "decode",
            )
            (res,) = c.run([plan], timeout_s=60)
            for r in res.reports:
                assert r.status == int(KVPoll.Failed), res.reports
                assert r.error and "aborted by " + side in r.error, r.error
            assert_all_ok(c.run(c.plans(4), concurrency=4))
            assert_tables_empty(c)


class BulkStagingConformance(ClusterConformance):
    """The cluster workload with ``--staging bulk`` on the head-sliced topologies, with a ring
    small enough to wrap many times; each request must have moved through a few large
    descriptors instead of one per token."""

    staging = "bulk"
    staging_options = SMALL_RING
    topologies = HETERO_TOPOLOGIES

    def test_staged_not_per_token(self, cluster: Cluster) -> None:
        plans = [RoomPlan(room=(1 << 40) + i, num_pages=8, chunks=[3, 5]) for i in range(24)]
        results = cluster.run(plans, concurrency=24, timeout_s=120)
        assert_all_ok(results)
        m = cluster.spec.model
        per_token = m.num_layers * 2 * 8 * m.page_size  # rows of the per-token path
        for r in results:
            assert r.descriptors < per_token / 4, (r.descriptors, per_token)
        moved = sum(r.bytes for r in results)
        assert moved > 3 * SMALL_RING["ring_bytes"], "the workload must wrap the ring"


class BulkEqualTPConformance(ClusterConformance):
    """The cluster workload with ``--staging bulk`` on equal-TP topologies, staged on host
    pools too (``equal_tp="always"``; the default rule stages them only on GPUs) through a
    ring that wraps many times: every element verified, and each request moved through a few
    block descriptors instead of one per (layer, K/V, page)."""

    staging = "bulk"
    staging_options = {**SMALL_RING, "equal_tp": "always"}
    topologies = EQUAL_TOPOLOGIES

    def test_staged_not_per_page(self, cluster: Cluster) -> None:
        plans = [RoomPlan(room=(1 << 41) + i, num_pages=8, chunks=[3, 5]) for i in range(24)]
        results = cluster.run(plans, concurrency=24, timeout_s=120)
        assert_all_ok(results)
        spec = cluster.spec  # rows of the per-page path, summed over the prefill ranks
        per_page = spec.model.num_layers * 2 * 8 * spec.prefill_tp
        for r in results:
            assert r.descriptors < per_page / 3, (r.descriptors, per_page)
        moved = sum(r.bytes for r in results)
        assert moved > 3 * SMALL_RING["ring_bytes"], "the workload must wrap the ring"
        # a chunk's consecutive blocks go as spans of 2**k blocks (kvwire.staging.spans):
        # one row per block would carry at most a block each
        per_row = moved / sum(r.descriptors for r in results)
        assert per_row > 1.5 * SMALL_RING["block_bytes"], per_row


class BulkStagingFaults(_Base):
    """Bulk staging under faults: lossy staging messages, a decode that dies holding ring
    space, aborts mid-request. No hang, every element verified where a request succeeds, and
    every per-request table (ring allocations and staging requests included) empty after."""

    staging = "bulk"
    staging_options = SMALL_RING
    #: 0.2 s evicted live ranks at load 25-35, and 0.5 s a live rank of a loaded CI host
    heartbeat_interval_s: ClassVar[float] = RELAXED_HEARTBEAT_S

    def spec(self, decode_instances: int = 1) -> ClusterSpec:
        model = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=4)
        return ClusterSpec(
            model=model,
            prefill_tp=2,
            decode_tp=1,
            decode_instances=decode_instances,
            slots=256,
            aux_slots=64,
            config=self.config(heartbeat_interval_s=self.heartbeat_interval_s),
        )

    def test_lost_and_duplicated_staging_messages(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(FAULT_ENV, "lossy_staging")
        with Cluster(self.spec()) as c:
            assert_all_ok(c.run(c.plans(32, pages=(1, 8)), concurrency=16, timeout_s=120))
            assert_tables_empty(c)

    def test_decode_dies_holding_ring_space(self) -> None:
        with Cluster(self.spec(decode_instances=2)) as c:
            victim = RoomPlan(room=21, num_pages=6, chunks=[3, 3], stall_s=60.0)
            for p in c.ranks_of(victim):
                p.conn.send(("start", victim.model_dump()))
            for tp in range(2):  # every prefill rank has been asked (else only its
                c.wait_sent(21, tp=tp)  # bootstrap timeout could fail the room there)
            c.kill("decode", inst=0)
            rep, room = _next_report(c.procs[0].conn, 10.0)
            assert room == 21 and rep.status == int(KVPoll.Failed)
            plans = [p.model_copy(update={"decode_instance": 1}) for p in c.plans(8)]
            assert_all_ok(c.run(plans, concurrency=8, ignore_dead=True))
            assert_tables_empty(c)

    @pytest.mark.parametrize("side", ["prefill", "decode"])
    def test_abort_mid_request_frees_ring_space(self, side: str) -> None:
        with Cluster(self.spec()) as c:
            plans = [
                RoomPlan(
                    room=30 + i,
                    num_pages=8,
                    chunks=[2, 2, 2, 2],
                    stall_s=1.0,
                    prefill_abort=side == "prefill",
                    decode_abort=side == "decode",
                )
                for i in range(6)
            ]
            for res in c.run(plans, concurrency=6, timeout_s=60):
                assert all(r.status == int(KVPoll.Failed) for r in res.reports), res.reports
            assert_tables_empty(c)
            assert_all_ok(c.run(c.plans(8), concurrency=8))


class GroupsConformance(_Base):
    """Buffer groups across real processes (:attr:`ClusterSpec.groups`): a state split by
    heads, a replicated state, a multi-section (GDN conv) state, a sliding window and draft
    pages, each rank its own process and backend agent, for TP 2 -> 1 and 1 -> 2.

    * ``test_groups_verified``: ``requests`` requests with chunked prefill, cached prefixes and
      layer-wise sends; every element of every group slot (the request's state slot, only the
      window's last pages, the draft pages not cached) and of the KV is checked on decode.
    """

    requests: ClassVar[int] = 12
    topologies: ClassVar[tuple[str, ...]] = ("gather-2to1", "scatter-1to2")
    #: Group names (:data:`~kvwire.testing.cluster_groups.GROUP_KINDS`); all by default.
    groups: ClassVar[tuple[str, ...]] = (
        "state_heads",
        "state_replicated",
        "state_sections",
        "window",
        "draft",
    )

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """One class-scoped cluster per selected topology."""
        if "group_cluster" in metafunc.fixturenames:
            metafunc.parametrize(
                "group_cluster", self.topologies, indirect=True, scope="class", ids=self.topologies
            )

    @classmethod
    def spec(cls, tp: int, td: int, heads: int, **kw: Any) -> ClusterSpec:
        model = ModelSpec(num_layers=2, total_kv_heads=heads, head_dim=4, dtype="int32",
                          page_size=4)  # fmt: skip
        return ClusterSpec(model=model, prefill_tp=tp, decode_tp=td, slots=128, aux_slots=32,
                           config=cls.config(), groups=cls.groups, **kw)  # fmt: skip

    @pytest.fixture(scope="class")
    @classmethod
    def group_cluster(cls, request: pytest.FixtureRequest) -> Iterator[Cluster]:
        tp, _, td, heads, _ = TOPOLOGIES[request.param]
        with Cluster(cls.spec(tp, td, heads)) as c:
            yield c

    def test_groups_verified(self, group_cluster: Cluster) -> None:
        plans = group_cluster.plans(
            self.requests, pages=(1, 7), max_chunks=3, cached_fraction=0.3, layerwise_fraction=0.3
        )
        results = group_cluster.run(plans, concurrency=8, timeout_s=120)
        assert_all_ok(results)
        assert_tables_empty(group_cluster)
