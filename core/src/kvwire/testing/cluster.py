"""A PD cluster on loopback: bootstrap, prefill ranks and decode ranks as real processes.

:class:`Cluster` spawns ``prefill_tp * prefill_pp`` prefill rank processes (rank 0 runs the
bootstrap service in-process, as in production) and ``decode_instances * decode_tp`` decode rank
processes; with ``prefill_instances`` above 1, several prefill instances of that shape, each
with its own bootstrap service on its rank 0. Every rank builds a paged ``int32`` KV pool whose
elements encode (layer, K/V, global head, token position, dim) (:mod:`kvwire.testing.kvfill`) —
NumPy on the CPU, or torch tensors on a GPU when ``device="cuda"`` (ranks spread over the
GPUs, prefill first: :func:`rank_gpu`, :attr:`ClusterSpec.gpus`) — with the buffer groups
:attr:`ClusterSpec.groups` names (:mod:`kvwire.testing.cluster_groups`), and a
:class:`~kvwire.session.KVManager` over it, and then plays its engine: it runs a scheduler loop
over its requests, calling exactly the engine API (the rank processes:
:mod:`kvwire.testing.cluster_rank`).

The parent drives a workload with :meth:`Cluster.run` (requests with chunked prefill, random page
allocations on both sides, optionally a prefix cached on decode) and gets one
:class:`RequestResult` per request: the status on every rank, the elements that differ from the
encoding on every decode rank, the aux rows checked, the latency, and when each rank saw the
request end (:attr:`RankReport.t_done`, comparable with :meth:`Cluster.kill`'s time). Failure
scenarios use :class:`RoomPlan` actions (abort on either side, stall before the last chunk),
:meth:`Cluster.kill` (from :meth:`Cluster.run`'s ``on_sent`` hook to kill mid-transfer) and
:meth:`Cluster.rank_stats` (evictions, dropped control frames, known peers).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from kvwire.testing.cluster_spec import (
    FAULT_ENV,
    RELAXED_HEARTBEAT_S,
    ClusterError,
    ClusterSpec,
    RankReport,
    RequestResult,
    RoomPlan,
    rank_gpu,
)

# The harness's public import path: tests of core, plugins and integrations, the soak, netns
# and bench drivers take a Cluster together with its spec and results from here (their
# definitions live in kvwire.testing.cluster_spec, shared with the rank processes).
__all__ = [
    "FAULT_ENV",
    "RELAXED_HEARTBEAT_S",
    "Cluster",
    "ClusterError",
    "ClusterSpec",
    "RankProc",
    "RankReport",
    "RequestResult",
    "RoomPlan",
    "cluster",
    "env_int",
    "free_bootstrap_port",
    "rank_context",
    "rank_gpu",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- parent side
@dataclass
class RankProc:
    """One spawned rank process, as the parent sees it."""

    role: str
    inst: int
    tp: int
    pp: int
    proc: Any
    conn: Connection
    #: The rank's control endpoint (``tcp://host:port``, its manager's PULL socket) and agent
    #: name, from its "ready" message.
    endpoint: str = ""
    agent: str = ""

    @property
    def name(self) -> str:
        return str(self.proc.name)


#: The former name of :class:`RankProc`.
_Proc = RankProc


#: Ports the harness gives bootstrap services: below Linux's ephemeral range (32768-60999
#: by default), from which the kernel hands out source ports of outgoing connections and
#: ZeroMQ's random binds. A port taken from that range with ``bind(0)`` can be handed to
#: another socket before the rank process binds it (seen in CI: ``address already in use``).
_BOOTSTRAP_PORTS = range(20000, 32000)


def free_bootstrap_port(host: str, taken: Collection[int] = ()) -> int:
    """A port free on ``host`` right now, outside the ephemeral range (for a bootstrap service)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(_BOOTSTRAP_PORTS)
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    raise ClusterError(f"no free port for a bootstrap service on {host} in {_BOOTSTRAP_PORTS}")


def _drain(conn: Connection) -> Iterator[Any]:
    """The messages waiting on a rank's pipe (none once it is closed)."""
    while True:
        try:
            if not conn.poll(0):
                return
            msg = conn.recv()
        except (EOFError, OSError):
            return
        yield msg


#: Modules the fork server of CPU rank processes imports once (:func:`rank_context`).
RANK_PRELOAD = ("kvwire.testing.cluster_rank", "kvwire.session")


