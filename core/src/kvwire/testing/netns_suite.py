"""Cross-host tests of one backend: prefill and decode ranks in separate network namespaces
(:mod:`kvwire.testing.netns`), every plane bound to the namespace addresses.

Subclass :class:`NetnsConformance` in a test module and set ``backend_name`` (and
``backend_options(addr)`` when the backend binds an address of its own). The tests:

* ``test_workload_across_namespaces``: a verified workload; every rank advertises its
  namespace address (control endpoint, bootstrap), never loopback.
* ``test_loopback_advertised`` (prefill or decode): a rank whose ``control.host`` is loopback
  fails the request at handshake with an error that names the loopback endpoint and the
  setting to fix, well before the handshake timeout.
* ``test_bootstrap_in_third_namespace``: a standalone ``kvwire bootstrap`` in its own
  namespace; requests verified, and they keep flowing while the bootstrap host is cut off.
* ``test_peer_restarted_during_partition``: a decode rank restarted while the link is down
  is taken as a restart at once when it returns.
* ``test_prefill_restarted_during_partition``: a prefill rank that died during a partition
  and came back after it: decode evicts the old incarnation within its liveness bound and
  then serves requests through the new one.
* ``test_throttled_congested_link``: a 200 Mbit/s link with a small queue (drops and
  retransmits); every request still succeeds, verified.
* ``test_partition_then_recovery``: the decode namespace is cut off while requests are in
  flight; every one fails on both sides within ``heartbeat_interval_s x heartbeat_misses`` (plus
  a grace), naming the peer; after the link returns, new requests between the same ranks
  succeed (no restart) and every table is empty.

Each test skips, with the reason, where namespaces cannot be built (not root, no iproute2).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.session.poll import KVPoll
from kvwire.testing.cluster import (
    Cluster,
    ClusterSpec,
    RankReport,
    RoomPlan,
    free_bootstrap_port,
)
from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty
from kvwire.testing.netns import NetnsBed, in_netns, unavailable_reason

logger = logging.getLogger(__name__)

#: Extra time over the liveness bound for the failure to reach the engine's poll (the liveness
#: thread's tick, the engine loop, the report pipe) and for the observer's own starvation,
#: which its liveness thread does not hold against the silent peer (up to 1.4 s on a loaded
#: CI host; 1 s left no room for it).
GRACE_S = 2.0
#: Chunk transfer deadline of the test bed's ranks: after a silent loss, a failed room's pages
#: stay quarantined this long (+1 s), since the lost peer's writes may still be in the network.
TRANSFER_TIMEOUT_S = 4.0


def collect_reports(
    c: Cluster, rooms: set[int], timeout_s: float, role: str | None = None
) -> dict[tuple[str, int], RankReport]:
    """The next report of every rank of ``c`` (of ``role`` only, if given) for each room in
    ``rooms``, keyed by (rank process name, room); progress messages are skipped. Fails after
    ``timeout_s``."""
    procs = [p for p in c.procs if role is None or p.role == role]
    want = {(p.name, room) for p in procs for room in rooms}
    got: dict[tuple[str, int], RankReport] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(want):
        left = deadline - time.monotonic()
        assert left > 0, f"no report within {timeout_s:.1f}s for {sorted(want - set(got))}"
        for p in procs:
            while p.conn.poll(0):
                msg = p.conn.recv()
                if msg[0] == "done" and (p.name, msg[2]) in want:
                    got[(p.name, msg[2])] = msg[1]
        time.sleep(0.005)
    return got


def wait_first_chunks(c: Cluster, rooms: set[int], timeout_s: float = 20.0) -> None:
    """Wait until prefill rank 0 has sent chunk 0 of every room (decode has asked for each)."""
    p = c.rank("prefill")
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while seen != rooms:
        assert time.monotonic() < deadline, f"chunks 0 not sent for {sorted(rooms - seen)}"
        if p.conn.poll(0.05):
            msg = p.conn.recv()
            if msg[0] == "sent" and msg[1] == 0:
                seen.add(msg[2])


def start_stalled(c: Cluster, rooms: set[int]) -> None:
    """Start a request per room that stalls before its last chunk, and wait until each has
    moved its first (decode asked, prefill sent chunk 0): requests in flight for a fault."""
    for room in sorted(rooms):
        plan = RoomPlan(room=room, num_pages=4, chunks=[2, 2], stall_s=60.0)
        for p in c.ranks_of(plan):
            p.conn.send(("start", plan.model_dump()))
    wait_first_chunks(c, rooms)


class NetnsConformance:
    """Prefill and decode in their own namespaces, joined by a bridge."""

    backend_name: ClassVar[str] = "tcp"
    heartbeat_interval_s: ClassVar[float] = 0.5  # 0.2 s evicted live ranks at load 25-35
    heartbeat_misses: ClassVar[int] = 3
    handshake_timeout_s: ClassVar[float] = 10.0

    @classmethod
    def backend_options(cls, addr: str) -> dict[str, Any]:
        """The backend's options on a node with address ``addr``."""
        return {"host": addr}

    @pytest.fixture
    def bed(self) -> Iterator[NetnsBed]:
        reason = unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
        with NetnsBed(("prefill", "decode")) as bed:
            yield bed

    @pytest.fixture
    def bed3(self) -> Iterator[tuple[NetnsBed, str]]:
        """Three nodes, a standalone ``kvwire bootstrap`` on the third: (bed, its address)."""
        reason = unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
        with (
            NetnsBed(("prefill", "decode", "bootstrap")) as bed,
            standalone_bootstrap(bed, "bootstrap") as addr,
        ):
            yield bed, addr

    def role_config(self, bed: NetnsBed, node: str, **control: Any) -> KVWireConfig:
        addr = bed.addr[node]
        options: dict[str, Any] = {
            "host": addr,
            "bootstrap_host": bed.addr["prefill"],
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "heartbeat_misses": self.heartbeat_misses,
            "handshake_timeout_s": self.handshake_timeout_s,
            "waiting_timeout_s": 60.0,
            "bootstrap_timeout_s": 30.0,
            # bounds how long a failed room's pages stay quarantined after a partition
            "transfer_timeout_s": TRANSFER_TIMEOUT_S,
        }
        options.update(control)
        return KVWireConfig(
            transfer_backend=self.backend_name,
            transfer_backend_options=self.backend_options(addr),
            control=ControlOptions(**options),
        )

    def spec(
        self,
        bed: NetnsBed,
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
        model: ModelSpec | None = None,
        slots: int = 128,
    ) -> ClusterSpec:
        model = model or ModelSpec(
            num_layers=2, total_kv_heads=2, head_dim=8, dtype="int32", page_size=2
        )
        role_config = {
            "prefill": self.role_config(bed, "prefill", **(prefill or {})),
            "decode": self.role_config(bed, "decode", **(decode or {})),
        }
        return ClusterSpec(
            model=model,
            slots=slots,
            aux_slots=64,
            config=role_config["prefill"],
            role_config=role_config,
            netns={role: bed.ns[role] for role in ("prefill", "decode")},
        )

    @property
    def liveness_bound_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses

    # ------------------------------------------------------------------- tests
    @pytest.mark.slow
    def test_workload_across_namespaces(self, bed: NetnsBed) -> None:
        with Cluster(self.spec(bed)) as c:
            assert c.bootstrap_addr.startswith(bed.addr["prefill"] + ":"), c.bootstrap_addr
            for p in c.procs:
                assert p.endpoint.startswith(f"tcp://{bed.addr[p.role]}:"), (p.name, p.endpoint)
            results = c.run(c.plans(24, pages=(0, 8), max_chunks=3), concurrency=8, timeout_s=60)
            assert_all_ok(results)
            assert sum(r.bytes for r in results) > 0
            assert_tables_empty(c)

    @pytest.mark.slow
    @pytest.mark.parametrize("side", ["prefill", "decode"])
    def test_loopback_advertised(self, bed: NetnsBed, side: str) -> None:
        """A rank that advertises a loopback control endpoint to a peer in another namespace
        fails the handshake at once, naming the endpoint and the setting."""
        wrong = {"host": "127.0.0.1"}
        spec = self.spec(bed, prefill=wrong) if side == "prefill" else self.spec(bed, decode=wrong)
        with Cluster(spec) as c:
            plan = RoomPlan(room=21, num_pages=2, chunks=[2])
            t0 = time.monotonic()
            for p in c.ranks_of(plan):
                p.conn.send(("start", plan.model_dump()))
            decode = c.rank("decode")
            # decode refuses at once; a prefill rank that advertises loopback cannot be told
            # (it learns at bootstrap_timeout_s), one that can be reached is told at once
            reports = collect_reports(c, {21}, self.handshake_timeout_s, role="decode")
            rep = reports[(decode.name, 21)]
            took = time.monotonic() - t0
            assert rep.status == int(KVPoll.Failed)
            assert rep.error and "loopback" in rep.error and "control.host" in rep.error, rep
            assert "127.0.0.1" in rep.error, rep.error
            assert took < self.handshake_timeout_s / 2, f"took {took:.1f}s: waited, not refused"
            if side == "decode":
                prefill = c.rank("prefill")
                rep = collect_reports(c, {21}, 5.0, role="prefill")[(prefill.name, 21)]
                assert rep.status == int(KVPoll.Failed)
                assert rep.error and "loopback" in rep.error, rep.error

    @pytest.mark.slow
    @pytest.mark.parametrize("how", ["silent", "link_down"])
    def test_partition_then_recovery(self, bed: NetnsBed, how: str) -> None:
        """``silent``: the decode node leaves the bridge (packets vanish, links stay up);
        ``link_down``: its interface goes down (the kernel drops what it sends)."""
        with Cluster(self.spec(bed)) as c:
            # a connection first, so that both sides know each other
            assert_all_ok(c.run(c.plans(4, seed=1), concurrency=4, timeout_s=30))
            rooms = {100 + i for i in range(6)}
            start_stalled(c, rooms)
            t_cut = time.monotonic()
            if how == "silent":
                bed.partition("decode")
            else:
                bed.link("decode", up=False)
            bound = self.liveness_bound_s + GRACE_S
            reports = collect_reports(c, rooms, bound + 5.0)
            peer_of = {"prefill": "decode0-pp0-tp0", "decode": "prefill0-pp0-tp0"}
            for (name, room), rep in reports.items():
                assert rep.status == int(KVPoll.Failed), (name, room, rep)
                assert rep.error and peer_of[rep.role] in rep.error, (name, rep.error)
                took = rep.t_done - t_cut
                assert took < bound, f"{name} room {room}: failed after {took:.2f}s > {bound}s"
            logger.info(
                "partition (%s) detected after %.2fs at most (bound %.2fs + %.1fs grace)",
                how,
                max(r.t_done for r in reports.values()) - t_cut,
                self.liveness_bound_s,
                GRACE_S,
            )
            # the failed rooms' pages stay quarantined on decode: the lost prefill rank may be
            # alive behind the partition, its writes queued in the network (they land when the
            # link returns); everything else is empty
            deadline = time.monotonic() + 5.0
            while True:
                tables = c.room_tables()
                held = {n: t.get("quarantine", 0) for n, t in tables.items() if "decode" in n}
                others = {
                    n: {k: v for k, v in t.items() if v and k != "quarantine"}
                    for n, t in tables.items()
                }
                if set(held.values()) == {len(rooms)} and not any(others.values()):
                    break
                assert time.monotonic() < deadline, (held, others)
                time.sleep(0.1)
            stats = c.rank_stats()
            assert all(s["evictions"] >= 1 and s["peers"] == 0 for s in stats.values()), stats
            # the link returns: new requests between the same ranks, no restart
            bed.heal("decode")
            t_heal = time.monotonic()
            results = c.run(c.plans(12, seed=2), concurrency=6, timeout_s=30)
            assert_all_ok(results)
            logger.info(
                "after the link returned: %d requests ok in %.2fs, first in %.3fs",
                len(results),
                time.monotonic() - t_heal,
                min(r.latency_s for r in results),
            )
            # ... and are released once every write the lost rank posted is past its deadline
            assert_tables_empty(c, timeout_s=TRANSFER_TIMEOUT_S + 5.0)
            stats = c.rank_stats()  # re-handshaken: each side knows its peer again
            assert all(s["peers"] == 1 for s in stats.values()), stats

    @pytest.mark.slow
    def test_peer_restarted_during_partition(self, bed: NetnsBed) -> None:
        """The decode rank dies and a new incarnation (same name and address, new session)
        starts while the link is down. Prefill's liveness bound is long here (10 s), so it
        still counts the old rank as a peer when the link returns: the new rank's handshake
        must be taken as a restart at once (the old session evicted, its rooms failed naming
        the restart), and requests flow to the new rank without restarting prefill."""
        spec = self.spec(bed, prefill={"heartbeat_misses": 50})
        with Cluster(spec) as c:
            assert_all_ok(c.run(c.plans(4, seed=1), concurrency=4, timeout_s=30))
            rooms = {200 + i for i in range(3)}
            start_stalled(c, rooms)
            bed.partition("decode")
            c.restart("decode")
            bed.heal("decode")
            t_heal = time.monotonic()
            results = c.run(c.plans(8, seed=3), concurrency=4, timeout_s=30)
            assert_all_ok(results)
            took = time.monotonic() - t_heal
            bound = self.heartbeat_interval_s * 50
            assert took < bound, f"the new rank was served after {took:.1f}s (bound {bound}s)"
            prefill = c.rank("prefill")
            for room in rooms:  # failed while the run above read the pipes
                rep = c.stragglers[(prefill.name, room)]
                assert rep.status == int(KVPoll.Failed), rep
                # the restart ends the room, or, when its chunk-0 write was still in flight at
                # the kill ("sent" is the engine's send(), not the write's completion; seen
                # on Mooncake under load), that write's failure to the dead rank does first
                err = rep.error or ""
                assert "restarted" in err or ("op=kv write" in err and "decode" in err), err
            stats = c.rank_stats()
            assert stats[prefill.name]["peers"] == 1, stats
            assert_tables_empty(c, timeout_s=TRANSFER_TIMEOUT_S + 5.0)

    @pytest.mark.slow
    def test_throttled_congested_link(self, bed: NetnsBed) -> None:
        """The decode node's link limited to 200 Mbit/s each way with a 64 KB queue (a
        congested link: bursts overflow the queue, packets are dropped and retransmitted):
        every request still succeeds with every element verified, and each request's time
        is at least its bytes at the link's rate (the throttle was in force)."""
        big = ModelSpec(num_layers=4, total_kv_heads=4, head_dim=64, dtype="int32", page_size=16)
        with Cluster(self.spec(bed, model=big, slots=256)) as c:  # 1-2 MiB per request
            plans = c.plans(16, pages=(8, 16), max_chunks=3, seed=7)
            t0 = time.monotonic()
            assert_all_ok(c.run(plans, concurrency=8, timeout_s=60))
            free = time.monotonic() - t0
            bed.throttle("decode", rate_mbit=200, queue_kb=64)
            t0 = time.monotonic()
            results = c.run(c.plans(16, pages=(8, 16), max_chunks=3, seed=8), concurrency=8)
            slow = time.monotonic() - t0
            assert_all_ok(results)
            moved = sum(r.bytes for r in results)
            floor = moved * 8 / 200e6
            assert slow >= floor * 0.9, (slow, floor)
            logger.info(
                "throttled link: %d requests, %.1f MB in %.2fs (%.0f Mbit/s; %.2fs unthrottled)",
                len(results), moved / 1e6, slow, moved * 8 / slow / 1e6, free,
            )  # fmt: skip
            bed.heal("decode")
            assert_all_ok(c.run(c.plans(8, seed=9), concurrency=8, timeout_s=30))
            assert_tables_empty(c)

    @pytest.mark.slow
    def test_bootstrap_in_third_namespace(self, bed3: tuple[NetnsBed, str]) -> None:
        """A standalone ``kvwire bootstrap`` in its own namespace (a third host): every rank
        registers and looks up there; requests are verified; with the bootstrap host cut
        off, the prefill and decode ranks that know each other keep serving requests (the
        bootstrap service is not on the request path once a decode rank has resolved its
        prefill ranks), and after it returns they still do."""
        bed, addr = bed3
        spec = self.spec(bed).model_copy(update={"bootstrap_addr": addr})
        with Cluster(spec) as c:
            assert c.bootstrap_addr == addr
            assert_all_ok(c.run(c.plans(16, seed=4), concurrency=8, timeout_s=60))
            bed.partition("bootstrap")
            assert_all_ok(c.run(c.plans(8, seed=5), concurrency=8, timeout_s=30))
            bed.heal("bootstrap")
            assert_all_ok(c.run(c.plans(8, seed=6), concurrency=8, timeout_s=30))
            assert_tables_empty(c)

    @pytest.mark.slow
    def test_prefill_restarted_during_partition(self, bed3: tuple[NetnsBed, str]) -> None:
        """The prefill rank (bootstrap service standalone, in a third namespace) dies while its
        link is down, and a new incarnation starts when the link returns (it must register);
        decode's liveness bound is long (10 s). Decode evicts the old incarnation within that
        bound (at once when the dead endpoint's refusal reaches it; TCP's retransmission
        backoff after the partition can delay that to the silence bound), the rooms that were
        in flight fail on decode, and from then on decode's requests resolve and reach the
        new incarnation: no restart of decode needed."""
        bed, addr = bed3
        spec = self.spec(bed, decode={"heartbeat_misses": 50})
        spec = spec.model_copy(update={"bootstrap_addr": addr})
        with Cluster(spec) as c:
            assert_all_ok(c.run(c.plans(4, seed=1), concurrency=4, timeout_s=30))
            rooms = {300 + i for i in range(3)}
            start_stalled(c, rooms)
            bed.partition("prefill")
            c.kill("prefill")
            time.sleep(0.5)
            bed.heal("prefill")
            t_heal = time.monotonic()
            c.restart("prefill")
            bound = self.heartbeat_interval_s * 50
            decode = c.rank("decode")
            reports = collect_reports(c, rooms, bound + GRACE_S, role="decode")
            took = time.monotonic() - t_heal
            for room in rooms:  # the old incarnation evicted: its rooms failed, naming it
                rep = reports[(decode.name, room)]
                assert rep.status == int(KVPoll.Failed), rep
                assert rep.error and "prefill0-pp0-tp0" in rep.error, rep.error
            assert took < bound + GRACE_S, f"old prefill evicted after {took:.1f}s"
            assert_all_ok(c.run(c.plans(8, seed=3), concurrency=4, timeout_s=30))
            assert_tables_empty(c, timeout_s=TRANSFER_TIMEOUT_S + 5.0)


