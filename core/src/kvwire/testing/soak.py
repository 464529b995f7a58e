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
* ``flip``: a prefill TP rank 1 is restarted with fault ``flip_after_sum``
  (:mod:`kvwire.testing.faults`; one bit flipped after the checksum is taken), so every
  request through its instance in the batch must fail naming a checksum mismatch (the
  cluster runs with ``kv_checksum`` on); it is restarted clean afterwards.
* ``freeze``: a decode rank is stopped (SIGSTOP) for longer than the liveness bound, then
  resumed (SIGCONT): a silent peer, a partition without root.
* ``partition``: with ``netns`` (root): the decode namespace is cut off from the bridge for
  ``partition_s`` (:meth:`NetnsBed.partition <kvwire.testing.netns.NetnsBed.partition>`).

Besides, every prefill rank runs fault ``aux_submit_fails`` (its backend refuses the aux
write of the rooms from :data:`~kvwire.testing.faults.AUX_FAIL_ROOMS` on): a
``victim_fraction`` of the requests use such a room and must fail naming the refusal.

The ledger (:class:`SoakReport`) counts every request as ``ok``, ``expected`` (failed in a
fault's batch and on an instance it touched, every failed rank naming a cause that fault
explains, or a refused room), ``unexpected`` or ``corrupt`` (a rank reported wrong elements
or aux rows). Each rank's fds (``/proc/<pid>/fd``), threads and RSS are sampled after every
batch; :meth:`SoakReport.growth` compares each process's first sample after the warm-up
with its last.

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
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.testing.cluster import (
    FAULT_ENV,
    Cluster,
    ClusterSpec,
    RankProc,
    RequestResult,
    RoomPlan,
)
from kvwire.testing.faults import AUX_FAIL_ROOMS

logger = logging.getLogger(__name__)

FAULT_KINDS = ("kill_decode", "kill_prefill", "flip", "freeze", "partition")
#: Words a failed rank's error must contain for a request in a fault's batch to count as
#: failed by that fault (besides the old incarnation's agent name for kills and freezes).
CAUSES: dict[str, tuple[str, ...]] = {
    # a decode rank that died (or went silent) before asking for a request's KV: prefill
    # waits for it until its bootstrap timeout
    "kill_decode": ("lost", "restarted", "evicted", "closed", "disconnect", "bootstrap timeout"),
    "kill_prefill": ("lost", "restarted", "evicted", "closed", "disconnect"),
    "flip": ("checksum mismatch",),
    "freeze": ("lost", "evicted", "restarted", "no heartbeat", "bootstrap timeout"),
    "partition": ("lost", "evicted", "restarted", "no heartbeat", "bootstrap timeout"),
}
#: A refused room's error names the refusal.
REFUSED = "refused"


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

    def check(self) -> None:
        """Refuse fault kinds this shape cannot run."""
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULT_KINDS}")
        if self.prefill_tp < 2 and {"kill_prefill", "flip"} & set(self.faults):
            raise ValueError("kill_prefill and flip restart prefill TP rank 1: prefill_tp >= 2")
        if "partition" in self.faults and not self.netns:
            raise ValueError("partition needs netns (network namespaces, root)")


@dataclass
class FaultEvent:
    """One injected fault: what, where, when, and the requests it failed."""

    kind: str
    batch: int
    role: str
    inst: int
    tp: int = 0
    #: Agent names of the incarnation the fault hit (a kill's dead rank).
    agents: tuple[str, ...] = ()
    #: ``time.perf_counter()`` (the clock of :attr:`RequestResult.t_start`): when the fault
    #: hit, and when it ended (the rank restarted and ready, resumed, the link healed).
    t_start: float = 0.0
    t_end: float = 0.0
    #: Requests of its batch it failed, and requests started after it ended (within the
    #: recovery window) that it failed.
    failed: int = 0
    failed_after: int = 0

    def touches(self, plan: RoomPlan) -> bool:
        """Whether ``plan`` ran on the instance this fault hit (a partition: every one)."""
        if self.kind == "partition":
            return True
        inst = plan.prefill_instance if self.role == "prefill" else plan.decode_instance
        return inst == self.inst

    def explains(self, error: str) -> bool:
        return any(a and a in error for a in self.agents) or any(
            w in error.lower() for w in CAUSES[self.kind]
        )


@dataclass
class Sample:
    """One process's resources at one moment."""

    name: str
    pid: int
    batch: int
    fds: int
    threads: int
    rss_kib: int


