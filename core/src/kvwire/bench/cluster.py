"""``kvwire bench``: kvwire end to end against the backend's raw transfers, and async vs sync.

One run measures three ways of moving the same requests (one prefill rank -> one decode rank,
equal TP, each request one chunk of ``pages`` random page slots of ``--page-kib`` KiB), at
every request size and concurrency level asked for:

``kvwire``
    A :class:`~kvwire.testing.cluster.Cluster` (real prefill and decode rank processes, each
    running a :class:`~kvwire.session.KVManager` with its transfer workers); the parent keeps
    ``concurrency`` requests in flight. GB/s is the bytes kvwire moved over the wall time of
    the batch. Latency: decode-side, from the decode engine's first call for the request to
    its poll seeing Success (the engine API's latency, control round trip included); the
    parent's start-to-reports latency is kept too (it adds the harness pipes).
``sync``
    The same cluster workload with ``sync_transfers=True``: each transfer runs on the engine's
    thread inside ``send()`` (the single-thread baseline).
``raw``
    The backend alone (:mod:`kvwire.bench.raw`): the same descriptors, mapped by the
    same mapper, WRITE from this process into a spawned target, ``concurrency`` in flight.

All three are up at once and each (size, concurrency) is measured mode after mode, ``repeat``
times (the order rotating), so the ratios ``kvwire / raw`` and ``kvwire / sync`` compare
batches run seconds apart; a cell's GB/s is its best batch.

With ``--fanout N`` the run ends with a second table (:mod:`kvwire.bench.fanout`):
1 prefill rank -> ``N`` decode instances at ``--fanout-concurrency`` in flight, async workers vs
the synchronous mode.

Correctness is checked without charging the check to the timings: timed requests skip the
per-request fill and check (every request's aux row is still checked), and before timing, each
cluster moves requests of every size at the highest concurrency with every element filled on
prefill and checked on decode. Every raw batch is checked afterwards by digesting the target's
pages. Any failure fails the run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.progress import Progress

from kvwire.bench.common import (
    MODEL,
    BenchError,
    Cell,
    Check,
    Ratio,
    Run,
    cell_of,
    cluster_batch,
    machine_info,
    memory_guard,
    page_bytes,
    problems_of,
    ratios_of,
    requests_for,
    run_of,
    verified_pass,
)
from kvwire.bench.raw import RawBench
from kvwire.config import KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster, ClusterSpec

__all__ = [
    "MODES",
    "BenchError",
    "BenchReport",
    "Cell",
    "Check",
    "Ratio",
    "Run",
    "cell_of",
    "measure",
    "page_bytes",
    "problems_of",
    "ratios_of",
    "requests_for",
    "run_of",
]

logger = logging.getLogger(__name__)

MODES = ("kvwire", "sync", "raw")
#: KV pools of ``slots`` pages alive at once: 2 clusters x 2 ranks, the raw source and target.
POOLS = 6
#: The rank processes' engine loop period while requests are in flight (a scheduler step).
ENGINE_STEP_S = 0.0001


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
    #: ``--fanout``: cells of modes ``fanout-kvwire`` and ``fanout-sync``.
    fanout: list[Cell] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every timed request completed, every checked request verified, in every mode."""
        cells = [*self.cells, *self.fanout]
        return (
            not self.failures
            and all(c.failed == 0 and c.ok == c.requests for c in cells)
            and all(c.verified == c.requests for c in self.checks)
            and {c.mode for c in self.checks} >= {c.mode for c in cells}
        )

    def cell(self, mode: str, pages: int, concurrency: int) -> Cell:
        """The cell of a mode at a size and concurrency."""
        for c in [*self.cells, *self.fanout]:
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
            "fanout": [asdict(c) for c in self.fanout],
            "failures": self.failures,
        }


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


def cluster_spec(
    config: KVWireConfig,
    model: ModelSpec,
    slots: int,
    concurrency: int,
    *,
    sync: bool,
    decode_instances: int = 1,
) -> ClusterSpec:
    """A benchmark cluster: no per-request fill and check unless a plan asks for it."""
    control = config.control.model_copy(update={"sync_transfers": sync})
    return ClusterSpec(
        model=model,
        slots=slots,
        aux_slots=max(128, concurrency + 8),
        config=config.model_copy(update={"control": control}),
        verify=False,
        decode_instances=decode_instances,
        engine_step_s=ENGINE_STEP_S,
    )


def boot(stack: contextlib.ExitStack, specs: dict[str, ClusterSpec]) -> dict[str, Cluster]:
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
    model: ModelSpec = MODEL,
    extra_requests: int = 0,
) -> BenchReport:
    """Run every mode at every (size, concurrency); a failed check is reported, not raised;
    raises only when something cannot run at all. ``extra_requests``: more work the caller
    will report on the same progress bar (``--fanout``)."""
    plan = _Plan(sorted(set(sizes)), sorted(set(concurrency)), requests, repeat)
    if min(plan.sizes) < 1 or min(plan.concurrency) < 1 or requests < 1 or repeat < 1:
        raise BenchError("sizes, concurrency levels, --requests and --repeat must be >= 1")
    pb = page_bytes(model)
    memory_guard(
        plan.slots * pb,
        POOLS,
        f"{plan.slots} pages of {pb >> 10} KiB each: 2 clusters x 2 ranks, raw source and target",
    )
    task = (
        progress.add_task("starting", total=plan.total_requests + extra_requests)
        if progress
        else None
    )

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
        raw = RawBench(config, plan.slots, model)
        stack.callback(raw.close)
        raw.start()
        clusters = boot(
            stack,
            {
                mode: cluster_spec(config, model, plan.slots, cmax, sync=mode == "sync")
                for mode in ("kvwire", "sync")
            },
        )
        raw.open()
        for mode in ("kvwire", "sync"):
            stage(f"verified pass: {mode}")
            for pages in plan.sizes:
                check, bad = verified_pass(
                    clusters[mode], mode, pages, cmax, plan.check_requests, advance
                )
                checks.append(check)
                problems += bad
        stage("warm-up")
        for mode in ("kvwire", "sync"):
            # Touch every page slot the batches will use, on both sides.
            run, bad = cluster_batch(clusters[mode], mode, smax, cmax, cmax, advance)
            problems += [f"(warm-up) {b}" for b in bad]
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
        "model": model.model_dump(),
        "page_bytes": pb,
        "row_bytes": pb // (2 * model.num_layers),
        "topology": "1 prefill rank -> 1 decode rank, TP 1, one chunk per request",
        "sizes_pages": plan.sizes,
        "sizes_mib": [p * pb / 2**20 for p in plan.sizes],
        "concurrency": plan.concurrency,
        "requests_per_batch": {str(c): plan.batch(c) for c in plan.concurrency},
        "repeat": plan.repeat,
        "verified_pass_requests_per_size": plan.check_requests,
        "engine_step_s": ENGINE_STEP_S,
        "num_workers": config.control.num_workers,  # None: the backend's number
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