def rank_context(spec: ClusterSpec) -> Any:
    """The multiprocessing context rank processes start from: on the CPU a fork server that
    imported :data:`RANK_PRELOAD` once (a fresh interpreter per rank spent seconds importing
    them on a loaded 2-core host, most of a small test's time), so each rank is a fork of it;
    ``spawn`` for GPU ranks (a fork must not inherit any CUDA state) and for ranks in network
    namespaces (their tests, with 0.2 s heartbeats, lost peers to starvation in 2 of 3 runs
    at load 25-35 with forked ranks and in none of 3 with spawned ones; cause not
    established). Either way a rank starts from a clean interpreter state, never from a fork
    of the test process."""
    if spec.device != "cpu" or spec.netns:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    return ctx


class Cluster:
    """Spawned prefill and decode ranks (on loopback, or in the network namespaces
    :attr:`ClusterSpec.netns` names). Use as a context manager."""

    def __init__(self, spec: ClusterSpec, start_timeout_s: float = 120.0) -> None:
        self.spec = spec
        self._ctx = rank_context(spec)
        self.procs: list[RankProc] = []
        #: Reports that :meth:`run` read for requests it did not start, by (rank, room).
        self.stragglers: dict[tuple[str, int], RankReport] = {}
        # Every rank starts at once: each prefill instance's rank 0 is told which port its
        # bootstrap service takes, the others retry registration and lookups until it answers.
        prefill_config = spec.config_for("prefill")
        host = prefill_config.control.bootstrap_host
        ports: list[int] = []
        if spec.bootstrap_addr is not None and spec.prefill_instances != 1:
            raise ClusterError("a standalone bootstrap service serves one prefill instance here")
        if spec.prefill_dp > 1 and (spec.prefill_instances != 1 or spec.bootstrap_addr):
            raise ClusterError("prefill_dp: one prefill instance running its own bootstrap")
        for _ in range(spec.prefill_instances if spec.bootstrap_addr is None else 0):
            if spec.netns.get("prefill"):
                from kvwire.testing.netns import in_netns

                ports.append(
                    in_netns(spec.netns["prefill"], lambda: free_bootstrap_port(host, ports))
                )
            else:
                ports.append(free_bootstrap_port(host, ports))
        #: Every prefill instance's bootstrap address (``host:port``), by instance.
        self.bootstrap_addrs = [f"{host}:{port}" for port in ports] or [str(spec.bootstrap_addr)]
        self.bootstrap_addr = self.bootstrap_addrs[0]
        # DP ranks share the instance's service (decode asks it for DP rank room % dp)
        self.bootstrap_addrs *= spec.prefill_dp
        spec_json = spec.model_dump_json()
        self._secret = spec.config.secret.get_secret_value() if spec.config.secret else ""
        try:
            if spec.bootstrap_addr is not None:  # every prefill rank registers with it
                for pp in range(spec.prefill_pp):
                    for tp in range(spec.prefill_tp):
                        self._spawn(spec_json, "prefill", 0, tp, pp, spec.bootstrap_addr)
            for inst, port in enumerate(ports):
                control = prefill_config.control.model_copy(update={"bootstrap_port": port})
                first_config = prefill_config.model_copy(update={"control": control})
                first_spec = spec.model_copy(
                    update={
                        "config": first_config,
                        "role_config": {**spec.role_config, "prefill": first_config},
                    }
                )
                self._spawn(first_spec.model_dump_json(), "prefill", inst, 0, 0, "")
                for rank_inst in range(inst, inst + spec.prefill_dp):  # DP ranks, if any
                    for pp in range(spec.prefill_pp):
                        for tp in range(spec.prefill_tp):
                            if (rank_inst, tp, pp) != (inst, 0, 0):
                                addr = self.bootstrap_addrs[inst]
                                self._spawn(spec_json, "prefill", rank_inst, tp, pp, addr)
            for inst in range(spec.decode_instances):
                for pp in range(spec.decode_pp):
                    for tp in range(spec.decode_tp):
                        self._spawn(spec_json, "decode", inst, tp, pp, self.bootstrap_addr)
            for p in self.procs:
                _, _, p.endpoint, p.agent = self._expect(p, "ready", start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _spawn(self, spec_json: str, role: str, inst: int, tp: int, pp: int, addr: str) -> RankProc:
        parent, child = self._ctx.Pipe()
        from kvwire.testing.cluster_rank import rank_main

        proc = self._ctx.Process(
            target=rank_main,
            args=(child, spec_json, role, tp, pp, inst, addr, self._secret, self.bootstrap_addrs),
            # the rank runs with this process's environment as it is now (a fork server's
            # children would inherit the server's, taken when it started)
            kwargs={"env": dict(os.environ)},
            name=f"kvwire-{role}{inst}-pp{pp}-tp{tp}",
            daemon=True,
        )
        proc.start()
        child.close()
        p = RankProc(role, inst, tp, pp, proc, parent)
        self.procs.append(p)
        return p

    def _expect(self, p: RankProc, kind: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if p.conn.poll(0.05):
                msg = p.conn.recv()
                if msg[0] == kind:
                    return msg
            elif not p.proc.is_alive():
                raise ClusterError(f"{p.proc.name} exited with code {p.proc.exitcode}")
        raise ClusterError(f"{p.proc.name}: no {kind!r} within {timeout_s:.0f}s")

    def rank(self, role: str, inst: int = 0, tp: int = 0, pp: int = 0) -> RankProc:
        """The process of one rank."""
        for p in self.procs:
            if (p.role, p.inst, p.tp, p.pp) == (role, inst, tp, pp):
                return p
        raise ValueError(f"no {role} rank inst={inst} tp={tp} pp={pp}")

    def ranks_of(self, plan: RoomPlan) -> list[RankProc]:
        """The processes that take part in a request."""
        return [
            p
            for p in self.procs
            if p.inst == (plan.prefill_instance if p.role == "prefill" else plan.decode_instance)
        ]

    def wait_sent(
        self,
        room: int,
        chunk: int = 0,
        timeout_s: float = 30.0,
        prefill_instance: int = 0,
        tp: int = 0,
    ) -> None:
        """Wait until rank ``tp`` of a prefill instance has sent chunk ``chunk`` of ``room``
        (the decode ranks it serves have all asked for the KV by then; other prefill ranks
        may not have been asked yet); other messages on that pipe are dropped."""
        p = self.rank("prefill", prefill_instance, tp)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if p.conn.poll(0.05):
                msg = p.conn.recv()
                if msg[0] == "sent" and (msg[1], msg[2]) == (chunk, room):
                    return
        raise ClusterError(f"prefill did not send chunk {chunk} of room {room} in {timeout_s}s")

    def kill(self, role: str, inst: int = 0, tp: int = 0, pp: int = 0) -> float:
        """SIGKILL one rank process (a crash); returns ``time.monotonic()`` just before the
        signal (compare with :attr:`RankReport.t_done`)."""
        p = self.rank(role, inst, tp, pp)
        t_kill = time.monotonic()
        p.proc.kill()
        p.proc.join(10)
        return t_kill

    def restart(
        self, role: str, inst: int = 0, tp: int = 0, pp: int = 0, timeout_s: float = 120.0
    ) -> RankProc:
        """SIGKILL one rank (if alive) and start a new process in its place (same role,
        position, name and namespace; a new session), returning once it is ready. Not for
        a prefill instance's rank 0 that runs its bootstrap service (unless the cluster uses
        a standalone one, :attr:`ClusterSpec.bootstrap_addr`)."""
        if role == "prefill" and (tp, pp) == (0, 0) and self.spec.bootstrap_addr is None:
            raise ValueError("prefill rank 0 runs its instance's bootstrap service")
        old = self.rank(role, inst, tp, pp)
        if old.proc.is_alive():
            old.proc.kill()
        old.proc.join(10)
        addr = self.bootstrap_addr if role == "decode" else self.bootstrap_addrs[inst]
        p = self._spawn(self.spec.model_dump_json(), role, inst, tp, pp, addr)
        self.procs.remove(p)
        self.procs[self.procs.index(old)] = p
        _, _, p.endpoint, p.agent = self._expect(p, "ready", timeout_s)
        return p

    def plans(
        self,
        n: int,
        *,
        pages: tuple[int, int] = (1, 8),
        max_chunks: int = 3,
        cached_fraction: float = 0.0,
        seed: int | None = None,
        layerwise_fraction: float = 0.0,
    ) -> list[RoomPlan]:
        """A random workload: ``n`` requests with random sizes, chunkings, prefill and decode
        instances; a ``cached_fraction`` of them have a random prefix (sometimes all) cached
        on decode, a ``layerwise_fraction`` are sent layer-wise."""
        rng = np.random.default_rng(self.spec.seed if seed is None else seed)
        out = []
        for _ in range(n):
            num = int(rng.integers(pages[0], pages[1] + 1))
            k = int(rng.integers(1, max_chunks + 1))
            cuts = np.sort(rng.integers(0, num + 1, size=k - 1))
            chunks = np.diff(np.concatenate([[0], cuts, [num]])).astype(int).tolist()
            cached = 0
            if rng.random() < cached_fraction:
                # any number of prefill pages: with another decode page size the prefix
                # need not end on a decode page (decode says how many tokens it keeps)
                cached = int(rng.integers(0, num + 1))
            decode_instance = int(rng.integers(0, self.spec.decode_instances))
            # drawn only with several instances: one-instance workloads stay as they were
            prefill_instance = (
                int(rng.integers(0, self.spec.prefill_instances))
                if self.spec.prefill_instances > 1
                else 0
            )
            room = secrets.randbits(63)
            if self.spec.prefill_dp > 1:
                prefill_instance = room % self.spec.prefill_dp
            out.append(
                RoomPlan(
                    room=room,
                    num_pages=num,
                    chunks=chunks,
                    cached_pages=cached,
                    decode_instance=decode_instance,
                    prefill_instance=prefill_instance,
                    # drawn only when asked: other workloads stay as they were
                    layerwise=bool(layerwise_fraction and rng.random() < layerwise_fraction),
                )
            )
        return out

    def run(
        self,
        plans: list[RoomPlan],
        *,
        concurrency: int = 16,
        timeout_s: float = 120.0,
        on_result: Callable[[RequestResult], None] | None = None,
        ignore_dead: bool = False,
        on_sent: Callable[[RankProc, int, int], None] | None = None,
        on_stalled: Callable[[RankProc, int], None] | None = None,
    ) -> list[RequestResult]:
        """Run requests with at most ``concurrency`` in flight; one result per plan, in plan
        order. A request is finished when every rank taking part has reported.

        ``ignore_dead``: a rank that is dead (killed) is not started on and no longer waited
        for (its requests' results lack its report); otherwise a dead rank is an error.
        ``on_sent(rank, room, chunk)`` is called when a prefill rank has sent a chunk (e.g. to
        kill a rank mid-transfer, with ``ignore_dead``); ``on_stalled(rank, room)`` when a
        prefill rank begins holding a request's last chunk for its plan's ``stall_s`` (the
        request is in flight for that long from then)."""
        results = {p.room: RequestResult(p) for p in plans}
        waiting: dict[int, set[int]] = {}  # room -> indexes (in self.procs) yet to report
        gone: set[int] = set()  # dead ranks whose pipes are drained
        todo = list(plans)
        done = 0
        deadline = time.monotonic() + timeout_s

        def finished(room: int) -> None:
            nonlocal done
            del waiting[room]
            res = results[room]
            res.t_end = time.perf_counter()
            done += 1
            if on_result is not None:
                on_result(res)

        while done < len(plans):
            while todo and len(waiting) < concurrency:
                plan = todo.pop(0)
                taking_part = {id(p) for p in self.ranks_of(plan)}
                ranks = [
                    i
                    for i, p in enumerate(self.procs)
                    if id(p) in taking_part and (not ignore_dead or p.proc.is_alive())
                ]
                results[plan.room].t_start = time.perf_counter()
                # decode first: its request usually precedes the prefill's sender
                for i in sorted(ranks, key=lambda i: self.procs[i].role != "decode"):
                    self.procs[i].conn.send(("start", plan.model_dump()))
                waiting[plan.room] = set(ranks)
                if not ranks:
                    finished(plan.room)
            for i, p in enumerate(self.procs):
                if i in gone:
                    continue
                alive = p.proc.is_alive()
                for msg in _drain(p.conn):
                    if msg[0] == "sent":
                        if on_sent is not None and msg[2] in results:
                            on_sent(p, msg[2], msg[1])
                        continue
                    if msg[0] == "stalled":
                        if on_stalled is not None and msg[2] in results:
                            on_stalled(p, msg[2])
                        continue
                    if msg[0] != "done":
                        continue
                    rep, room = msg[1], msg[2]
                    if room not in waiting or i not in waiting[room]:
                        # a straggler from a request started by hand: kept for the test
                        self.stragglers[(p.name, room)] = rep
                        continue
                    results[room].reports.append(rep)
                    waiting[room].discard(i)
                    if not waiting[room]:
                        finished(room)
                if not alive:  # dead before the drain: everything it sent has been read
                    if not ignore_dead:
                        raise ClusterError(f"{p.proc.name} died (exit code {p.proc.exitcode})")
                    gone.add(i)
                    for room in [r for r, left in waiting.items() if i in left]:
                        waiting[room].discard(i)
                        if not waiting[room]:
                            finished(room)
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"workload did not finish in {timeout_s:.0f}s ({done} of {len(plans)} done; "
                    f"waiting for rooms {list(waiting)[:5]})"
                )
            # wake as soon as a rank reports (a fixed sleep would idle the next request; the
            # timeout is rounded up to 1 ms)
            wait([p.conn for i, p in enumerate(self.procs) if i not in gone], 0.0005)
        return [results[p.room] for p in plans]

    def room_tables(self) -> dict[str, dict[str, int]]:
        """Every live rank's per-room table sizes (all zero after a finished workload)."""
        out = {}
        for p in self.procs:
            if not p.proc.is_alive():
                continue
            p.conn.send(("tables",))
            msg = self._expect(p, "tables", 30)
            out[p.proc.name] = {**msg[1], **{f"dropped_{k}": v for k, v in msg[2].items()}}
        return out

    def rank_stats(self) -> dict[str, dict[str, Any]]:
        """Every live rank's liveness figures: ``evictions`` (peers it evicted, any reason),
        ``peers`` (peers it tracks now), ``dropped_<reason>`` (control frames it dropped:
        unauthenticated, malformed, version, send_full), ``failovers`` and ``recoveries``
        (its transport failover metrics) and, for a rank with several backends, ``links``
        (``{engine peer: the backend its next transfer takes}``), ``switch_interval_s`` (the
        process's GIL switch interval now), ``gil_lowerings`` (how often its manager
        lowered it: :mod:`kvwire.gil`), ``gil_own_late`` (late spans it did not take for
        starvation: kvwire's own threads ran), ``gil_windows`` (windows of idle waits its watch
        looked at), ``gil_last_median_s`` (the last window's median lateness) and
        ``local_sent``, ``local_left``, ``local_inbound`` (the control channel's local way:
        frames told over it, peers it was left for, connections into this rank's inbox)."""
        out = {}
        for p in self.procs:
            if not p.proc.is_alive():
                continue
            p.conn.send(("stats",))
            msg = self._expect(p, "stats", 30)
            out[p.proc.name] = {**msg[1], **{f"dropped_{k}": v for k, v in msg[2].items()}}
        return out

    def peer_agents(self) -> dict[str, list[str]]:
        """Every live rank's peers now, by agent name."""
        out = {}
        for p in self.procs:
            if p.proc.is_alive():
                p.conn.send(("peer_agents",))
                out[p.proc.name] = self._expect(p, "peer_agents", 30)[1]
        return out

    def host_paths(self) -> dict[str, dict[str, str]]:
        """Prefill ranks: the host-pool path chosen per decode session (``hisparse`` host
        staging; empty for strategies that do not choose)."""
        out = {}
        for p in self.procs:
            if p.role != "prefill" or not p.proc.is_alive():
                continue
            p.conn.send(("host_paths",))
            out[p.proc.name] = self._expect(p, "host_paths", 30)[1]
        return out

    def close(self) -> None:
        """Stop every rank (cleanly where possible)."""
        for p in self.procs:
            if p.proc.is_alive():
                with contextlib.suppress(OSError, BrokenPipeError):
                    p.conn.send(("stop",))
        for p in self.procs:
            p.proc.join(10)
            if p.proc.is_alive():
                p.proc.kill()
                p.proc.join(5)
        self.procs.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def cluster(spec: ClusterSpec) -> Iterator[Cluster]:
    """``with cluster(spec) as c: c.run(c.plans(64))``."""
    c = Cluster(spec)
    try:
        yield c
    finally:
        c.close()


def env_int(name: str, default: int) -> int:
    """An integer from the environment (test scaling knobs)."""
    return int(os.environ.get(name, default))
