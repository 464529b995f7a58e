"""Bulk staging vs the per-token path vs equal TP, with every KV pool on one device.

:func:`kvwire.bench.staging.compare` with the pools' ``device`` and the model chosen
here, printed without ``rich``: three clusters on loopback, one after another

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
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvwire.bench.staging import COLUMNS, MODES, StagingCell, compare, rows
from kvwire.config import KVWireConfig
from kvwire.layout import ModelSpec


def table(cells: list[StagingCell]) -> str:
    """The comparison as plain text (no ``rich`` on the lent machine)."""
    body = [COLUMNS, *rows(cells)]
    widths = [max(len(r[i]) for r in body) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "GB/s per mode (p50 ms, descriptors/request) and ratios\n" + "\n".join(lines)


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
    cells = compare(
        config,
        conc,
        a.pages,
        a.chunks,
        a.requests,
        opts,
        lambda line: print(line, flush=True),
        model=model,
        device=a.device,
        modes=modes,
        timeout_s=a.timeout,
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
