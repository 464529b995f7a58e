"""What ``kvwire bench``'s modes share: the model, timed batches and how they are summed up.

A batch (:class:`Run`) is one mode moving ``requests`` requests of ``pages`` pages with
``concurrency`` in flight; a :class:`Cell` combines the batches of one (mode, size,
concurrency). Cluster batches come from :func:`cluster_batch`; the raw backend's from
:mod:`kvwire.bench.raw`.
"""

from __future__ import annotations

import os
import platform
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np

from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster, RequestResult, RoomPlan

#: The benchmark model: 8 layers x 8 KV heads, 64 int32 per head row (the bytes of a 128-dim
#: bfloat16 head; verification pools are int32). A token of every layer, K and V, is 32 KiB;
#: the page size (tokens per page) follows from the page bytes asked for (:func:`model_for`).
BASE_MODEL = ModelSpec(num_layers=8, total_kv_heads=8, head_dim=64, dtype="int32", page_size=1)
#: Default page: 2 MiB (64 tokens), so a (page, layer, K|V) descriptor is 128 KiB.
DEFAULT_PAGE_KIB = 2048
#: A batch runs at least this many requests per request in flight (ramp-up and drain are short).
MIN_WAVES = 4

Advance = Callable[[int], None]
#: Keys of :attr:`Cell.prefill_p50_ms`.
PREFILL_STAGES = ("queue", "post", "transfer", "latency")


class BenchError(RuntimeError):
    """The benchmark could not run."""


def token_bytes(model: ModelSpec = BASE_MODEL) -> int:
    """Bytes of one token over every layer, K and V."""
    per = model.total_kv_heads * model.head_dim * model.dtype_size
    return per * model.num_layers * (1 if model.is_mla else 2)


