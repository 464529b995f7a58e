"""``kvwire bench --fanout N``: one prefill rank feeding ``N`` decode instances under load.

Two clusters of 1 prefill rank and ``N`` decode instances (TP 1 each): async transfer workers
(the default) and the synchronous mode (``sync_transfers=True``: each transfer runs on the
engine's thread inside ``send()``). Requests go round-robin to the decode instances with
``concurrency`` in flight (64 by default). The figure that matters is the mean request latency
seen on decode (the change this mirrors in SGLang measured 4x lower mean transfer latency with
async workers), with GB/s beside it.

Before timing, each cluster moves ``2 x N`` requests per size with every element checked.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

from kvwire.bench.cluster import boot, cluster_spec
from kvwire.bench.common import (
    MODEL,
    Advance,
    BenchError,
    Cell,
    Check,
    Run,
    cell_of,
    cluster_batch,
    memory_guard,
    page_bytes,
    requests_for,
    verified_pass,
)
from kvwire.config import KVWireConfig
from kvwire.layout import ModelSpec

logger = logging.getLogger(__name__)

#: Mode names of the fan-out cells (kept apart from the 1 -> 1 cells of the same run).
FANOUT_MODES = ("fanout-kvwire", "fanout-sync")
DEFAULT_FANOUT_CONCURRENCY = 64
DEFAULT_FANOUT_SIZES = (1,)


def fanout_requests(
    sizes: Sequence[int], concurrency: int, decode_instances: int, requests: int, repeat: int
) -> int:
    """Every request :func:`measure_fanout` makes (for the progress bar)."""
    timed = len(sizes) * requests_for(requests, concurrency) * repeat
    checked = len(sizes) * 2 * decode_instances + concurrency
    return len(FANOUT_MODES) * (timed + checked)


def measure_fanout(
    config: KVWireConfig,
    sizes: Sequence[int],
    concurrency: int,
    decode_instances: int,
    requests: int,
    repeat: int,
    advance: Advance,
    stage: Callable[[str], None],
    model: ModelSpec = MODEL,
) -> tuple[list[Cell], list[Check], list[str]]:
    """The fan-out cells (one per mode and size), the checks and the problems found."""
    if decode_instances < 1 or concurrency < 1 or not sizes or min(sizes) < 1:
        raise BenchError("--fanout, --fanout-concurrency and --fanout-sizes must be >= 1")
    smax = max(sizes)
    slots = smax * (concurrency + 2)
    pb = page_bytes(model)
    memory_guard(
        slots * pb,
        2 * (1 + decode_instances),
        f"{slots} pages of {pb >> 10} KiB: 2 clusters x (1 prefill + {decode_instances} decode)",
    )
    n = requests_for(requests, concurrency)
    runs: dict[tuple[str, int], list[Run]] = {}
    checks: list[Check] = []
    problems: list[str] = []
    with contextlib.ExitStack() as stack:
        stage(f"fan-out: starting 1 prefill -> {decode_instances} decode clusters")
        clusters = boot(
            stack,
            {
                mode: cluster_spec(
                    config,
                    model,
                    slots,
                    concurrency,
                    sync=mode == "fanout-sync",
                    decode_instances=decode_instances,
                )
                for mode in FANOUT_MODES
            },
        )
        for mode in FANOUT_MODES:
            stage(f"fan-out: verified pass ({mode})")
            cl = clusters[mode]
            for pages in sizes:
                check, bad = verified_pass(
                    cl, mode, pages, concurrency, 2 * decode_instances, advance, decode_instances
                )
                checks.append(check)
                problems += bad
            _, bad = cluster_batch(
                cl, mode, smax, concurrency, concurrency, advance, decode_instances
            )
            problems += [f"(warm-up) {b}" for b in bad]
        for rep in range(repeat):
            for pages in sizes:
                stage(f"fan-out round {rep + 1}/{repeat}: {pages} pages x {concurrency} in flight")
                order = FANOUT_MODES if rep % 2 == 0 else FANOUT_MODES[::-1]
                for mode in order:
                    run, bad = cluster_batch(
                        clusters[mode], mode, pages, concurrency, n, advance, decode_instances
                    )
                    runs.setdefault((mode, pages), []).append(run)
                    problems += bad
                    logger.info("%s pages=%d C=%d: %.3f GB/s", mode, pages, concurrency, run.gbps)
    cells = [cell_of(runs[(mode, pages)]) for pages in sizes for mode in FANOUT_MODES]
    return cells, checks, problems


def sync_vs_async(cells: Sequence[Cell], pages: int) -> tuple[float, float]:
    """For one size: (sync mean latency / async mean latency, async GB/s / sync GB/s)."""
    by = {c.mode: c for c in cells if c.pages == pages}
    a, s = by["fanout-kvwire"], by["fanout-sync"]
    a_mean = a.decode_mean_ms or a.mean_ms
    s_mean = s.decode_mean_ms or s.mean_ms
    return (s_mean / a_mean if a_mean else 0.0, a.gbps / s.gbps if s.gbps else 0.0)
