"""Bulk staging vs the per-token path vs equal TP, with every KV pool on one device.

The loop of :func:`kvwire.testing.staging_bench.compare`, with the cluster's ``device`` and the
model chosen here, and no ``rich``: three clusters on loopback, one after another

* ``per-token``: prefill TP 2 -> decode TP 1, ``staging=direct`` (one descriptor per layer,
  K/V, page and token);
* ``bulk``: the same pair, ``staging=bulk``;
* ``equal-tp``: prefill TP 1 -> decode TP 1 (whole pages).

Each mode moves one verified batch first (every element checked on decode), then timed batches
at each concurrency. With ``--device cuda`` every rank's pool is on the current CUDA device (all
ranks share one GPU). Prints a plain table last and writes every figure to ``--json``.

    python scripts/gpu_staging_bench.py --device cuda --concurrency 1,8,32 --pages 16 \
        --requests 64 --json $OUT/staging.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.config import KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster, ClusterSpec, RequestResult, RoomPlan

MODES = {"per-token": (2, "direct"), "bulk": (2, "bulk"), "equal-tp": (1, "direct")}


@dataclass
class Cell:
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


def _cell(mode: str, c: int, results: list[RequestResult], wall: float) -> Cell:
    moved = sum(r.bytes for r in results)
    lat = [r.latency_s * 1e3 for r in results]
    return Cell(
        mode=mode,
        concurrency=c,
        requests=len(results),
        bytes=moved,
        wall_s=wall,
        gbps=moved / wall / 1e9 if wall > 0 else 0.0,
        p50_ms=float(np.percentile(lat, 50)),
        p99_ms=float(np.percentile(lat, 99)),
        descs_per_request=float(np.mean([r.descriptors for r in results])),
        ok=all(r.ok for r in results),
    )


def compare(
    config: KVWireConfig,
    model: ModelSpec,
    device: str,
    concurrency: list[int],
    pages: int,
    chunks: int,
    requests: int,
    staging_options: dict[str, Any],
    modes: list[str],
    timeout_s: float,
) -> tuple[list[Cell], dict[str, Any]]:
    """Every mode; one cell per (mode, concurrency), and per-mode timings."""
    cells: list[Cell] = []
    info: dict[str, Any] = {}
    slots = max(256, 2 * max(concurrency) * pages + 16)
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
        t0 = time.perf_counter()
        with Cluster(spec) as cluster:
            t_up = time.perf_counter() - t0
            t1 = time.perf_counter()
            check = cluster.run(_plans(8, pages, chunks, True), concurrency=8, timeout_s=timeout_s)
            t_check = time.perf_counter() - t1
            if not all(r.ok for r in check):
                bad = next(r for r in check if not r.ok)
                raise RuntimeError(f"{mode}: verification failed: {bad.reports}")
            print(f"[{mode}] up {t_up:.1f}s, verified 8 requests in {t_check:.1f}s", flush=True)
            for c in concurrency:
                n = max(requests, 2 * c)
                plans = _plans(n, pages, chunks, False)
                t2 = time.perf_counter()
                results = cluster.run(plans, concurrency=c, timeout_s=timeout_s)
                cell = _cell(mode, c, results, time.perf_counter() - t2)
                cells.append(cell)
                print(
                    f"[{mode}] C={c}: {cell.gbps:.3f} GB/s, p50 {cell.p50_ms:.1f} ms, "
                    f"{cell.descs_per_request:.0f} descs/request, ok={cell.ok}",
                    flush=True,
                )
        info[mode] = {
            "startup_s": round(t_up, 2),
            "verify_s": round(t_check, 2),
            "total_s": round(time.perf_counter() - t0, 2),
        }
    return cells, info


def table(cells: list[Cell]) -> str:
    """Per concurrency: GB/s of each mode and the ratios bulk/per-token and bulk/equal-tp."""
    cols = ("C", "per-token", "bulk", "equal-tp", "bulk/per-token", "bulk/equal-tp")
    rows = [cols]
    for c in sorted({x.concurrency for x in cells}):
        by = {x.mode: x for x in cells if x.concurrency == c}

        def fmt(m: str, by: dict[str, Cell] = by) -> str:
            x = by.get(m)
            if x is None:
                return "-"
            return f"{x.gbps:.3f} ({x.p50_ms:.0f} ms, {x.descs_per_request:.0f})"

        def ratio(a: str, b: str, by: dict[str, Cell] = by) -> str:
            if a not in by or b not in by or by[b].gbps == 0:
                return "-"
            return f"{by[a].gbps / by[b].gbps:.2f}x"

        rows.append(
            (
                str(c),
                fmt("per-token"),
                fmt("bulk"),
                fmt("equal-tp"),
                ratio("bulk", "per-token"),
                ratio("bulk", "equal-tp"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    head = "GB/s per mode (p50 ms, descriptors/request); bulk/per-token and bulk/equal-tp ratios"
    return head + "\n" + "\n".join(lines)


def _machine(device: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        import torch

        out["torch"] = torch.__version__
        if device != "cpu" and torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
            out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        for dist in ("nixl-cu13", "nixl-cu12", "kvwire", "kvwire-nixl"):
            try:
                out[dist] = version(dist)
            except Exception:
                continue
    except ImportError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="'cuda' or 'cpu' (where the KV pools live)")
    p.add_argument("--backend", default="nixl", help="kvwire transfer backend")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    p.add_argument("--pages", type=int, default=16, help="pages per request")
    p.add_argument("--chunks", type=int, default=2, help="chunked-prefill chunks per request")
    p.add_argument("--requests", type=int, default=64, help="requests per timed batch (>= 2C)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--ring-mib", type=int, default=256, help="bulk ring_bytes in MiB")
    p.add_argument("--buffer-mib", type=int, default=32, help="bulk buffer_bytes in MiB")
    p.add_argument("--block-kib", type=int, default=0, help="bulk block_bytes in KiB (0: default)")
    p.add_argument("--modes", default=",".join(MODES), help="subset of " + ",".join(MODES))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per batch")
    p.add_argument("--json", default="", help="write every figure here")
    a = p.parse_args(argv)

    conc = [int(x) for x in a.concurrency.split(",") if x]
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}")
    model = ModelSpec(
        num_layers=a.layers,
        total_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        dtype="int32",
        page_size=a.page_size,
    )
    opts = {"ring_bytes": a.ring_mib << 20, "buffer_bytes": a.buffer_mib << 20}
    if a.block_kib:
        opts["block_bytes"] = a.block_kib << 10
    config = KVWireConfig(transfer_backend=a.backend)
    command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    print(f"model {model.model_dump()}; staging {opts}; backend {a.backend}", flush=True)
    t0 = time.monotonic()
    cells, info = compare(
        config, model, a.device, conc, a.pages, a.chunks, a.requests, opts, modes, a.timeout
    )
    ok = all(x.ok for x in cells)
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "command": command,
                    "device": a.device,
                    "backend": a.backend,
                    "model": model.model_dump(),
                    "pages_per_request": a.pages,
                    "chunks_per_request": a.chunks,
                    "staging_options": opts,
                    "env": {
                        k: os.environ[k]
                        for k in ("UCX_MODULES", "UCX_TLS", "NCCL_NVLS_ENABLE")
                        if k in os.environ
                    },
                    "machine": _machine(a.device),
                    "modes": info,
                    "duration_s": round(time.monotonic() - t0, 1),
                    "cells": [asdict(x) for x in cells],
                },
                indent=2,
            )
            + "\n"
        )
    print(table(cells), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
