"""HiSparse through kvwire end to end on a GPU: prefill KV in VRAM -> decode host pool.

One entry point, two phases, every cluster on loopback with one process per rank:

1. **correctness**: prefill buffers alternate between VRAM and pinned DRAM (``mixed_kinds``),
   decode has a host pool of page size 1; 24 HiSparse and regular requests, every element
   checked, once per path: ``mapped`` (the host pool is a SharedHostPool, prefill copies into
   it) and ``engine`` (a private pool the backend writes; core splits VRAM and DRAM rows into
   segments). Prints the path prefill chose for each link.
2. **throughput**: all prefill KV in VRAM, verification off, HiSparse requests only; GB/s per
   path at each concurrency, against a local pinned device-to-host copy of the same bytes made
   in the same process run (``torch`` ``copy_`` into a pinned tensor).

The ``mapped`` path runs once per copier of ``--copiers`` (the hisparse strategy's options):
``old`` = ``vram_path="index", batch_rows=0`` (the copier before session 14), ``new`` = the
defaults (fused run mover, batches of 16,384 rows, a prepared row table per link), so both are
measured in one call. ``--shape`` is the request shape: ``one`` (default) sends every page
in one last send, as engines do; ``split`` is the earlier random two-chunk split (``[cut,
p - cut]``, sometimes an empty first or last send), ``empty-last`` all pages then an empty
last send (which costs an acknowledged aux-row write; docs/benchmarks.md "The GPU benches'
request shape").

    python scripts/gpu_hisparse_cluster.py --backend nixl --json $OUT/hisparse_cluster.json
    python scripts/gpu_hisparse_cluster.py --device cpu --backend tcp --layers 4 --kv-heads 2 \
        --head-dim 64 --slots 64 --pages 8 --requests 4 --concurrency 1 --paths mapped
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.bench.gpu_engine import add_gil_args, gil_option, stage_medians
from kvwire.config import ControlOptions, KVWireConfig, PoolConfig
from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster, ClusterSpec, RoomPlan
from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty

PATHS = ("mapped", "engine")
#: ``mapped`` copiers: the hisparse strategy's staging options for each
COPIERS: dict[str, dict[str, Any]] = {
    "old": {"vram_path": "index", "batch_rows": 0},
    "new": {},
}
SHAPES = ("one", "split", "empty-last")


def _chunks(p: int, shape: str, rng: np.random.Generator) -> list[int]:
    if shape == "one":
        return [p]
    if shape == "empty-last":
        return [p, 0]
    cut = int(rng.integers(0, p + 1))
    return [cut, p - cut]


def _config(
    backend: str, path: str, copier: str, control: dict[str, Any] | None = None
) -> KVWireConfig:
    opts = dict(COPIERS[copier]) if path == "mapped" else {}
    return KVWireConfig(
        transfer_backend=backend,
        pools={"host": PoolConfig(staging_options=opts)},
        control=ControlOptions(**(control or {})),
    )


def _plans(
    n: int, pages: int, hisparse_every: int, verify: bool | None, shape: str = "split"
) -> list[RoomPlan]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        p = int(rng.integers(1, pages + 1)) if verify else pages
        out.append(
            RoomPlan(
                room=secrets.randbits(62),
                num_pages=p,
                chunks=_chunks(p, shape, rng),
                hisparse=i % hisparse_every == 0,
                verify=verify,
            )
        )
    return out


def correctness(backend: str, device: str, copiers: list[str], log: Any) -> list[dict[str, Any]]:
    model = ModelSpec(num_layers=4, total_kv_heads=4, head_dim=32, dtype="int32", page_size=8)
    out = []
    for path, copier in [("mapped", c) for c in copiers] + [("engine", "")]:
        spec = ClusterSpec(
            model=model,
            slots=64,
            aux_slots=64,
            device=device,
            mixed_kinds=device != "cpu",
            host_page_size=1,
            host_shared=path == "mapped",
            config=_config(backend, path, copier),
        )
        with Cluster(spec) as c:
            res = c.run(_plans(24, 6, 2, None), concurrency=8, timeout_s=240)
            assert_all_ok(res)
            assert_tables_empty(c)
            paths = c.host_paths()
        chosen = sorted({v for p in paths.values() for v in p.values()})
        log(f"correctness {path} {copier}: {len(res)} requests verified; prefill chose {chosen}")
        assert chosen == [path], (path, paths)
        out.append(
            {"path": path, "copier": copier, "requests": len(res), "ok": True, "chosen": chosen}
        )
    return out


def local_copy_gbps(nbytes: int, repeat: int = 5) -> float:
    """Best GB/s of a pinned device-to-host copy of ``nbytes`` in this process."""
    import torch

    src = torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, device="cuda")
    dst = torch.empty(nbytes // 4, dtype=torch.int32, pin_memory=True)
    best = 0.0
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    assert torch.equal(dst[:1024], src[:1024].cpu())
    return best


def throughput(a: argparse.Namespace, log: Any) -> list[dict[str, Any]]:
    model = ModelSpec(
        num_layers=a.layers,
        total_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        dtype="int32",
        page_size=a.page_size,
    )
    cells = []
    runs = [("mapped", c) for c in a.copiers if "mapped" in a.paths]
    runs += [("engine", "")] if "engine" in a.paths else []
    for path, copier in runs:
        spec = ClusterSpec(
            model=model,
            slots=a.slots,
            aux_slots=256,
            device=a.device,
            host_page_size=1,
            host_shared=path == "mapped",
            verify=False,
            engine_step_s=a.engine_step,
            config=_config(a.backend, path, copier, gil_option(a)),
        )
        with Cluster(spec) as c:
            warm = _plans(4, a.pages, 1, False, a.shape)
            c.run(warm, concurrency=2, timeout_s=a.timeout)
            for conc in a.concurrency:
                res = c.run(
                    _plans(a.requests, a.pages, 1, False, a.shape),
                    concurrency=conc,
                    timeout_s=a.timeout,
                )
                bad = [r for r in res if any(x.status != 4 for x in r.reports)]
                t0 = min(r.t_start for r in res)
                t1 = max(r.t_end for r in res)
                nbytes = sum(r.bytes for r in res)
                gbps = nbytes / (t1 - t0) / 1e9
                lat = sorted(r.latency_s for r in res)
                cell = {
                    "path": path,
                    "copier": copier,
                    "shape": a.shape,
                    "concurrency": conc,
                    "requests": len(res),
                    "failed": len(bad),
                    "bytes_per_request": nbytes // max(1, len(res)),
                    "gbps": round(gbps, 2),
                    "p50_ms": round(1e3 * lat[len(lat) // 2], 2),
                    "stages_ms": stage_medians(res),
                }
                log(f"throughput {cell}")
                cells.append(cell)
    return cells


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="nixl")
    p.add_argument("--device", default="cuda", help="'cuda', or 'cpu' for a smoke run")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--slots", type=int, default=256, help="prefill page slots per buffer")
    p.add_argument("--pages", type=int, default=64, help="pages per HiSparse request")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--timeout", type=float, default=240.0)
    add_gil_args(p)
    p.add_argument(
        "--engine-step",
        type=float,
        default=0.0002,
        help="the rank processes' engine step in seconds (the GPU benches' 0.2 ms; before "
        "session 34 this bench ran the harness's default, 1 ms)",
    )
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--paths", type=lambda s: [x for x in s.split(",") if x], default=list(PATHS))
    p.add_argument(
        "--copiers",
        type=lambda s: [x for x in s.split(",") if x],
        default=["old", "new"],
        help="mapped-path copiers to compare: old (index kernels, one batch), new (defaults)",
    )
    p.add_argument("--shape", choices=SHAPES, default="one", help="request shape (module doc)")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    if any(x not in PATHS for x in a.paths) or any(x not in COPIERS for x in a.copiers):
        p.error(f"--paths takes {PATHS}, --copiers {sorted(COPIERS)}")

    def log(line: str) -> None:
        print(line, flush=True)

    command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    report: dict[str, Any] = {"command": command, "backend": a.backend}
    if not a.skip_correctness:
        report["correctness"] = correctness(a.backend, a.device, a.copiers, log)
    cells = throughput(a, log)
    per_req = max(c["bytes_per_request"] for c in cells)
    local = local_copy_gbps(per_req) if a.device != "cpu" else float("nan")
    report["local_d2h_gbps"] = round(local, 2)
    report["throughput"] = cells
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nlocal pinned D2H copy of {per_req / 2**20:.0f} MiB: {local:.1f} GB/s")
    print(
        f"{'path':>8} {'copier':>6} {'C':>3} {'GB/s':>7} {'x local':>8} {'p50 ms':>8} "
        f"{'failed':>6}  (shape {a.shape})"
    )
    for c in cells:
        print(
            f"{c['path']:>8} {c['copier'] or '-':>6} {c['concurrency']:>3} {c['gbps']:>7.2f} "
            f"{c['gbps'] / local:>8.2f} {c['p50_ms']:>8.1f} {c['failed']:>6}"
        )
    for c in cells:
        if c["path"] == "mapped" and c["copier"] != cells[0]["copier"]:
            b = next(
                x
                for x in cells
                if x["copier"] == cells[0]["copier"] and x["concurrency"] == c["concurrency"]
            )
            print(
                f"mapped {c['copier']}/{b['copier']} at C={c['concurrency']}: "
                f"{c['gbps'] / b['gbps']:.2f}x GB/s, p50 {c['p50_ms']:.1f} vs {b['p50_ms']:.1f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
