"""``kvwire bench``: kvwire end to end against the backend's raw transfers, and async vs sync.

One run measures three ways of moving the same requests (one prefill rank -> one decode rank,
equal TP, each request one chunk of ``pages`` random page slots), at every request size and
concurrency level asked for:

``kvwire``
    A :class:`~kvwire.testing.cluster.Cluster` (real prefill and decode rank processes, each
    running a :class:`~kvwire.session.KVManager` with its transfer workers); the parent keeps
    ``concurrency`` requests in flight. GB/s is the bytes kvwire moved over the wall time of
    the batch; latency is from the parent starting a request to every rank reporting it done.
``sync``
    The same cluster workload with ``sync_transfers=True``: each transfer runs on the engine's
    thread inside ``send()`` (the single-thread baseline).
``raw``
    The backend alone, in this process, against a :class:`~kvwire.testing.remote.RemoteAgent`
    target in a spawned child: the mapper's tables are built and prepared once, every request's
    index arrays (``map_chunk`` output for random pages) are computed before timing, and up to
    ``concurrency`` handles are kept in flight (submit, poll, release).

All three are up at once and each (size, concurrency) is measured mode after mode, ``repeat``
times (the order rotating), so the ratios ``kvwire / raw`` and ``kvwire / sync`` compare
batches run seconds apart; a cell's GB/s is its best batch.

Correctness is checked without charging the check to the timings: the timed clusters run with
``verify=False`` (no per-request fill and check; every request's aux row is still checked), and
before timing, a verified cluster per mode moves requests of every size at the highest
concurrency with every element checked on decode. Every raw batch is checked afterwards by
digesting the target's pages. Any failure fails the run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import platform
import secrets
import shlex
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvwire.backend import XferOp, XferState
from kvwire.config import KVWireConfig, config_from_args
from kvwire.control.handshake import build_mapper
from kvwire.errors import KVWireError
from kvwire.layout import KVLayout, MemoryRegion, ModelSpec, RankPosition
from kvwire.selection import auto_backend_name, create_backend
from kvwire.testing.cluster import Cluster, ClusterError, ClusterSpec, RequestResult, RoomPlan
from kvwire.testing.kvfill import make_pool
from kvwire.testing.remote import RemoteAgent, RemoteAgentError, digest

logger = logging.getLogger(__name__)

#: The benchmark model: 8 layers x 8 KV heads, 64 int32 per head row (the bytes of a 128-dim
#: bfloat16 head; verification pools are int32), 16 tokens per page. One (page, layer, K|V)
#: row is 32 KiB; one page of a request is 16 rows, 512 KiB.
MODEL = ModelSpec(num_layers=8, total_kv_heads=8, head_dim=64, dtype="int32", page_size=16)

MODES = ("kvwire", "sync", "raw")
DEFAULT_SIZES = (1, 4, 16)
DEFAULT_CONCURRENCY = (1, 4, 16)
DEFAULT_REQUESTS = 32
DEFAULT_REPEAT = 3
QUICK_SIZES = (1, 4)
QUICK_CONCURRENCY = (1, 4)
QUICK_REQUESTS = 8
QUICK_REPEAT = 1
#: A batch runs at least this many requests per request in flight (ramp-up and drain are short).
MIN_WAVES = 4
PLOT_HINT = "--plot needs matplotlib: pip install kvwire[plot]"
#: KV pools of ``slots`` pages alive at once: 4 clusters x 2 ranks, the raw source and target.
POOLS = 10


class BenchError(RuntimeError):
    """The benchmark could not run."""


def page_bytes(model: ModelSpec = MODEL) -> int:
    """Bytes one page slot of a request moves (every layer, K and V)."""
    per_buffer = model.page_size * model.total_kv_heads * model.head_dim * model.dtype_size
    return per_buffer * model.num_layers * (1 if model.is_mla else 2)


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
    #: stamp row and the engine's aux row, in a second transfer after the last chunk).
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
    #: Request latency over every batch (ms).
    p50_ms: float
    p99_ms: float
    decode_p50_ms: float | None = None
    decode_p99_ms: float | None = None


@dataclass
class Check:
    """Requests whose data was checked: every element on decode (a verified cluster's pass)
    or the target's pages digested after a raw batch."""

    mode: str
    pages: int
    concurrency: int
    requests: int
    verified: int
    method: str


@dataclass
class Ratio:
    """Ratios of the best GB/s of one (size, concurrency), from the cells of the same run."""

    pages: int
    concurrency: int
    kvwire_vs_raw: float
    async_vs_sync: float


@dataclass
class BenchReport:
    """Everything one ``kvwire bench`` run measured."""

    backend: str
    cells: list[Cell]
    checks: list[Check]
    ratios: list[Ratio]
    failures: list[str]
    machine: dict[str, Any]
    setup: dict[str, Any]
    command: str = ""

    @property
    def ok(self) -> bool:
        """Every timed request completed, every checked request verified, in every mode."""
        return (
            not self.failures
            and all(c.failed == 0 and c.ok == c.requests for c in self.cells)
            and all(c.verified == c.requests for c in self.checks)
            and {c.mode for c in self.checks} >= {c.mode for c in self.cells}
        )

    def cell(self, mode: str, pages: int, concurrency: int) -> Cell:
        """The cell of a mode at a size and concurrency."""
        for c in self.cells:
            if (c.mode, c.pages, c.concurrency) == (mode, pages, concurrency):
                return c
        raise KeyError((mode, pages, concurrency))

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON data."""
        return {
            "kvwire_version": self.machine.get("kvwire_version"),
            "command": self.command,
            "backend": self.backend,
            "ok": self.ok,
            "machine": self.machine,
            "setup": self.setup,
            "cells": [asdict(c) for c in self.cells],
            "checks": [asdict(c) for c in self.checks],
            "ratios": [asdict(r) for r in self.ratios],
            "failures": self.failures,
        }


def _pct_ms(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q) * 1e3) if values else 0.0


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


def run_of(mode: str, pages: int, concurrency: int, results: Sequence[RequestResult]) -> Run:
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
    )


def cell_of(runs: Sequence[Run]) -> Cell:
    """Combine the batches of one (mode, size, concurrency)."""
    first = runs[0]
    best = max(runs, key=lambda r: r.gbps)
    lat = [x for r in runs for x in r.latencies]
    dec = [x for r in runs for x in r.decode_latencies]
    return Cell(
        mode=first.mode,
        pages=first.pages,
        concurrency=first.concurrency,
        request_bytes=first.pages * page_bytes(),
        descriptors=max(r.descriptors for r in runs),
        repeats=len(runs),
        requests=sum(r.requests for r in runs),
        ok=sum(r.ok for r in runs),
        failed=sum(r.requests - r.ok for r in runs),
        gbps=best.gbps,
        best_bytes=best.bytes,
        best_wall_s=best.wall_s,
        gbps_runs=[r.gbps for r in runs],
        p50_ms=_pct_ms(lat, 50),
        p99_ms=_pct_ms(lat, 99),
        decode_p50_ms=_pct_ms(dec, 50) if dec else None,
        decode_p99_ms=_pct_ms(dec, 99) if dec else None,
    )


def ratios_of(cells: Sequence[Cell]) -> list[Ratio]:
    """``kvwire / raw`` and ``kvwire / sync`` GB/s for every (size, concurrency) measured in
    all three modes."""
    by = {(c.mode, c.pages, c.concurrency): c for c in cells}
    out = []
    for c in cells:
        if c.mode != "kvwire":
            continue
        raw = by.get(("raw", c.pages, c.concurrency))
        sync = by.get(("sync", c.pages, c.concurrency))
        if raw is None or sync is None:
            continue
        out.append(
            Ratio(
                c.pages,
                c.concurrency,
                c.gbps / raw.gbps if raw.gbps else 0.0,
                c.gbps / sync.gbps if sync.gbps else 0.0,
            )
        )
    return out


# ------------------------------------------------------------------------------ workload
Advance = Callable[[int], None]


@dataclass
class _Plan:
    sizes: list[int]
    concurrency: list[int]
    requests: int
    repeat: int

    @property
    def slots(self) -> int:
        """Page slots per buffer: every request in flight, plus room for a few failed
        requests' quarantined slots."""
        return max(self.sizes) * (max(self.concurrency) + 2)

    @property
    def check_requests(self) -> int:
        """Requests per size of a mode's verified pass (at the highest concurrency)."""
        return 2 * max(self.concurrency)

    def batch(self, concurrency: int) -> int:
        return requests_for(self.requests, concurrency)

    @property
    def total_requests(self) -> int:
        """Every request the run makes (for the progress bar)."""
        timed = len(self.sizes) * sum(self.batch(c) for c in self.concurrency) * self.repeat
        checked = 2 * len(self.sizes) * self.check_requests
        return len(MODES) * (timed + max(self.concurrency)) + checked


def _plans(n: int, pages: int) -> list[RoomPlan]:
    return [RoomPlan(room=secrets.randbits(63), num_pages=pages, chunks=[pages]) for _ in range(n)]


def cluster_batch(
    cl: Cluster, mode: str, pages: int, concurrency: int, n: int, advance: Advance
) -> tuple[Run, list[str]]:
    """One timed cluster batch; the problems name every request that was not ok."""
    results = cl.run(
        _plans(n, pages),
        concurrency=concurrency,
        timeout_s=120 + 0.2 * n * pages,
        on_result=lambda _r: advance(1),
    )
    run = run_of(mode, pages, concurrency, results)
    problems = problems_of(mode, pages, concurrency, results)
    want = pages * page_bytes()
    short = sum(1 for r in results if r.ok and r.bytes < want)
    if short:
        problems.append(f"{mode} pages={pages}: {short} requests moved fewer than {want} bytes")
    return run, problems


class RawBench:
    """The backend alone: tables prepared once against a :class:`RemoteAgent` target.

    :meth:`start` spawns the target without waiting; :meth:`open` waits for it and prepares.
    """

    def __init__(self, config: KVWireConfig, slots: int, seed: int = 12345) -> None:
        self.config = config
        self.slots = slots
        self.rng = np.random.default_rng(seed)
        self.layout, self.arrays = make_pool(MODEL, RankPosition(), slots)
        self.agent = RemoteAgent(
            config.transfer_backend, config.transfer_backend_options, "bench-raw-target"
        )
        self.backend: Any = None
        self.pair: Any = None

    def start(self) -> None:
        self.agent.start()

    def open(self) -> None:
        """Fill the source, allocate the target, build and prepare the tables."""
        for arr in self.arrays:
            arr[:] = self.rng.integers(-(2**31), 2**31 - 1, size=arr.shape, dtype=np.int32)
        self.agent.wait_ready()
        self.buf_bytes = self.layout.buffers[0].length
        item = self.layout.buffers[0].item_len
        remote = self.agent.allocate("kv", self.buf_bytes * len(self.arrays), None, watch=False)
        dst = KVLayout(
            model=MODEL,
            buffers=tuple(
                MemoryRegion.from_pointer(remote.addr + i * self.buf_bytes, self.buf_bytes, item)
                for i in range(len(self.arrays))
            ),
        )
        self.backend = create_backend(self.config, "bench-raw-initiator")
        self.backend.register(list(self.layout.buffers))
        peer = self.backend.add_peer(self.agent.metadata())
        self.mapper = build_mapper(self.config, self.layout, dst)
        tables = self.mapper.build_tables()
        self.pair = self.backend.prepare(peer, tables.src, tables.dst)

    def warm_up(self, step: int) -> None:
        """Write every slot once, so the target's pages are touched before timing."""
        every = np.arange(self.slots, dtype=np.int64)
        for lo in range(0, self.slots, step):
            idx = self.mapper.map_chunk(every[lo : lo + step], every[lo : lo + step])
            _submit_all(self.backend, self.pair, [idx], 1, 1)

    def batch(
        self, pages: int, concurrency: int, n: int, advance: Advance
    ) -> tuple[Run, Check, list[str]]:
        """``n`` requests of ``pages`` random pages with ``concurrency`` in flight, then the
        target's pages checked against the source."""
        span = pages * concurrency
        # Fresh source bytes in the window, so stale target bytes cannot pass the check.
        salt = np.int32(self.rng.integers(1, 2**31 - 1))
        for arr in self.arrays:
            arr[:span] ^= salt
        src = self.rng.permutation(span).astype(np.int64)
        dst = self.rng.permutation(span).astype(np.int64)
        blocks = [
            self.mapper.map_chunk(
                src[b * pages : (b + 1) * pages], dst[b * pages : (b + 1) * pages]
            )
            for b in range(concurrency)
        ]
        t0 = time.perf_counter()
        lat, nbytes, ndesc = _submit_all(self.backend, self.pair, blocks, n, concurrency, advance)
        wall = time.perf_counter() - t0
        self.agent.notifications(timeout=0)  # drain the child's list
        item = self.layout.buffers[0].item_len
        want = []
        for arr in self.arrays:
            expected = np.empty_like(arr[:span])
            expected[dst] = arr[src]
            want.append(digest(expected))
        got = [
            self.agent.digest("kv", i * self.buf_bytes, span * item)
            for i in range(len(self.arrays))
        ]
        good = n if got == want else 0
        problems = [] if good else [f"raw pages={pages} C={concurrency}: target pages differ"]
        run = Run("raw", pages, concurrency, n, len(lat), nbytes, ndesc, wall, lat)
        check = Check("raw", pages, concurrency, n, good, "target pages digested after the batch")
        return run, check, problems

    def close(self) -> None:
        if self.backend is not None and not self.backend.closed:
            with contextlib.suppress(Exception):
                if self.pair is not None:
                    self.backend.release_prepared(self.pair)
            self.backend.close()
        self.agent.close()


def _submit_all(
    backend: Any,
    pair: Any,
    blocks: Sequence[tuple[Any, Any]],
    n: int,
    concurrency: int,
    advance: Advance | None = None,
) -> tuple[list[float], int, int]:
    """Submit ``n`` WRITEs keeping up to ``concurrency`` in flight; each uses the index arrays
    of a free block (so no two in-flight writes share a target page). Returns the latencies,
    the bytes and the descriptors of one request."""
    free = list(range(min(concurrency, len(blocks))))
    inflight: list[tuple[Any, int, float]] = []
    lat: list[float] = []
    nbytes = ndesc = submitted = 0
    while len(lat) < n:
        while free and submitted < n:
            b = free.pop()
            s_idx, d_idx = blocks[b]
            h = backend.submit(XferOp.WRITE, pair, s_idx, d_idx, b"bench-%d" % submitted)
            inflight.append((h, b, time.perf_counter()))
            submitted += 1
        backend.progress()
        finished = 0
        for entry in list(inflight):
            h, b, t0 = entry
            st = backend.poll(h)
            if st is XferState.PENDING:
                continue
            t1 = time.perf_counter()
            inflight.remove(entry)
            backend.release(h)
            if st is not XferState.DONE:
                raise BenchError(f"raw WRITE failed: {h.error or st.name}")
            lat.append(t1 - t0)
            nbytes += h.num_bytes
            ndesc = h.num_descs
            free.append(b)
            finished += 1
        if finished and advance is not None:
            advance(finished)
        if not finished:
            time.sleep(0.0001)
    return lat, nbytes, ndesc


# ------------------------------------------------------------------------------ driver
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


def _spec(config: KVWireConfig, plan: _Plan, *, sync: bool, verify: bool) -> ClusterSpec:
    control = config.control.model_copy(update={"sync_transfers": sync})
    return ClusterSpec(
        model=MODEL,
        slots=plan.slots,
        aux_slots=max(128, max(plan.concurrency)),
        config=config.model_copy(update={"control": control}),
        verify=verify,
    )


def _boot(stack: contextlib.ExitStack, specs: dict[str, ClusterSpec]) -> dict[str, Cluster]:
    """Start clusters at once (their rank processes import in parallel); each one that
    started is closed by ``stack``; any failure is raised once all have finished starting."""
    out: dict[str, Cluster] = {}
    with ThreadPoolExecutor(len(specs), thread_name_prefix="kvwire-bench-boot") as pool:
        futs: dict[str, Future[Cluster]] = {k: pool.submit(Cluster, s) for k, s in specs.items()}
    errors = []
    for key, fut in futs.items():
        exc = fut.exception()
        if exc is None:
            out[key] = stack.enter_context(fut.result())
        else:
            errors.append(exc)
    if errors:
        raise errors[0]
    return out


def measure(
    config: KVWireConfig,
    sizes: Sequence[int],
    concurrency: Sequence[int],
    requests: int,
    repeat: int = 1,
    progress: Progress | None = None,
) -> BenchReport:
    """Run every mode at every (size, concurrency); a failed check is reported, not raised;
    raises only when something cannot run at all."""
    plan = _Plan(sorted(set(sizes)), sorted(set(concurrency)), requests, repeat)
    if min(plan.sizes) < 1 or min(plan.concurrency) < 1 or requests < 1 or repeat < 1:
        raise BenchError("sizes, concurrency levels, --requests and --repeat must be >= 1")
    pools = POOLS * plan.slots * page_bytes()
    with contextlib.suppress(ValueError, OSError, AttributeError):
        mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if pools > mem // 2:
            raise BenchError(
                f"the KV pools would take up to {pools / 2**30:.1f} GiB ({POOLS} pools of "
                f"{plan.slots} pages of {page_bytes() >> 10} KiB) on a machine with "
                f"{mem / 2**30:.1f} GiB; use smaller --sizes or --concurrency"
            )
    task = progress.add_task("starting", total=plan.total_requests) if progress else None

    def advance(k: int) -> None:
        if progress is not None and task is not None:
            progress.advance(task, k)

    def stage(text: str) -> None:
        logger.info("%s", text)
        if progress is not None and task is not None:
            progress.update(task, description=text)

    machine = machine_info(config.transfer_backend)
    cmax, smax = max(plan.concurrency), max(plan.sizes)
    runs: dict[tuple[str, int, int], list[Run]] = {}
    checks: list[Check] = []
    problems: list[str] = []
    with contextlib.ExitStack() as stack:
        stage("starting clusters and the raw target")
        raw = RawBench(config, plan.slots)
        stack.callback(raw.close)
        raw.start()
        clusters = _boot(
            stack,
            {
                f"{mode}{'-verified' if verify else ''}": _spec(
                    config, plan, sync=mode == "sync", verify=verify
                )
                for mode in ("kvwire", "sync")
                for verify in (False, True)
            },
        )
        raw.open()
        for mode in ("kvwire", "sync"):
            stage(f"verified pass: {mode}")
            cl = clusters.pop(f"{mode}-verified")
            for pages in plan.sizes:
                n = plan.check_requests
                results = cl.run(
                    _plans(n, pages),
                    concurrency=cmax,
                    timeout_s=120 + 0.5 * n * pages,
                    on_result=lambda _r: advance(1),
                )
                problems += problems_of(f"{mode} (verified pass)", pages, cmax, results)
                good = sum(r.ok for r in results)
                checks.append(Check(mode, pages, cmax, n, good, "every element on decode"))
            cl.close()
        stage("warm-up")
        for mode in ("kvwire", "sync"):
            # Touch every page slot the batches will use, on both sides.
            warm = clusters[mode].run(_plans(cmax, smax), concurrency=cmax, timeout_s=300)
            problems += problems_of(f"{mode} (warm-up)", smax, cmax, warm)
            advance(cmax)
        raw.warm_up(smax)
        advance(cmax)
        for rep in range(plan.repeat):
            for pages in plan.sizes:
                for conc in plan.concurrency:
                    stage(f"round {rep + 1}/{plan.repeat}: {pages} pages x {conc} in flight")
                    n = plan.batch(conc)
                    order = MODES[rep % 3 :] + MODES[: rep % 3]
                    for mode in order:
                        if mode == "raw":
                            run, check, bad = raw.batch(pages, conc, n, advance)
                            checks.append(check)
                        else:
                            run, bad = cluster_batch(clusters[mode], mode, pages, conc, n, advance)
                        runs.setdefault((mode, pages, conc), []).append(run)
                        problems += bad
                        logger.info("%s pages=%d C=%d: %.3f GB/s", mode, pages, conc, run.gbps)
    order_of = {m: i for i, m in enumerate(MODES)}
    cells = sorted(
        (cell_of(r) for r in runs.values()),
        key=lambda c: (c.pages, c.concurrency, order_of[c.mode]),
    )
    setup = {
        "model": MODEL.model_dump(),
        "page_bytes": page_bytes(),
        "row_bytes": page_bytes() // (2 * MODEL.num_layers),
        "topology": "1 prefill rank -> 1 decode rank, TP 1, one chunk per request",
        "sizes_pages": plan.sizes,
        "concurrency": plan.concurrency,
        "requests_per_batch": {str(c): plan.batch(c) for c in plan.concurrency},
        "repeat": plan.repeat,
        "verified_pass_requests_per_size": plan.check_requests,
        "num_workers": config.control.num_workers,
        "config": config.model_dump(mode="json", exclude={"secret"}),
    }
    return BenchReport(
        backend=config.transfer_backend,
        cells=cells,
        checks=checks,
        ratios=ratios_of(cells),
        failures=problems,
        machine=machine,
        setup=setup,
    )


def plot(report: BenchReport, path: str | Path) -> None:
    """GB/s against concurrency, one panel per request size, a line per mode (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError(PLOT_HINT) from exc
    sizes = sorted({c.pages for c in report.cells})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.6), squeeze=False)
    labels = {"kvwire": "kvwire (async workers)", "raw": "raw backend", "sync": "kvwire sync"}
    for ax, pages in zip(axes[0], sizes, strict=True):
        for mode in MODES:
            pts = sorted(
                (c.concurrency, c.gbps) for c in report.cells if c.mode == mode and c.pages == pages
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=labels[mode])
        concs = sorted({c.concurrency for c in report.cells})
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.minorticks_off()
        unit = "page" if pages == 1 else "pages"
        ax.set_title(f"{pages} {unit} ({pages * page_bytes() / 2**20:g} MiB) per request")
        ax.set_xlabel("requests in flight")
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(
        f"kvwire bench: {report.backend}, {report.machine.get('cpu_count')} CPUs", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvwire bench`` (kvwire's own options are added by ``add_cli_args``)."""
    g = parser.add_argument_group("benchmark")
    g.add_argument(
        "--sizes",
        type=_int_list,
        metavar="N,N,..",
        help=f"pages per request ({page_bytes() >> 10} KiB each; "
        f"default {','.join(map(str, DEFAULT_SIZES))})",
    )
    g.add_argument(
        "--concurrency",
        type=_int_list,
        metavar="C,C,..",
        help=f"requests in flight (default {','.join(map(str, DEFAULT_CONCURRENCY))})",
    )
    g.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help=f"requests per batch, at least {MIN_WAVES} x concurrency (default {DEFAULT_REQUESTS})",
    )
    g.add_argument(
        "--repeat",
        type=int,
        metavar="R",
        help=f"batches per cell, modes interleaved; a cell's GB/s is its best batch "
        f"(default {DEFAULT_REPEAT})",
    )
    g.add_argument(
        "--quick",
        action="store_true",
        help="small run for tests and smoke checks (defaults become "
        f"--sizes {','.join(map(str, QUICK_SIZES))} "
        f"--concurrency {','.join(map(str, QUICK_CONCURRENCY))} --requests {QUICK_REQUESTS} "
        f"--repeat {QUICK_REPEAT})",
    )
    g.add_argument(
        "--engine",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="instead: the selected backend plugin's engine benchmark (kvwire's backend vs raw "
        "engine calls on the same descriptors, e.g. prepared vs one-shot submission); ARGS go "
        "to it (e.g. --engine --repeat 5)",
    )
    g.add_argument(
        "--compare-staging",
        action="store_true",
        help="instead: bulk staging vs the per-token path vs equal TP (TP 2->1 and 1->1; "
        "--sizes gives pages per request, --concurrency the levels)",
    )
    g.add_argument("--json", metavar="PATH", help="write every figure and the machine as JSON")
    g.add_argument("--plot", metavar="PATH.png", help="draw GB/s vs concurrency (matplotlib)")


