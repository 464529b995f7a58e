"""A soak with faults: many verified requests across several prefill and decode instances of
the same shape, with crashes, freezes, partitions, flipped bytes and a refusing backend
injected while they run (issue 26 item 4).

:func:`run_soak` drives a :class:`~kvwire.testing.cluster.Cluster` (real rank processes,
default agent names, so instances of one shape collide unless the product tells them apart)
through batches of random requests (:meth:`Cluster.plans`: random sizes, chunkings and
(prefill, decode) instance pairs; every element and aux row verified on decode). Every
``fault_every``-th batch carries one fault from ``faults``, in turn:

* ``kill_decode`` / ``kill_prefill``: SIGKILL of a decode rank, or of a prefill instance's
  TP rank 1 (rank 0 runs the instance's bootstrap service), once the batch's first chunk
  to that instance is sent; the rank is restarted (new process, new session) after the batch.
* ``flip``: a decode rank is restarted with fault ``flip_on_landing``
  (:mod:`kvwire.testing.faults`; one bit of each chunk's landed rows flipped before its
  checksum check), so every request through its instance in the batch must fail naming a
  checksum mismatch (the cluster runs with ``kv_checksum`` on); it is restarted clean
  afterwards.
* ``freeze``: a decode rank is stopped (SIGSTOP) for longer than the liveness bound, then
  resumed (SIGCONT): a silent peer, a partition without root. Its batch's requests of several
  chunks on that rank stall for as long, so prefill evicts the rank while it holds them.
* ``partition``: with ``netns`` (root: prefill's ranks in one namespace, each decode
  instance's in its own): one decode instance's namespace is cut off from the bridge for
  ``silence_s`` (:meth:`NetnsBed.partition <kvwire.testing.netns.NetnsBed.partition>`), the
  other instances serving on.
* ``dead_backend``: every rank runs the backend list ``flaky,<backend>``
  (:mod:`kvwire.testing.flaky`: ``tcp`` that fails on command, the one fake: no engine here
  breaks an endpoint on request), and every TP rank of one prefill instance has its
  ``flaky`` broken from when every request to it holds its last chunk until the batch
  ends (a flag file per agent): posts are swallowed and fail
  after 50 ms, as an engine reports a broken endpoint, and adding the peer again is refused.
  Its links must fail over to ``<backend>`` with **no** request failed, and move back to
  ``flaky`` once it heals (the ranks' failover metrics and links, :class:`FaultEvent`).

Besides, every prefill rank runs fault ``aux_submit_fails`` (its backend refuses the aux
write of the rooms from :data:`~kvwire.testing.faults.AUX_FAIL_ROOMS` on): a
``victim_fraction`` of the requests use such a room and must fail naming the refusal.

The ledger (:class:`~kvwire.testing.soak_ledger.SoakReport`) counts every request as
``ok``, ``expected`` (failed in a fault's batch on an instance it hit, or started within
``recovery_s`` after it ended, every failed rank naming a cause that fault explains; or a
refused room, naming the refusal), ``unexpected`` or ``corrupt`` (a rank reported wrong
elements or aux rows). Each rank's fds (``/proc/<pid>/fd``), threads and RSS are sampled
after every batch; ``SoakReport.growth`` compares each process's first sample after the
warm-up (a restarted one: after its first batch) with its last.

Run: ``python -m kvwire.testing.soak --requests 10000 --json soak.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.testing import flaky
from kvwire.testing.cluster import (
    FAULT_ENV,
    Cluster,
    ClusterSpec,
    RankProc,
    RequestResult,
    RoomPlan,
)
from kvwire.testing.faults import AUX_FAIL_ROOMS
from kvwire.testing.soak_ledger import (
    FAULT_KINDS,
    FaultEvent,
    SoakReport,
    classify,
    sample_all,
)

logger = logging.getLogger(__name__)

#: How long a kill's or a dead backend's requests hold their last chunk: the fault fires
#: once all are held, so this is the room a driver late to read its pipes has (a loaded
#: 2-core host starved processes for 1.2-1.4 s; 1 s let a kill find every request done).
HOLD_S = 4.5


class SoakSpec(BaseModel):
    """What a soak runs. Control settings are kvwire's defaults, with ``kv_checksum`` on."""

    model_config = ConfigDict(extra="forbid")

    requests: int = Field(default=400, ge=1)
    prefill_instances: int = Field(default=2, ge=1)
    decode_instances: int = Field(default=2, ge=1)
    #: 2 or more: a prefill TP rank above 0 can be killed and restarted (rank 0 runs the
    #: instance's bootstrap service, which the harness does not restart).
    prefill_tp: int = Field(default=2, ge=1)
    decode_tp: int = Field(default=1, ge=1)
    backend: str = "tcp"
    batch: int = Field(default=40, ge=1)
    concurrency: int = Field(default=16, ge=1)
    pages: tuple[int, int] = (1, 8)
    max_chunks: int = Field(default=3, ge=1)
    faults: tuple[str, ...] = ("kill_decode", "kill_prefill", "flip", "freeze")
    #: A fault every this many batches (the first batch is a clean warm-up).
    fault_every: int = Field(default=3, ge=1)
    #: Share of requests whose aux write prefill's backend refuses (0: none).
    victim_fraction: float = Field(default=0.02, ge=0, le=1)
    #: How long a frozen rank or a partitioned namespace stays silent (the default liveness
    #: bound is 1 s x 3 misses).
    silence_s: float = Field(default=4.5, gt=0)
    netns: bool = False
    seed: int = 0
    #: After a fault ends, requests started within this long may still fail by it (a peer
    #: evicted by one side only learns of it when its own liveness bound runs out: default
    #: heartbeats, 1 s x 3, plus a grace).
    recovery_s: float = Field(default=5.0, ge=0)
    #: Longest one batch may take (faults included).
    batch_timeout_s: float = Field(default=300.0, gt=0)

    @property
    def backends(self) -> str:
        """The ranks' ``--transfer-backend``: ``backend``, behind ``flaky`` for
        ``dead_backend``."""
        return f"flaky,{self.backend}" if "dead_backend" in self.faults else self.backend

    @property
    def base_faults(self) -> tuple[str, ...]:
        """Faults every rank runs throughout (:data:`FAULT_ENV`)."""
        extra = ("flaky_backend",) if "dead_backend" in self.faults else ()
        return ("aux_submit_fails", *extra)

    def check(self) -> None:
        """Refuse fault kinds this shape cannot run."""
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULT_KINDS}")
        if self.prefill_tp < 2 and "kill_prefill" in self.faults:
            raise ValueError("kill_prefill restarts prefill TP rank 1: prefill_tp >= 2")
        if "partition" in self.faults and not self.netns:
            raise ValueError("partition needs netns (network namespaces, root)")