def model_for(page_kib: int) -> ModelSpec:
    """The benchmark model with pages of ``page_kib`` KiB (a multiple of one token's bytes)."""
    tok = token_bytes()
    if page_kib < 1 or (page_kib * 1024) % tok:
        raise BenchError(
            f"--page-kib must be a positive multiple of {tok >> 10} KiB (one token of "
            f"{BASE_MODEL.num_layers} layers x {BASE_MODEL.total_kv_heads} heads, K and V)"
        )
    return BASE_MODEL.model_copy(update={"page_size": page_kib * 1024 // tok})


#: The model at the default page size.
MODEL = model_for(DEFAULT_PAGE_KIB)


def page_bytes(model: ModelSpec = MODEL) -> int:
    """Bytes one page slot of a request moves (every layer, K and V)."""
    return token_bytes(model) * model.page_size


def requests_for(requests: int, concurrency: int) -> int:
    """Requests in a batch: ``requests``, but at least :data:`MIN_WAVES` per request in flight."""
    return max(requests, MIN_WAVES * concurrency)


# ------------------------------------------------------------------------------ results
@dataclass
class Run:
    """One timed batch."""

    mode: str
    pages: int
    concurrency: int
    requests: int
    ok: int
    bytes: int
    descriptors: int
    wall_s: float
    #: Per completed request: start -> done (s); cluster modes also decode-side latency.
    latencies: list[float] = field(default_factory=list)
    decode_latencies: list[float] = field(default_factory=list)
    #: Bytes of KV one request moves (pages x page bytes).
    request_bytes: int = 0
    #: Cluster modes, per completed request, on prefill (s): worker-queue wait, mapping +
    #: submit, submit -> completion (sums over the request's transfers, aux row included),
    #: and the sender's creation -> Success.
    prefill_stages: list[tuple[float, float, float, float]] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0


@dataclass
class Cell:
    """A mode at one request size and concurrency: its best batch, and totals over all."""

    mode: str
    pages: int
    concurrency: int
    request_bytes: int
    #: Descriptors per request: one per (page, layer, K|V) row; kvwire adds its aux rows (a
    #: stamp row and the engine's aux row, in a second transfer posted with the last chunk).
    descriptors: int
    repeats: int
    #: Totals over every batch. ``ok``: completed (cluster: Success on every rank and the aux
    #: row checked; raw: DONE).
    requests: int
    ok: int
    failed: int
    #: The best batch: ``gbps = best_bytes / best_wall_s / 1e9``.
    gbps: float
    best_bytes: int
    best_wall_s: float
    gbps_runs: list[float]
    #: Request latency over every batch (ms): cluster modes from the parent starting the
    #: request to every rank reporting it (harness pipes included); raw from submit to DONE.
    p50_ms: float
    p99_ms: float
    mean_ms: float = 0.0
    #: Cluster modes: on decode, from the engine's first call for the request (receiver
    #: creation) to its poll seeing Success: the engine API's own latency.
    decode_p50_ms: float | None = None
    decode_p99_ms: float | None = None
    decode_mean_ms: float | None = None
    #: Cluster modes: p50 on prefill (ms) of ``queue`` (worker-queue wait), ``post`` (mapping
    #: + submit: an engine that copies inside its post call, such as UCX over cma, copies
    #: here), ``transfer`` (submit -> completion) and ``latency`` (sender created -> Success).
    prefill_p50_ms: dict[str, float] | None = None


@dataclass
class Check:
    """Requests whose data was checked: every element on decode (a verified pass) or the
    target's pages digested after a raw batch."""

    mode: str
    pages: int
    concurrency: int
    requests: int
    verified: int
    method: str


@dataclass
class Ratio:
    """Ratios of the best GB/s of one (size, concurrency), from the cells of the same run,
    and the latency kvwire adds over raw (decode-side p50 minus raw p50, ms)."""

    pages: int
    concurrency: int
    kvwire_vs_raw: float
    async_vs_sync: float
    added_p50_ms: float = 0.0


def pct_ms(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of seconds, in ms (0 for none)."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q) * 1e3) if values else 0.0


def mean_ms(values: Sequence[float]) -> float:
    return float(np.mean(np.asarray(values, dtype=np.float64)) * 1e3) if values else 0.0


def problems_of(
    what: str, pages: int, concurrency: int, results: Sequence[RequestResult]
) -> list[str]:
    """One line per request of a cluster batch that was not ok, with every rank's report."""
    out = []
    for r in results:
        if not r.ok:
            why = "; ".join(
                f"{rep.role}{rep.rank}: status={rep.status} mismatches={rep.mismatches} "
                f"aux_ok={rep.aux_ok} error={rep.error}"
                for rep in r.reports
            )
            out.append(f"{what} pages={pages} C={concurrency} room {r.plan.room}: {why}")
    return out


def run_of(
    mode: str,
    pages: int,
    concurrency: int,
    results: Sequence[RequestResult],
    request_bytes: int | None = None,
) -> Run:
    """A cluster batch as a :class:`Run`; only requests that were ok count."""
    ok = [r for r in results if r.ok]
    return Run(
        mode=mode,
        pages=pages,
        concurrency=concurrency,
        requests=len(results),
        ok=len(ok),
        bytes=sum(r.bytes for r in ok),
        descriptors=max((r.descriptors for r in ok), default=0),
        wall_s=max(r.t_end for r in results) - min(r.t_start for r in results) if results else 0.0,
        latencies=[r.t_end - r.t_start for r in ok],
        decode_latencies=[r.latency_s for r in ok],
        request_bytes=pages * page_bytes() if request_bytes is None else request_bytes,
        prefill_stages=[
            (rep.queue_s, rep.post_s, rep.transfer_s, rep.latency_s)
            for r in ok
            for rep in r.reports
            if rep.role == "prefill"
        ],
    )


def cell_of(runs: Sequence[Run]) -> Cell:
    """Combine the batches of one (mode, size, concurrency)."""
    first = runs[0]
    best = max(runs, key=lambda r: r.gbps)
    lat = [x for r in runs for x in r.latencies]
    dec = [x for r in runs for x in r.decode_latencies]
    stages = [x for r in runs for x in r.prefill_stages]
    return Cell(
        mode=first.mode,
        pages=first.pages,
        concurrency=first.concurrency,
        request_bytes=first.request_bytes,
        descriptors=max(r.descriptors for r in runs),
        repeats=len(runs),
        requests=sum(r.requests for r in runs),
        ok=sum(r.ok for r in runs),
        failed=sum(r.requests - r.ok for r in runs),
        gbps=best.gbps,
        best_bytes=best.bytes,
        best_wall_s=best.wall_s,
        gbps_runs=[r.gbps for r in runs],
        p50_ms=pct_ms(lat, 50),
        p99_ms=pct_ms(lat, 99),
        mean_ms=mean_ms(lat),
        decode_p50_ms=pct_ms(dec, 50) if dec else None,
        decode_p99_ms=pct_ms(dec, 99) if dec else None,
        decode_mean_ms=mean_ms(dec) if dec else None,
        prefill_p50_ms=_stages_p50(stages) if stages else None,
    )


def _stages_p50(stages: Sequence[tuple[float, float, float, float]]) -> dict[str, float]:
    a = np.asarray(stages, dtype=np.float64) * 1e3
    p50 = np.percentile(a, 50, axis=0)
    return {k: round(float(v), 4) for k, v in zip(PREFILL_STAGES, p50, strict=True)}


def ratios_of(cells: Sequence[Cell]) -> list[Ratio]:
    """``kvwire / raw`` and ``kvwire / sync`` GB/s for every (size, concurrency) measured in
    all three modes, and kvwire's decode-side p50 minus raw's p50."""
    by = {(c.mode, c.pages, c.concurrency): c for c in cells}
    out = []
    for c in cells:
        if c.mode != "kvwire":
            continue
        raw = by.get(("raw", c.pages, c.concurrency))
        sync = by.get(("sync", c.pages, c.concurrency))
        if raw is None or sync is None:
            continue
        kv_p50 = c.decode_p50_ms if c.decode_p50_ms is not None else c.p50_ms
        out.append(
            Ratio(
                c.pages,
                c.concurrency,
                c.gbps / raw.gbps if raw.gbps else 0.0,
                c.gbps / sync.gbps if sync.gbps else 0.0,
                kv_p50 - raw.p50_ms,
            )
        )
    return out


# ------------------------------------------------------------------------------ workload
def plans(
    n: int, pages: int, decode_instances: int = 1, verify: bool | None = None
) -> list[RoomPlan]:
    """``n`` one-chunk requests of ``pages`` pages, spread over the decode instances."""
    return [
        RoomPlan(
            room=secrets.randbits(63),
            num_pages=pages,
            chunks=[pages],
            decode_instance=i % decode_instances,
            verify=verify,
        )
        for i in range(n)
    ]


def cluster_batch(
    cl: Cluster,
    mode: str,
    pages: int,
    concurrency: int,
    n: int,
    advance: Advance,
    decode_instances: int = 1,
) -> tuple[Run, list[str]]:
    """One timed cluster batch; the problems name every request that was not ok."""
    want = pages * page_bytes(cl.spec.model)
    results = cl.run(
        plans(n, pages, decode_instances),
        concurrency=concurrency,
        timeout_s=120 + 0.2 * n * pages,
        on_result=lambda _r: advance(1),
    )
    run = run_of(mode, pages, concurrency, results, want)
    problems = problems_of(mode, pages, concurrency, results)
    short = sum(1 for r in results if r.ok and r.bytes < want)
    if short:
        problems.append(f"{mode} pages={pages}: {short} requests moved fewer than {want} bytes")
    return run, problems


def verified_pass(
    cl: Cluster,
    mode: str,
    pages: int,
    concurrency: int,
    n: int,
    advance: Advance,
    decode_instances: int = 1,
) -> tuple[Check, list[str]]:
    """``n`` requests with every element filled on prefill and checked on decode (the
    cluster's timed requests skip that)."""
    results = cl.run(
        plans(n, pages, decode_instances, verify=True),
        concurrency=concurrency,
        timeout_s=120 + 0.5 * n * pages,
        on_result=lambda _r: advance(1),
    )
    good = sum(r.ok for r in results)
    check = Check(mode, pages, concurrency, n, good, "every element on decode")
    return check, problems_of(f"{mode} (verified pass)", pages, concurrency, results)


def machine_info(backend: str) -> dict[str, Any]:
    """Where the figures come from."""
    try:
        kv_version = version("kvwire")
    except PackageNotFoundError:
        kv_version = "source"
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "kvwire_version": kv_version,
        "backend": backend,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "load_average_at_start": list(load) if load else None,
    }


def memory_guard(pool_bytes: int, pools: int, what: str) -> None:
    """Refuse a run whose KV pools would take more than half the machine's memory."""
    total = pools * pool_bytes
    try:
        mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if total > mem // 2:
        raise BenchError(
            f"the KV pools would take up to {total / 2**30:.1f} GiB ({pools} pools of "
            f"{pool_bytes / 2**20:.0f} MiB: {what}) on a machine with {mem / 2**30:.1f} GiB; "
            "use smaller sizes, concurrency or --page-kib"
        )