def render(report: BenchReport) -> Table:
    """The short summary table."""
    m = report.machine
    done = sum(c.ok for c in report.cells)
    total = sum(c.requests for c in report.cells)
    good = sum(c.verified for c in report.checks)
    checked = sum(c.requests for c in report.checks)
    repeat = report.setup.get("repeat", 1)
    table = Table(
        title=f"kvwire bench: {report.backend}, 1 prefill -> 1 decode, {m.get('cpu_count')} CPUs",
        caption=f"{done}/{total} timed requests completed, {good}/{checked} checked requests "
        f"verified. GB/s: best of {repeat} batches (bytes / batch wall time); p50, p99: kvwire "
        "request latency (ms); C: requests in flight",
    )
    cols = ("MiB/req", "C", "kvwire GB/s", "raw GB/s", "kv/raw", "sync GB/s", "async/sync")
    for col in (*cols, "p50", "p99"):
        table.add_column(col.replace(" ", "\n"), justify="right")
    for r in report.ratios:
        kv = report.cell("kvwire", r.pages, r.concurrency)
        raw = report.cell("raw", r.pages, r.concurrency)
        sync = report.cell("sync", r.pages, r.concurrency)
        table.add_row(
            f"{kv.request_bytes / 2**20:g}",
            str(r.concurrency),
            f"{kv.gbps:.2f}",
            f"{raw.gbps:.2f}",
            f"{r.kvwire_vs_raw:.2f}",
            f"{sync.gbps:.2f}",
            f"{r.async_vs_sync:.2f}",
            f"{kv.p50_ms:.1f}",
            f"{kv.p99_ms:.1f}",
        )
    return table