# ------------------------------------------------------------------------ faults
@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """Processes spawned inside the block inherit ``name=value``."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _fault_env(spec: SoakSpec, extra: str | None) -> contextlib.AbstractContextManager[None]:
    """Spawned ranks inherit the spec's base faults (plus ``extra``) in :data:`FAULT_ENV`."""
    return _env(FAULT_ENV, ",".join(f for f in (*spec.base_faults, extra) if f))


class _Injector:
    """Runs one batch's fault: armed before the batch, fired from the run's ``on_stalled``
    hook once every prefill rank holds the last chunk of every request on the target
    instance (or the request ended), ended after the batch."""

    def __init__(
        self,
        c: Cluster,
        ev: FaultEvent,
        spec: SoakSpec,
        bed: Any,
        plans: list[RoomPlan],
        flag_dir: str | None = None,
    ) -> None:
        self.c, self.ev, self.spec, self.bed = c, ev, spec, bed
        self.flag_dir = flag_dir
        self.fired = False
        #: ``dead_backend``: the target ranks' failover metrics before the batch.
        self._switches = (0, 0)
        #: (request, prefill rank) on the target instance not yet held in its stall nor
        #: finished: the fault fires once there are none, so it finds every request that is
        #: still open in flight (a decode rank that dies before asking for a request leaves
        #: prefill waiting for it until its bootstrap timeout; a fault fired on the first
        #: chunk sent found, on a loaded host, every request done: it failed none).
        self.pending = {
            (p.room, tp) for p in plans if ev.touches(p) for tp in range(spec.prefill_tp)
        }
        self._timer: threading.Timer | None = None
        #: ``dead_backend``: the flag files that break the target's ``flaky``, once fired.
        self._flags: list[str] = []

    def _target(self) -> RankProc:
        return self.c.rank(self.ev.role, self.ev.inst, self.ev.tp)

    def _instance(self) -> list[RankProc]:
        """Every rank of the target instance (``dead_backend``)."""
        ev = self.ev
        return [p for p in self.c.procs if p.role == ev.role and p.inst == ev.inst]

    def _switch_counts(self) -> tuple[int, int, bool]:
        """The target instance's failovers and recoveries (summed over its ranks) and whether
        every link of theirs takes the primary (``flaky``) now. Outside :meth:`Cluster.run`
        only: it talks to the ranks over the pipes the run reads."""
        names = {p.name for p in self._instance()}
        stats = [v for k, v in self.c.rank_stats().items() if k in names]
        on_primary = all(b == "flaky" for st in stats for b in st.get("links", {}).values())
        return (
            sum(st["failovers"] for st in stats),
            sum(st["recoveries"] for st in stats),
            on_primary,
        )

    def before(self) -> None:
        ev = self.ev
        if ev.kind == "dead_backend":
            self._switches = self._switch_counts()[:2]
        if ev.kind == "flip":  # the rank is restarted flipping bits: live for the whole batch
            ev.agents = (self._target().agent,)
            ev.t_start = time.perf_counter()
            self._replace("flip_on_landing")
            self.fired = True

    def _replace(self, fault: str | None) -> None:
        """SIGKILL the target rank (if alive), wait until no live rank counts it as a peer,
        and start a new one (with ``fault``). Without the wait, a request started at once
        could still be routed to the dead incarnation by a peer that has not noticed yet."""
        ev, c = self.ev, self.c
        old = self._target()
        if old.proc.is_alive():
            c.kill(ev.role, ev.inst, ev.tp)
        deadline = time.monotonic() + 120
        while any(old.agent in agents for agents in c.peer_agents().values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"peers still count {old.agent} 120 s after its death")
            time.sleep(0.05)
        with _fault_env(self.spec, fault):
            c.restart(ev.role, ev.inst, ev.tp)

    def seen(self, room: int, tp: int | None = None) -> None:
        """Prefill rank ``tp`` holds a request's last chunk (decode asked for it, its
        stall began), or the request finished (``tp`` None): fire once every rank holds or
        finished every request."""
        for t in range(self.spec.prefill_tp) if tp is None else (tp,):
            self.pending.discard((room, t))
        if not self.pending and not self.fired:
            self.fire()

    def fire(self) -> None:
        self.fired = True
        ev = self.ev
        # no agent for a dead backend: an error naming its ranks explains nothing there
        target = self._target() if ev.kind not in ("partition", "dead_backend") else None
        ev.agents = (target.agent,) if target else ()
        ev.t_start = time.perf_counter()
        if ev.kind in ("kill_decode", "kill_prefill"):
            assert target is not None
            target.proc.kill()
        elif ev.kind == "freeze":
            assert target is not None
            pid = target.proc.pid
            os.kill(pid, signal.SIGSTOP)
            self._timer = threading.Timer(
                self.spec.silence_s, self._end, (os.kill, pid, signal.SIGCONT)
            )
            self._timer.start()
        elif ev.kind == "partition":  # one decode instance's namespace
            node = f"decode{ev.inst}"
            self.bed.partition(node)
            self._timer = threading.Timer(self.spec.silence_s, self._end, (self.bed.heal, node))
            self._timer.start()
        elif ev.kind == "dead_backend":
            assert self.flag_dir is not None
            flags = [flaky.flag_path(self.flag_dir, p.agent) for p in self._instance()]
            for f in flags:
                open(f, "w").close()
            # healed after the batch: the held chunks are posted while it is broken, however
            # late this driver fired (a timer could heal it before any post hit it)
            self._flags = flags

    def _end(self, undo: Callable[..., Any], *args: Any) -> None:
        undo(*args)
        self.ev.t_end = time.perf_counter()

    def after(self) -> None:
        ev = self.ev
        if not self.fired:
            self.fire()
        if self._timer is not None:
            self._timer.join()
        if ev.kind in ("kill_decode", "kill_prefill", "flip"):
            self._replace(None)
            ev.t_end = time.perf_counter()
        if ev.kind == "dead_backend":
            _remove_all(self._flags)
            ev.t_end = time.perf_counter()
            self._await_recovery()

    def _await_recovery(self) -> None:
        """``dead_backend``, after the batch and the heal: wait until the ranks' probes have
        moved every link back to the primary (a probe waits 0.5 s after the failover,
        doubling after each refusal, at most 30 s: allow two of the longest), then record
        the switches."""
        ev = self.ev
        deadline = time.monotonic() + 75.0
        while True:
            failovers, recoveries, on_primary = self._switch_counts()
            if on_primary or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        ev.failovers = failovers - self._switches[0]
        ev.recoveries = recoveries - self._switches[1]
        ev.recovered = on_primary


