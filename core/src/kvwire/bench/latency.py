"""``kvwire bench --latency``: where one request's time goes, stage by stage, at C=1.

One prefill rank and one decode rank run in two spawned processes (as ``kvwire bench``'s
clusters do), each a :class:`~kvwire.session.KVManager` over a verification pool, each playing
its engine with exactly the engine API. Requests run one at a time: prefill creates the sender
and fills the request's source pages (fresh values per request), then tells decode (a pipe
between the two processes, outside the timed window); decode poisons its destination pages,
creates the receiver and asks (``init`` + ``send_metadata``); prefill's engine loop sees the
request, calls ``send(pages, last=True)`` and polls to Success; decode's engine loop polls to
Success and checks every element of the request's pages. Any mismatch or failure is reported.

The stages come from ``time.perf_counter()`` stamps taken in both processes (CLOCK_MONOTONIC
on Linux, one clock for the whole host): the engine loops' own stamps and the managers'
:attr:`RequestMetrics.marks <kvwire.session.metrics.RequestMetrics.marks>`:

==========  ==============================================================================
stage       from -> to
==========  ==============================================================================
ask         decode engine's ``init`` -> the transfer request left decode (``requested``)
reach       decode ``requested`` -> prefill has every request it waits for (``asked``)
see         prefill ``asked`` -> prefill's engine poll sees ``WaitingForInput``
queue       prefill's ``send()`` -> a transfer worker took the chunk (``taken``)
post        ``taken`` -> the last write handed to the backend (``posted``, stamped as its
            submit is called; the aux row's, unless it rides in the last chunk's note:
            protocol 1.11); its part
            ``plan``: until the last chunk's plan was ready (``planned``: with bulk
            staging, ring space granted and the block gathered)
land        ``posted`` -> decode handled the last note (``noted``): the submit call, the
            bytes and the notification on their way, decode's poll
finish      decode ``noted`` -> decode ``success``
report      decode ``success`` -> decode's engine poll sees Success
==========  ==============================================================================

Totals: ``send->decode`` (prefill's ``send()`` to decode's engine seeing Success: the figure
issue 27 sets a target for), ``init->decode`` (the decode engine's whole wait), and
``send->prefill`` (prefill's ``send()`` to its engine seeing Success).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from pydantic import SecretStr

from kvwire.bench.common import BenchError, machine_info, page_bytes, pct_ms
from kvwire.config import KVWireConfig
from kvwire.layout import ModelSpec, RankPosition

logger = logging.getLogger(__name__)

#: The stages, in the order of a request's life: (name, from mark, to mark).
STAGES: tuple[tuple[str, str, str], ...] = (
    ("ask", "d.init", "d.requested"),
    ("reach", "d.requested", "p.asked"),
    ("see", "p.asked", "p.seen"),
    ("queue", "p.send", "p.taken"),
    ("post", "p.taken", "p.posted"),
    ("land", "p.posted", "d.noted"),
    ("finish", "d.noted", "d.success"),
    ("report", "d.success", "d.polled"),
)
#: Parts of a stage, shown under it: ``plan`` is the part of ``post`` until the last chunk's
#: plan was ready (with bulk staging: ring space granted, the block gathered).
SUBSTAGES: tuple[tuple[str, str, str], ...] = (("plan", "p.taken", "p.planned"),)
TOTALS: tuple[tuple[str, str, str], ...] = (
    ("send->decode", "p.send", "d.polled"),
    ("init->decode", "d.init", "d.polled"),
    ("send->prefill", "p.send", "p.polled"),
)
#: Requests run (and dropped) before the timed ones: the handshake and first-use costs.
WARMUP = 20
#: Longest one request may take before the run is declared stuck.
REQUEST_TIMEOUT_S = 30.0


@dataclass
class LatencyReport:
    """One ``kvwire bench --latency`` run."""

    backend: str
    pages: int
    page_bytes: int
    requests: int
    ok: int
    verified: int
    engine_step_us: float
    #: Stage and total name -> per-request seconds (requests that succeeded).
    samples: dict[str, list[float]]
    failures: list[str]
    machine: dict[str, Any]
    command: str = ""
    #: Stage name -> {"p50": ms, "p99": ms, "mean": ms}.
    summary: dict[str, dict[str, float]] = field(default_factory=dict)
    #: CPU time per timed request, ms, by ``<side>.<thread role>`` (``engine``: the engine
    #: loop, polls included; ``worker``, ``progress``, ``liveness``, ``tcp``: kvwire's
    #: threads; ``native``: the process's threads outside Python, e.g. ZeroMQ's and UCX's;
    #: ``process``: all): what the request path costs whatever the machine's load (the
    #: stages above also wait for a CPU on a busy host).
    cpu_ms: dict[str, float] = field(default_factory=dict)
    #: Prefill's staged first chunks by what became of decode's ring-space offer (bulk
    #: staging: ``kvwire_staging_offers_total``), warm-up requests included; empty otherwise.
    offers: dict[str, int] = field(default_factory=dict)

    @property
    def ok_all(self) -> bool:
        return not self.failures and self.ok == self.requests == self.verified

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok_all
        return out


def summarise(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """p50, p99 and mean (ms) of every stage and total."""
    return {
        k: {
            "p50": round(pct_ms(v, 50), 4),
            "p99": round(pct_ms(v, 99), 4),
            "mean": round(float(np.mean(v) * 1e3), 4) if v else 0.0,
        }
        for k, v in samples.items()
    }


def stage_samples(records: list[dict[str, float]]) -> dict[str, list[float]]:
    """Per stage and total, the seconds of every request record (a merged dict of the two
    processes' stamps, ``p.*`` and ``d.*``)."""
    every = (*STAGES, *SUBSTAGES, *TOTALS)
    out: dict[str, list[float]] = {name: [] for name, _, _ in every}
    for rec in records:
        for name, a, b in every:
            if a in rec and b in rec:
                out[name].append(rec[b] - rec[a])
    return out


def _model(page_kib: int) -> ModelSpec:
    from kvwire.bench.common import model_for

    return model_for(page_kib)


def _config(config_json: str, secret: str) -> KVWireConfig:
    """A rank's config: the parent's (its JSON hides the secret, passed on its own)."""
    config = KVWireConfig.model_validate_json(config_json)
    if secret:
        config = config.model_copy(update={"secret": SecretStr(secret)})
    return config


def _thread_label(name: str) -> str:
    """A thread's role from its name (agent names stripped)."""
    if name == "MainThread":
        return "engine"
    if "-w" in name and not name.startswith("kvwire-"):
        return "worker"  # transfer workers are named <agent>-w<i>
    parts = name.split("-")
    return parts[1] if name.startswith("kvwire-") and len(parts) > 1 else "other"


def _cpu_snapshot() -> dict[str, float]:
    """CPU seconds so far of this process (``process``) and of each Python thread role; the
    native threads (ZeroMQ's, UCX's) are the process total minus the Python threads."""
    out: dict[str, float] = {"process": time.process_time()}
    for t in threading.enumerate():
        if t.ident is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(t.ident)
            used = time.clock_gettime(clock)
        except (OSError, AttributeError):  # the thread ended, or no such clock here
            continue
        label = _thread_label(t.name)
        out[label] = out.get(label, 0.0) + used
    return out


def _cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    used = {k: after[k] - before.get(k, 0.0) for k in after}
    python = sum(v for k, v in used.items() if k != "process")
    used["native"] = max(0.0, used["process"] - python)
    return used


def _offers() -> dict[str, int]:
    """This process's ``kvwire_staging_offers_total`` by result (empty: none counted)."""
    from prometheus_client import REGISTRY

    out: dict[str, int] = {}
    for result in ("taken", "other_pages", "none"):
        v = REGISTRY.get_sample_value("kvwire_staging_offers_total", {"result": result})
        if v:
            out[result] = int(v)
    return out


def _wait(poll: Any, want: Any, step_s: float, what: str) -> float:
    """Engine loop: poll until the status is at least ``want`` (or Failed); the time of the
    poll that saw it. A step of 0 yields the GIL between polls without sleeping."""
    from kvwire.session import KVPoll

    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while True:
        status = poll()
        if status >= want or status is KVPoll.Failed:
            t = time.perf_counter()
            if status is KVPoll.Failed:
                raise BenchError(f"{what}: the request failed")
            return t
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: still {status.name} after {REQUEST_TIMEOUT_S:.0f}s")
        time.sleep(step_s)


def _prefill_main(
    conn: Connection,
    peer: Connection,
    config_json: str,
    secret: str,
    page_kib: int,
    pages: int,
    total: int,
    step_s: float,
    warmup: int,
) -> None:
    """Prefill process: the sender side of every request."""
    from kvwire.session import KVManager, KVPoll, Role
    from kvwire.testing.kvfill import fill_pages, make_pool

    config = _config(config_json, secret)
    layout, arrays = make_pool(_model(page_kib), RankPosition(), pages + 1)
    mgr = KVManager(config, Role.PREFILL, layout, kv_tensors=arrays)
    try:
        conn.send(("ready", mgr.bootstrap_addr))
        src = np.arange(pages, dtype=np.int64)
        records = []
        cpu: dict[str, float] = {}
        for i in range(total):
            if i == warmup:
                cpu = _cpu_snapshot()
            room = 1000 + i
            fill_pages(layout, arrays, src, i * pages)
            sender = mgr.sender(room)
            sender.init(pages, 0)
            peer.send(i)
            rec: dict[str, float] = {}
            try:
                rec["p.seen"] = _wait(sender.poll, KVPoll.WaitingForInput, step_s, "prefill")
                rec["p.send"] = time.perf_counter()
                sender.send(src, last=True)
                rec["p.polled"] = _wait(sender.poll, KVPoll.Success, step_s, "prefill")
            except BenchError as exc:
                rec["error"] = 1.0
                logger.warning("room %d: %s", room, exc)
            rec.update({f"p.{k}": v for k, v in sender.metrics.marks.items()})
            sender.clear()
            records.append(rec)
            if peer.recv() != i:  # decode finished (and checked) request i
                raise BenchError("decode lost step")
        used = _cpu_used(cpu, _cpu_snapshot())
        peer.send(-1)  # decode may close now: every write of this side has ended
        conn.send(("records", (records, used, _offers())))
    finally:
        mgr.close()


def _decode_main(
    conn: Connection,
    peer: Connection,
    config_json: str,
    secret: str,
    page_kib: int,
    pages: int,
    total: int,
    step_s: float,
    warmup: int,
    addr: str,
) -> None:
    """Decode process: the receiver side of every request, every element checked."""
    from kvwire.session import KVManager, KVPoll, Role
    from kvwire.testing.kvfill import count_mismatches, make_pool

    config = _config(config_json, secret)
    layout, arrays = make_pool(_model(page_kib), RankPosition(), 2 * pages + 1)
    mgr = KVManager(config, Role.DECODE, layout, kv_tensors=arrays)
    try:
        conn.send(("ready", ""))
        records = []
        cpu: dict[str, float] = {}
        for i in range(total):
            if i == warmup:
                cpu = _cpu_snapshot()
            dst = np.arange(pages, dtype=np.int64) + (pages if i % 2 else 1)
            for a in arrays:
                a[dst] = -1
            if peer.recv() != i:
                raise BenchError("prefill lost step")
            rec: dict[str, float] = {"d.init": time.perf_counter()}
            recv = mgr.receiver(1000 + i, addr)
            recv.init()
            recv.send_metadata(dst, 0)
            try:
                rec["d.polled"] = _wait(recv.poll, KVPoll.Success, step_s, "decode")
                bad = count_mismatches(layout, arrays, dst, i * pages)
                rec["d.mismatches"] = float(bad)
            except BenchError as exc:
                rec["error"] = 1.0
                logger.warning("room %d: %s", 1000 + i, exc)
            rec.update({f"d.{k}": v for k, v in recv.metrics.marks.items()})
            recv.clear()
            records.append(rec)
            peer.send(i)
        used = _cpu_used(cpu, _cpu_snapshot())
        peer.recv()  # closing earlier would evict prefill's view of us before its Success
        conn.send(("records", (records, used)))
    finally:
        mgr.close()


def _expect(conn: Connection, proc: Any, kind: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.05):
            msg = conn.recv()
            if msg[0] == kind:
                return msg[1]
        elif not proc.is_alive():
            raise BenchError(f"{proc.name} exited with code {proc.exitcode}")
    raise BenchError(f"{proc.name}: no {kind!r} within {timeout_s:.0f}s")


def measure_latency(
    config: KVWireConfig,
    requests: int,
    pages: int = 1,
    page_kib: int = 32,
    engine_step_s: float = 0.00005,
    warmup: int = WARMUP,
) -> LatencyReport:
    """Run ``warmup + requests`` requests one at a time between two spawned rank processes;
    returns the timed ones' stages. Raises :class:`BenchError` when the ranks cannot run."""
    if requests < 1 or pages < 1 or warmup < 0:
        raise BenchError("--requests and the pages per request must be >= 1, --warmup >= 0")
    ctx = mp.get_context("spawn")
    total = warmup + requests
    cfg = config.model_dump_json()
    secret = config.secret.get_secret_value() if config.secret is not None else ""
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    pd_a, pd_b = ctx.Pipe()
    step = engine_step_s
    pre = ctx.Process(
        target=_prefill_main,
        args=(p_child, pd_a, cfg, secret, page_kib, pages, total, step, warmup),
        name="kvwire-latency-prefill",
        daemon=True,
    )
    procs = [pre]
    try:
        pre.start()
        addr = _expect(p_conn, pre, "ready", 120.0)
        dec = ctx.Process(
            target=_decode_main,
            args=(d_child, pd_b, cfg, secret, page_kib, pages, total, step, warmup, addr),
            name="kvwire-latency-decode",
            daemon=True,
        )
        procs.append(dec)
        dec.start()
        _expect(d_conn, dec, "ready", 120.0)
        budget = 60.0 + total * 0.5
        p_recs, p_cpu, offers = _expect(p_conn, pre, "records", budget)
        d_recs, d_cpu = _expect(d_conn, dec, "records", budget)
    finally:
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
    failures: list[str] = []
    merged = []
    verified = ok = 0
    for i, (pr, dr) in enumerate(zip(p_recs, d_recs, strict=True)):
        if i < warmup:
            continue
        rec = {**pr, **dr}
        bad = rec.get("d.mismatches")
        if "error" in rec or bad is None:
            failures.append(f"request {i}: failed (see the rank logs)")
            continue
        ok += 1
        if bad:
            failures.append(f"request {i}: {int(bad)} elements differ on decode")
            continue
        verified += 1
        merged.append(rec)
    samples = stage_samples(merged)
    return LatencyReport(
        backend=config.transfer_backend,
        pages=pages,
        page_bytes=page_bytes(_model(page_kib)),
        requests=requests,
        ok=ok,
        verified=verified,
        engine_step_us=engine_step_s * 1e6,
        samples=samples,
        failures=failures,
        machine=machine_info(config.transfer_backend),
        summary=summarise(samples),
        cpu_ms={
            f"{side}.{k}": round(v * 1e3 / requests, 4)
            for side, used in (("prefill", p_cpu), ("decode", d_cpu))
            for k, v in sorted(used.items())
        },
        offers=offers,
    )