def run(args: argparse.Namespace, console: Console, argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvwire bench``."""
    config = config_from_args(args)
    if config.transfer_backend == "auto":
        config = config.model_copy(update={"transfer_backend": auto_backend_name()})
    sizes = args.sizes or list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    conc = args.concurrency or list(QUICK_CONCURRENCY if args.quick else DEFAULT_CONCURRENCY)
    requests = args.requests or (QUICK_REQUESTS if args.quick else DEFAULT_REQUESTS)
    repeat = args.repeat or (QUICK_REPEAT if args.quick else DEFAULT_REPEAT)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        console.print(f"[red]error[/]: {escape(PLOT_HINT)}", highlight=False)
        return 1
    command = shlex.join(["kvwire", *(argv or [])])
    if args.engine is not None:
        from kvwire.plugins import get_registry

        name = config.transfer_backend
        try:
            bench = get_registry().engine_benchmark(name)
        except KVWireError as exc:
            console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
            return 1
        if bench is None:
            console.print(
                f"[red]error[/]: backend {name!r} registers no engine benchmark; for the tcp "
                "backend use `kvwire bench-backend`",
                highlight=False,
            )
            return 1
        return int(bench(list(args.engine)))
    if args.compare_staging:
        from kvwire.testing import staging_bench

        try:
            return staging_bench.run(args, config, console, command)
        except (ClusterError, KVWireError, RuntimeError) as exc:
            console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
            return 1
    t0 = time.monotonic()
    try:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            report = measure(config, sizes, conc, requests, repeat, progress)
    except (BenchError, ClusterError, KVWireError, RemoteAgentError) as exc:
        console.print(f"[red]error[/]: {type(exc).__name__}: {escape(str(exc))}", highlight=False)
        return 1
    report.command = command
    report.machine["duration_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.plot:
        try:
            plot(report, args.plot)
        except BenchError as exc:
            console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
            return 1
    for line in report.failures[:10]:
        console.print(f"[red]failed[/]: {escape(line)}", highlight=False)
    console.print(render(report))
    if not report.ok:
        console.print(
            f"[red]kvwire bench FAILED[/]: {len(report.failures)} problem(s); failed "
            "requests are left out of the figures",
            highlight=False,
        )
        return 1
    return 0
