"""``kvwire bench --compare-staging``: bulk staging vs the per-token path vs equal TP.

One run, one backend, the same model and request sizes, three clusters on loopback:

* ``per-token``: prefill TP 2 -> decode TP 1 with ``--staging direct`` (one descriptor per
  layer, K/V, page and token: the head-slice path);
* ``bulk``: the same TP pair with ``--staging bulk`` (one gathered block per chunk);
* ``equal-tp``: prefill TP 1 -> decode TP 1 (whole pages: what heterogeneous TP should approach).

Each mode first moves a verified batch (every element checked on decode), then timed batches at
each concurrency level without per-element checks (the check costs more CPU than the transfer
on a small machine). Figures: GB/s (bytes moved / wall time of the batch), p50 latency,
descriptors per request, and the ratios bulk/per-token and bulk/equal-TP.
"""

from __future__ import annotations

import argparse
import json
import platform
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvwire.config import KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster, ClusterSpec, RequestResult, RoomPlan

MODEL = ModelSpec(num_layers=8, total_kv_heads=8, head_dim=64, dtype="int32", page_size=16)
MODES = {"per-token": (2, "direct"), "bulk": (2, "bulk"), "equal-tp": (1, "direct")}


@dataclass
class StagingCell:
    """One (mode, concurrency) figure."""

    mode: str
    concurrency: int
    requests: int
    bytes: int
    wall_s: float
    gbps: float
    p50_ms: float
    p99_ms: float
    descs_per_request: float
    ok: bool


def _plans(n: int, pages: int, chunks: int, verify: bool) -> list[RoomPlan]:
    per = [pages // chunks + (1 if i < pages % chunks else 0) for i in range(chunks)]
    return [
        RoomPlan(room=secrets.randbits(63), num_pages=pages, chunks=per, verify=verify)
        for _ in range(n)
    ]


def _cell(mode: str, c: int, results: list[RequestResult], wall: float) -> StagingCell:
    moved = sum(r.bytes for r in results)
    lat = [r.latency_s * 1e3 for r in results]
    return StagingCell(
        mode,
        c,
        len(results),
        moved,
        wall,
        moved / wall / 1e9 if wall > 0 else 0.0,
        float(np.percentile(lat, 50)),
        float(np.percentile(lat, 99)),
        float(np.mean([r.descriptors for r in results])),
        all(r.ok for r in results),
    )


def compare(
    config: KVWireConfig,
    concurrency: list[int],
    pages: int,
    chunks: int,
    requests: int,
    staging_options: dict[str, Any],
    progress: Callable[[str], None] | None = None,
    *,
    model: ModelSpec = MODEL,
    device: str = "cpu",
    modes: Sequence[str] = tuple(MODES),
    timeout_s: float = 600.0,
) -> list[StagingCell]:
    """Run each mode's cluster (KV pools on ``device``); one cell per (mode, concurrency).
    ``progress`` gets a line per finished step."""
    cells = []
    slots = max(256, 2 * max(concurrency) * pages + 16)
    say = progress or (lambda line: None)
    for mode in modes:
        tp, staging = MODES[mode]
        cfg = config.model_copy(
            update={
                "staging": staging,
                "staging_options": staging_options if staging == "bulk" else {},
            }
        )
        spec = ClusterSpec(
            model=model,
            prefill_tp=tp,
            decode_tp=1,
            slots=slots,
            aux_slots=256,
            device=device,
            config=cfg,
        )
        with Cluster(spec) as cluster:
            check = cluster.run(_plans(8, pages, chunks, True), concurrency=8, timeout_s=timeout_s)
            if not all(r.ok for r in check):
                bad = next(r for r in check if not r.ok)
                raise RuntimeError(f"{mode}: verification failed: {bad.reports}")
            say(f"[{mode}] 8 requests verified")
            for c in concurrency:
                n = max(requests, 2 * c)
                t0 = time.perf_counter()
                results = cluster.run(
                    _plans(n, pages, chunks, False), concurrency=c, timeout_s=timeout_s
                )
                cell = _cell(mode, c, results, time.perf_counter() - t0)
                cells.append(cell)
                say(
                    f"[{mode}] C={c}: {cell.gbps:.3f} GB/s, p50 {cell.p50_ms:.1f} ms, "
                    f"{cell.descs_per_request:.0f} descriptors/request, ok={cell.ok}"
                )
    return cells


def rows(cells: list[StagingCell]) -> list[tuple[str, ...]]:
    """Per concurrency: each mode as "GB/s (p50 ms, descriptors)" and the two ratios."""
    out: list[tuple[str, ...]] = []
    for c in sorted({x.concurrency for x in cells}):
        by = {x.mode: x for x in cells if x.concurrency == c}

        def fmt(m: str, by: dict[str, StagingCell] = by) -> str:
            x = by.get(m)
            return (
                "-" if x is None else f"{x.gbps:.3f} ({x.p50_ms:.0f} ms, {x.descs_per_request:.0f})"
            )

        def ratio(a: str, b: str, by: dict[str, StagingCell] = by) -> str:
            if a not in by or b not in by or by[b].gbps == 0:
                return "-"
            return f"{by[a].gbps / by[b].gbps:.2f}x"

        out.append(
            (
                str(c),
                fmt("per-token"),
                fmt("bulk"),
                fmt("equal-tp"),
                ratio("bulk", "per-token"),
                ratio("bulk", "equal-tp"),
            )
        )
    return out


COLUMNS = ("C", "per-token", "bulk", "equal-tp", "bulk/per-token", "bulk/equal-tp")


def render(cells: list[StagingCell]) -> Table:
    """Per concurrency: GB/s of each mode and the ratios."""
    t = Table(title="bulk staging vs per-token vs equal TP (GB/s, p50 ms, descriptors/request)")
    for col in COLUMNS:
        t.add_column(col, justify="right")
    for row in rows(cells):
        t.add_row(*row)
    return t


def run(args: argparse.Namespace, config: KVWireConfig, console: Console, command: str) -> int:
    """``kvwire bench --compare-staging``."""
    conc = args.concurrency or ([1, 4] if args.quick else [1, 8, 32])
    requests = args.requests or (8 if args.quick else 64)
    pages = (args.sizes or [4 if args.quick else 16])[0]
    opts = dict(config.staging_options) or {"ring_bytes": 64 << 20, "buffer_bytes": 8 << 20}
    t0 = time.monotonic()
    with console.status("running per-token, bulk and equal-TP clusters") as status:
        cells = compare(config, conc, pages, 2, requests, opts, status.update)
    table = render(cells)
    ok = all(x.ok for x in cells)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": command,
                    "backend": config.transfer_backend,
                    "model": MODEL.model_dump(),
                    "pages_per_request": pages,
                    "staging_options": opts,
                    "machine": {
                        "platform": platform.platform(),
                        "python": platform.python_version(),
                    },
                    "duration_s": round(time.monotonic() - t0, 1),
                    "cells": [asdict(x) for x in cells],
                },
                indent=2,
            )
            + "\n"
        )
    console.print(table)
    return 0 if ok else 1