@dataclass
class Entry:
    """One request in the ledger."""

    room: int
    batch: int
    prefill: int
    decode: int
    pages: int
    outcome: str  # ok | expected | unexpected | corrupt
    errors: list[str] = field(default_factory=list)


@dataclass
class SoakReport:
    """The ledger, the faults and the resource samples of a soak."""

    spec: dict[str, Any]
    entries: list[Entry] = field(default_factory=list)
    faults: list[FaultEvent] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    warmup_batches: int = 1
    elapsed_s: float = 0.0
    leftover_tables: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def counts(self) -> Counter[str]:
        return Counter(e.outcome for e in self.entries)

    def unexpected(self) -> list[Entry]:
        return [e for e in self.entries if e.outcome in ("unexpected", "corrupt")]

    def growth(self) -> dict[str, dict[str, int]]:
        """Per process (name:pid) alive for at least 3 samples after the warm-up: growth of
        fds, threads and RSS (KiB) from its first sample after the warm-up to its last."""
        by: dict[str, list[Sample]] = {}
        for s in self.samples:
            by.setdefault(f"{s.name}:{s.pid}", []).append(s)
        out = {}
        for key, ss in by.items():
            if ss[0].batch > 0:  # started by a restart: its first sample was taken before it
                ss = ss[1:]  # served anything
            ss = [s for s in ss if s.batch >= self.warmup_batches]
            if len(ss) >= 3:
                a, b = ss[0], ss[-1]
                out[key] = {
                    "fds": b.fds - a.fds,
                    "threads": b.threads - a.threads,
                    "rss_kib": b.rss_kib - a.rss_kib,
                    "rss_start_kib": a.rss_kib,
                    "batches": b.batch - a.batch,
                }
        return out

    def not_flat(
        self, fds: int = 4, threads: int = 2, rss_mib: float = 48.0, rss_frac: float = 0.25
    ) -> dict[str, dict[str, int]]:
        """Processes whose fds, threads or RSS grew past the bounds (RSS: ``rss_mib`` or
        ``rss_frac`` of its first sample, whichever is larger)."""
        bad = {}
        for key, g in self.growth().items():
            rss_bound = max(rss_mib * 1024, rss_frac * g["rss_start_kib"])
            if g["fds"] > fds or g["threads"] > threads or g["rss_kib"] > rss_bound:
                bad[key] = g
        return bad

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "counts": dict(self.counts),
            "elapsed_s": round(self.elapsed_s, 1),
            "faults": [asdict(f) for f in self.faults],
            "unexpected": [asdict(e) for e in self.unexpected()][:50],
            "growth": self.growth(),
            "not_flat": self.not_flat(),
            "leftover_tables": self.leftover_tables,
            "samples": [asdict(s) for s in self.samples],
        }

    def summary(self) -> str:
        c = self.counts
        lines = [
            f"{len(self.entries)} requests in {self.elapsed_s:.0f}s: ok {c['ok']}, failed as "
            f"expected {c['expected']}, unexpected {c['unexpected']}, corrupt {c['corrupt']}",
        ]
        for kind in FAULT_KINDS:
            fs = [f for f in self.faults if f.kind == kind]
            if fs:
                lines.append(
                    f"  {kind} x{len(fs)}: {sum(f.failed for f in fs)} requests failed in its "
                    f"batches, {sum(f.failed_after for f in fs)} after it ended"
                )
        for e in self.unexpected()[:5]:
            lines.append(f"  UNEXPECTED {e}")
        g = self.growth()
        if g:
            worst = {k: max(v[k] for v in g.values()) for k in ("fds", "threads", "rss_kib")}
            lines.append(f"  max growth after warm-up over {len(g)} processes: {worst}")
        lines.append(f"  not flat: {self.not_flat() or 'none'}")
        if self.leftover_tables:
            lines.append(f"  per-request state left: {self.leftover_tables}")
        return "\n".join(lines)