def _remove_all(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def fault_schedule(spec: SoakSpec, batches: int) -> dict[int, FaultEvent]:
    """Batch index -> fault: every ``fault_every``-th batch after the warm-up, kinds in turn,
    instances in turn."""
    out: dict[int, FaultEvent] = {}
    kinds = list(spec.faults)
    if not kinds:
        return out
    for n, b in enumerate(range(spec.fault_every, batches, spec.fault_every)):
        kind = kinds[n % len(kinds)]
        role = "prefill" if kind in ("kill_prefill", "dead_backend") else "decode"
        insts = spec.prefill_instances if role == "prefill" else spec.decode_instances
        inst = (n // len(kinds)) % insts
        tp = (n // len(kinds)) % spec.decode_tp if role == "decode" else 0
        if kind == "kill_prefill":
            tp = 1  # rank 0 runs the instance's bootstrap service
        out[b] = FaultEvent(kind, b, role, inst, tp)
    return out


# ------------------------------------------------------------------------ driver
def soak_cluster_spec(spec: SoakSpec, bed: Any = None) -> ClusterSpec:
    """The cluster a soak runs: default control settings with ``kv_checksum`` on, default
    agent names; in namespaces, each role's address and the prefill bootstrap host."""
    model = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=16, dtype="int32", page_size=4)
    shape: dict[str, Any] = {}
    config = KVWireConfig(transfer_backend=spec.backends, control=ControlOptions(kv_checksum=True))
    if bed is not None:  # prefill in one namespace, each decode instance in its own
        nodes = {"prefill": "prefill"}
        nodes.update({f"decode:{i}": f"decode{i}" for i in range(spec.decode_instances)})
        role_config = {
            key: KVWireConfig(
                transfer_backend=spec.backends,
                transfer_backend_options={"host": bed.addr[node]},
                control=ControlOptions(
                    kv_checksum=True, host=bed.addr[node], bootstrap_host=bed.addr["prefill"]
                ),
            )
            for key, node in nodes.items()
        }
        config = role_config["prefill"]
        shape = {"role_config": role_config, "netns": {k: bed.ns[n] for k, n in nodes.items()}}
    return ClusterSpec(
        model=model,
        prefill_tp=spec.prefill_tp,
        decode_tp=spec.decode_tp,
        prefill_instances=spec.prefill_instances,
        decode_instances=spec.decode_instances,
        slots=1024,
        aux_slots=256,
        config=config,
        default_names=True,
        seed=spec.seed,
        **shape,
    )


def _fault_batch(
    c: Cluster,
    plans: list[RoomPlan],
    ev: FaultEvent,
    spec: SoakSpec,
    bed: Any,
    flag_dir: str | None = None,
) -> list[RequestResult]:
    """Run one batch with fault ``ev``. Every request is started before the fault fires
    (none is started on a dead rank: its peers would wait for it until their timeouts);
    requests on the target (for a partition: every request) stall before their last chunk
    and the fault fires once every one of them is held there, so those still open are in
    flight. A kill's or a dead backend's requests hold for :data:`HOLD_S` (a kill fails them
    at once; with 1 s, a driver late to read its pipes on a loaded host fired the kill after
    they were done). In a freeze or a partition, those of several chunks stall that long,
    so that prefill still holds them when it evicts the silent rank (with 1 s they could be
    done before the fault began: the resumed rank completed them, or a partition fired after
    its instance's requests had ended and failed none, which a loaded host showed)."""

    def stall(p: RoomPlan) -> float:
        if ev.kind in ("freeze", "partition"):
            return spec.silence_s if len(p.chunks) > 1 else 1.0
        return HOLD_S

    if ev.kind != "flip":  # a partition: every request, so the other instances' are in
        # flight while one is cut (they must complete)
        stalled = [ev.touches(p) or ev.kind == "partition" for p in plans]
        plans = [
            p.model_copy(update={"stall_s": stall(p)}) if s else p
            for p, s in zip(plans, stalled, strict=True)
        ]
    inj = _Injector(c, ev, spec, bed, plans, flag_dir)
    inj.before()
    results = c.run(
        plans,
        concurrency=len(plans),
        timeout_s=spec.batch_timeout_s,
        ignore_dead=True,
        on_stalled=lambda p, room: inj.seen(room, p.tp),
        on_result=lambda res: inj.seen(res.plan.room),
    )
    inj.after()
    return results


def run_soak(
    spec: SoakSpec,
    *,
    on_batch: Callable[[int, int], None] | None = None,
    stop_on_unexpected: bool = False,
) -> SoakReport:
    """Run a soak; ``on_batch(done, total)`` after every batch (a progress bar).
    ``stop_on_unexpected``: end after the first batch with an unexpected or corrupt
    request (tests: fail fast)."""
    spec.check()
    batches = -(-spec.requests // spec.batch)
    schedule = fault_schedule(spec, batches)
    report = SoakReport(spec=spec.model_dump())
    rng = random.Random(spec.seed)
    victims = 0
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        bed = None
        if spec.netns:
            from kvwire.testing.netns import NetnsBed

            nodes = ("prefill", *(f"decode{i}" for i in range(spec.decode_instances)))
            bed = stack.enter_context(NetnsBed(nodes))
        flag_dir = None
        if "dead_backend" in spec.faults:
            flag_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvwire-flaky-"))
            stack.enter_context(_env(flaky.FLAG_DIR_ENV, flag_dir))  # restarted ranks too
        with _fault_env(spec, None):
            c = stack.enter_context(Cluster(soak_cluster_spec(spec, bed)))
        done = 0
        for b in range(batches):
            n = min(spec.batch, spec.requests - done)
            plans = c.plans(
                n, pages=spec.pages, max_chunks=spec.max_chunks, seed=rng.getrandbits(32)
            )
            for i, plan in enumerate(plans):
                if rng.random() < spec.victim_fraction:
                    plans[i] = plan.model_copy(update={"room": AUX_FAIL_ROOMS + victims})
                    victims += 1
            ranks = {p.room: len(c.ranks_of(p)) for p in plans}
            ev = schedule.get(b)
            t_batch = time.monotonic()
            if ev is None:
                results = c.run(plans, concurrency=spec.concurrency, timeout_s=spec.batch_timeout_s)
            else:
                report.faults.append(ev)
                results = _fault_batch(c, plans, ev, spec, bed, flag_dir)
            for res in results:
                recent = [
                    f for f in report.faults
                    if f is not ev and res.t_start < f.t_end + spec.recovery_s
                ]  # fmt: skip
                report.entries.append(classify(res, ranks[res.plan.room], b, ev, recent))
            done += n
            report.batch_s.append(round(time.monotonic() - t_batch, 2))
            report.samples.extend(sample_all(c, b))
            if on_batch is not None:
                on_batch(done, spec.requests)
            if stop_on_unexpected and report.unexpected():
                break
        report.leftover_tables = _leftover(c)
    report.elapsed_s = time.monotonic() - t0
    return report


def _leftover(c: Cluster, timeout_s: float = 15.0) -> dict[str, dict[str, int]]:
    """Per-request state still held after the soak, once late confirmations had time to
    arrive (quarantined pages of failed rooms are not counted: they are released when
    their writes are known to have ended, up to the transfer timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {
            name: {k: v for k, v in t.items() if v and not k.startswith("drop")}
            for name, t in c.room_tables().items()
        }
        left = {n: {k: v for k, v in t.items() if k != "quarantine"} for n, t in left.items()}
        left = {n: t for n, t in left.items() if t}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvwire.testing.soak``: run a soak, print the ledger's summary, write the
    whole report as JSON; exit 1 on an unexpected failure, a corruption, growth past the
    bounds or state left behind."""
    ap = argparse.ArgumentParser(prog="python -m kvwire.testing.soak", description=__doc__)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--prefill-instances", type=int, default=2)
    ap.add_argument("--decode-instances", type=int, default=2)
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--faults",
        default="kill_decode,kill_prefill,flip,freeze",
        help=f"comma-separated, in turn; known: {','.join(FAULT_KINDS)}",
    )
    ap.add_argument("--fault-every", type=int, default=3)
    ap.add_argument("--victim-fraction", type=float, default=0.02)
    ap.add_argument(
        "--netns",
        action="store_true",
        help="prefill and each decode instance in a namespace of its own (root): partitions",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    spec = SoakSpec(
        requests=args.requests,
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        backend=args.backend,
        batch=args.batch,
        concurrency=args.concurrency,
        faults=tuple(f for f in args.faults.split(",") if f),
        fault_every=args.fault_every,
        victim_fraction=args.victim_fraction,
        netns=args.netns,
        seed=args.seed,
    )
    logging.basicConfig(level=logging.WARNING)
    from rich.console import Console

    from kvwire.cli_progress import progress_bar

    console = Console(stderr=True)
    with progress_bar(console) as bar:
        task = bar.add_task("soak", total=spec.requests)
        t0 = time.monotonic()

        def on_batch(done: int, total: int) -> None:
            bar.update(task, completed=done)
            if not console.is_terminal and done % 1000 < spec.batch:  # a log, not a bar
                print(f"{done}/{total} requests, {time.monotonic() - t0:.0f}s", file=sys.stderr)

        report = run_soak(spec, on_batch=on_batch)
    print(report.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    bad = report.unexpected() or report.not_flat() or report.leftover_tables
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
