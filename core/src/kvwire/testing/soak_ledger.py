"""The ledger of a soak (:mod:`kvwire.testing.soak`): the faults it injected, one entry per
request (ok, failed as expected, unexpected, corrupt) and per-process resource samples (fds
from ``/proc/<pid>/fd``, threads and RSS from ``/proc/<pid>/status``), with the flatness
check (:meth:`SoakReport.not_flat`)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kvwire.testing.cluster import Cluster, RequestResult, RoomPlan
from kvwire.testing.faults import AUX_FAIL_ROOMS

FAULT_KINDS = ("kill_decode", "kill_prefill", "flip", "freeze", "partition", "dead_backend")
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
    # a prefill instance's primary backend breaks: its links fail over to the next backend
    # both sides announced, so no request may fail by it
    "dead_backend": (),
}
#: A prefill rank that decode never asked for a request's KV fails it with this.
BOOTSTRAP_TIMEOUT = "bootstrap timeout"
#: A refused room's error names the refusal.
REFUSED = "refused"


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
    #: ``dead_backend``: the target ranks' link switches to the fallback during the fault and
    #: back to the primary once it healed (their failover metrics, counted by the ranks), and
    #: whether every link of theirs was back on the primary after the batch.
    failovers: int = 0
    recoveries: int = 0
    recovered: bool = False

    def touches(self, plan: RoomPlan) -> bool:
        """Whether ``plan`` ran on the instance this fault hit (a partition: the decode
        instance whose namespace was cut)."""
        inst = plan.prefill_instance if self.role == "prefill" else plan.decode_instance
        return inst == self.inst

    def explains(self, error: str, others: list[str] | None = None) -> bool:
        """Whether ``error`` names a cause of this fault; or, among the errors ``others`` of
        the same request, is a prefill rank's bootstrap timeout while another error names the
        cause (decode failed the request on a dead peer before asking this rank, which then
        waits for its bootstrap timeout)."""
        if any(a and a in error for a in self.agents) or any(
            w in error.lower() for w in CAUSES[self.kind]
        ):
            return True
        return (
            others is not None
            and BOOTSTRAP_TIMEOUT in error
            and any(self.explains(o) for o in others if o is not error)
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
    #: Seconds each batch took.
    batch_s: list[float] = field(default_factory=list)

    @property
    def counts(self) -> Counter[str]:
        return Counter(e.outcome for e in self.entries)

    def unexpected(self) -> list[Entry]:
        return [e for e in self.entries if e.outcome in ("unexpected", "corrupt")]

    def growth(self) -> dict[str, dict[str, int]]:
        """Per process (name:pid) alive for at least 3 samples after the warm-up: growth of
        fds, threads and RSS (KiB) from the start of its life to its end, each end being the
        median of a third of its samples (one sample each with 3 to 5). A transient after a
        fault (a peer's sockets held until its failed rooms' writes are known to have ended)
        is not growth; a leak moves the median."""
        by: dict[str, list[Sample]] = {}
        for s in self.samples:
            by.setdefault(f"{s.name}:{s.pid}", []).append(s)
        out = {}
        for key, ss in by.items():
            if ss[0].batch > 0:  # started by a restart: its first sample was taken before it
                ss = ss[1:]  # served anything
            ss = [s for s in ss if s.batch >= self.warmup_batches]
            if len(ss) < 3:
                continue
            k = len(ss) // 3
            head, tail = ss[:k], ss[-k:]

            def med(xs: list[Sample], attr: str) -> int:
                return sorted(int(getattr(x, attr)) for x in xs)[len(xs) // 2]

            out[key] = {
                "fds": med(tail, "fds") - med(head, "fds"),
                "threads": med(tail, "threads") - med(head, "threads"),
                "rss_kib": med(tail, "rss_kib") - med(head, "rss_kib"),
                "rss_start_kib": med(head, "rss_kib"),
                "batches": ss[-1].batch - ss[0].batch,
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
            "batch_s": self.batch_s,
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
                    + (
                        f"; {sum(f.failovers for f in fs)} link failovers, "
                        f"{sum(f.recoveries for f in fs)} recoveries, "
                        f"{sum(f.recovered for f in fs)} of {len(fs)} back on the primary"
                        if kind == "dead_backend"
                        else ""
                    )
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
    if _refused(plan) and complete and errors and all(REFUSED in e for e in errors):
        entry.outcome = "expected"  # refused, whatever fault its batch carried
        return entry
    # every rank that failed names a cause the fault explains (a rank that did not report is
    # the one killed), or the room was refused anyway
    if (
        ev is not None
        and ev.touches(plan)
        and all(ev.explains(e, errors) or (_refused(plan) and REFUSED in e) for e in errors)
    ):
        entry.outcome = "expected"
        ev.failed += 1
        return entry
    for old in recent:
        if old.touches(plan) and all(old.explains(e, errors) for e in errors):
            entry.outcome = "expected"
            old.failed_after += 1
            return entry
    entry.outcome = "unexpected"
    return entry


def _refused(plan: RoomPlan) -> bool:
    return 0 <= plan.room - AUX_FAIL_ROOMS < 1 << 16