@contextlib.contextmanager
def standalone_bootstrap(bed: NetnsBed, node: str, timeout_s: float = 30.0) -> Iterator[str]:
    """Run ``kvwire bootstrap`` inside ``node``'s namespace on its address; yields
    ``host:port`` once it answers (from ``node``'s namespace); stopped on exit."""
    host = bed.addr[node]
    port = in_netns(bed.ns[node], lambda: free_bootstrap_port(host, []))
    argv = [sys.executable, "-m", "kvwire.cli", "bootstrap", "--host", host, "--port", str(port)]
    proc = subprocess.Popen(
        ["ip", "netns", "exec", bed.ns[node], *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not in_netns(bed.ns[node], lambda: _answers(host, port)):
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"kvwire bootstrap exited ({proc.returncode}): {err[-2000:]}")
            assert time.monotonic() < deadline, "kvwire bootstrap did not start"
            time.sleep(0.1)
        yield f"{host}:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _answers(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


class DataPlaneLoopback(NetnsConformance):
    """For engines whose data endpoint is an option (``host``): tcp and mooncake. (NIXL's
    data endpoints are UCX's, which it checks at handshake itself.)"""

    @pytest.mark.slow
    def test_data_plane_loopback_advertised(self, bed: NetnsBed) -> None:
        """Decode's control plane is reachable but its engine advertises loopback: prefill
        refuses the handshake at once, naming the data endpoint and the option, and the
        request fails on both sides (before: only at the transfer deadline)."""
        spec = self.spec(bed)
        dcfg = spec.role_config["decode"]
        wrong = dcfg.model_copy(update={"transfer_backend_options": {"host": "127.0.0.1"}})
        spec = spec.model_copy(update={"role_config": {**spec.role_config, "decode": wrong}})
        with Cluster(spec) as c:
            plan = RoomPlan(room=31, num_pages=2, chunks=[2])
            t0 = time.monotonic()
            for p in c.ranks_of(plan):
                p.conn.send(("start", plan.model_dump()))
            decode = c.rank("decode")
            rep = collect_reports(c, {31}, self.handshake_timeout_s, role="decode")[
                (decode.name, 31)
            ]
            took = time.monotonic() - t0
            assert rep.status == int(KVPoll.Failed)
            assert rep.error and "data endpoint on loopback" in rep.error, rep.error
            assert "host=ADDR" in rep.error, rep.error
            assert took < self.handshake_timeout_s / 2, f"took {took:.1f}s: waited, not refused"
            prefill = c.rank("prefill")
            rep = collect_reports(c, {31}, 5.0, role="prefill")[(prefill.name, 31)]
            assert rep.status == int(KVPoll.Failed), rep