# ------------------------------------------------------------------------ resources
def sample_proc(name: str, pid: int, batch: int) -> Sample | None:
    """fds, threads and RSS of a live process from /proc (None if it is gone)."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        status = open(f"/proc/{pid}/status").read()  # noqa: SIM115 - one read
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    vals = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if value.split():
            vals[key] = value.split()[0]
    return Sample(name, pid, batch, fds, int(vals.get("Threads", 0)), int(vals.get("VmRSS", 0)))


def sample_all(c: Cluster, batch: int) -> list[Sample]:
    """A sample of every live rank and of this (the driving) process."""
    out = [sample_proc(p.name, p.proc.pid, batch) for p in c.procs if p.proc.is_alive()]
    out.append(sample_proc("driver", os.getpid(), batch))
    return [s for s in out if s is not None]


# ------------------------------------------------------------------------ faults
@contextlib.contextmanager
def _fault_env(extra: str | None) -> Iterator[None]:
    """Spawned ranks inherit ``aux_submit_fails`` (plus ``extra``) in :data:`FAULT_ENV`."""
    old = os.environ.get(FAULT_ENV)
    os.environ[FAULT_ENV] = ",".join(f for f in ("aux_submit_fails", extra) if f)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(FAULT_ENV, None)
        else:
            os.environ[FAULT_ENV] = old


class _Injector:
    """Runs one batch's fault: armed before the batch, fired from the run's ``on_sent`` hook
    (the first chunk sent to the target instance), ended after the batch."""

    def __init__(
        self, c: Cluster, ev: FaultEvent, spec: SoakSpec, bed: Any, plans: list[RoomPlan]
    ) -> None:
        self.c, self.ev, self.spec, self.bed = c, ev, spec, bed
        self.fired = False
        #: Requests on the target instance not yet asked for by decode nor finished: the fault
        #: fires once there are none (a decode rank that dies before asking for a request
        #: leaves prefill waiting for it until its bootstrap timeout).
        self.pending = {p.room for p in plans if ev.touches(p)}
        self._timer: threading.Timer | None = None

    def _target(self) -> RankProc:
        return self.c.rank(self.ev.role, self.ev.inst, self.ev.tp)

    def before(self) -> None:
        ev = self.ev
        if ev.kind == "flip":  # the rank is restarted flipping bits: live for the whole batch
            ev.agents = (self._target().agent,)
            ev.t_start = time.perf_counter()
            with _fault_env("flip_after_sum"):
                self.c.restart("prefill", ev.inst, ev.tp)
            self.fired = True

    def seen(self, room: int) -> None:
        """A request was asked for (a chunk sent) or finished: fire once all were."""
        self.pending.discard(room)
        if not self.pending and not self.fired:
            self.fire()

    def fire(self) -> None:
        self.fired = True
        ev = self.ev
        target = self._target() if ev.kind != "partition" else None
        ev.agents = (target.agent,) if target else ()
        ev.t_start = time.perf_counter()
        if ev.kind in ("kill_decode", "kill_prefill"):
            assert target is not None
            target.proc.kill()
        elif ev.kind == "freeze":
            assert target is not None
            pid = target.proc.pid
            os.kill(pid, signal.SIGSTOP)
            self._timer = threading.Timer(self.spec.silence_s, self._end, (os.kill, pid, signal.SIGCONT))
            self._timer.start()
        elif ev.kind == "partition":
            self.bed.partition("decode")
            self._timer = threading.Timer(self.spec.silence_s, self._end, (self.bed.heal, "decode"))
            self._timer.start()

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
            with _fault_env(None):
                self.c.restart(ev.role, ev.inst, ev.tp)
            ev.t_end = time.perf_counter()


def fault_schedule(spec: SoakSpec, batches: int) -> dict[int, FaultEvent]:
    """Batch index -> fault: every ``fault_every``-th batch after the warm-up, kinds in turn,
    instances in turn."""
    out: dict[int, FaultEvent] = {}
    kinds = list(spec.faults)
    if not kinds:
        return out
    for n, b in enumerate(range(spec.fault_every, batches, spec.fault_every)):
        kind = kinds[n % len(kinds)]
        role = "prefill" if kind in ("kill_prefill", "flip") else "decode"
        insts = spec.prefill_instances if role == "prefill" else spec.decode_instances
        inst = (n // len(kinds)) % insts
        tp = 1 if role == "prefill" else (n // len(kinds)) % spec.decode_tp
        out[b] = FaultEvent(kind, b, role, inst, tp)
    return out


# ------------------------------------------------------------------------ ledger
def classify(
    res: RequestResult, ranks: int, batch: int, ev: FaultEvent | None, recent: list[FaultEvent]
) -> Entry:
    """One request's ledger entry. ``ranks``: how many ranks took part; ``ev``: the fault of
    its batch; ``recent``: faults whose recovery window it started in."""
    plan = res.plan
    errors = [r.error or "" for r in res.reports if r.status != 4]
    entry = Entry(
        plan.room, batch, plan.prefill_instance, plan.decode_instance, plan.num_pages, "ok"
    )
    entry.errors = errors
    if any(r.mismatches or (r.status == 4 and not r.aux_ok) for r in res.reports):
        entry.outcome = "corrupt"
        return entry
    complete = len(res.reports) == ranks
    if complete and not errors:
        if _refused(plan):  # the refusal did not happen: the fault is not live
            entry.outcome = "unexpected"
            entry.errors = ["a refused room succeeded"]
        return entry
    if ev is not None and ev.touches(plan):
        # every rank that failed names a cause the fault explains (a rank that did not report
        # is the one killed), or the room was refused anyway
        if all(ev.explains(e) or (_refused(plan) and REFUSED in e) for e in errors):
            entry.outcome = "expected"
            ev.failed += 1
            return entry
    if _refused(plan) and complete and errors and all(REFUSED in e for e in errors):
        entry.outcome = "expected"
        return entry
    for old in recent:
        if old.touches(plan) and all(old.explains(e) for e in errors):
            entry.outcome = "expected"
            old.failed_after += 1
            return entry
    entry.outcome = "unexpected"
    return entry


def _refused(plan: RoomPlan) -> bool:
    return 0 <= plan.room - AUX_FAIL_ROOMS < 1 << 16


# ------------------------------------------------------------------------ driver
def soak_cluster_spec(spec: SoakSpec, bed: Any = None) -> ClusterSpec:
    """The cluster a soak runs: default control settings with ``kv_checksum`` on, default
    agent names; in namespaces, each role's address and the prefill bootstrap host."""
    model = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=16, dtype="int32", page_size=4)
    shape: dict[str, Any] = {}
    config = KVWireConfig(
        transfer_backend=spec.backend, control=ControlOptions(kv_checksum=True)
    )
    if bed is not None:
        role_config = {
            role: KVWireConfig(
                transfer_backend=spec.backend,
                transfer_backend_options={"host": bed.addr[role]},
                control=ControlOptions(
                    kv_checksum=True, host=bed.addr[role], bootstrap_host=bed.addr["prefill"]
                ),
            )
            for role in ("prefill", "decode")
        }
        config = role_config["prefill"]
        shape = {"role_config": role_config, "netns": {r: bed.ns[r] for r in role_config}}
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

            bed = stack.enter_context(NetnsBed(("prefill", "decode")))
        with _fault_env(None):
            c = stack.enter_context(Cluster(soak_cluster_spec(spec, bed)))
        done = 0
        for b in range(batches):
            n = min(spec.batch, spec.requests - done)
            plans = c.plans(n, pages=spec.pages, max_chunks=spec.max_chunks, seed=rng.getrandbits(32))
            for i, plan in enumerate(plans):
                if rng.random() < spec.victim_fraction:
                    plans[i] = plan.model_copy(update={"room": AUX_FAIL_ROOMS + victims})
                    victims += 1
            by_room = {p.room: p for p in plans}
            ranks = {p.room: len(c.ranks_of(p)) for p in plans}
            ev = schedule.get(b)
            if ev is not None and ev.kind != "flip":
                # requests on the target stall before their last chunk: in flight at the fault
                plans = [
                    p.model_copy(update={"stall_s": 1.0}) if ev.touches(p) else p for p in plans
                ]
                by_room = {p.room: p for p in plans}
            inj = _Injector(c, ev, spec, bed, plans) if ev else None
            if inj is not None:
                assert ev is not None
                report.faults.append(ev)
                inj.before()
                # every request is started before the fault fires: none is started on a
                # dead rank (its peers would wait for it until their timeouts)
                conc = len(plans)

                results = c.run(
                    plans, concurrency=conc, timeout_s=spec.batch_timeout_s, ignore_dead=True,
                    on_sent=lambda _p, room, _chunk: inj.seen(room),  # type: ignore[union-attr]
                    on_result=lambda res: inj.seen(res.plan.room),  # type: ignore[union-attr]
                )  # fmt: skip
                inj.after()
            else:
                results = c.run(plans, concurrency=spec.concurrency, timeout_s=spec.batch_timeout_s)
            for res in results:
                recent = [
                    f for f in report.faults
                    if f is not ev and res.t_start < f.t_end + spec.recovery_s
                ]  # fmt: skip
                report.entries.append(classify(res, ranks[res.plan.room], b, ev, recent))
            done += n
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
    ap.add_argument("--faults", default="kill_decode,kill_prefill,flip,freeze")
    ap.add_argument("--fault-every", type=int, default=3)
    ap.add_argument("--victim-fraction", type=float, default=0.02)
    ap.add_argument("--netns", action="store_true", help="namespaces per role (root): partitions")
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
        report = run_soak(spec, on_batch=lambda d, _t: bar.update(task, completed=d))
    print(report.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    bad = report.unexpected() or report.not_flat() or report.leftover_tables
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
