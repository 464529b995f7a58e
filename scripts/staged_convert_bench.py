"""Page-size conversion and MLA on CPU host pools: per descriptor (before) vs staged (after),
interleaved in one run.

For each shape both clusters (real processes, the ``tcp`` backend on loopback, host pools)
are started side by side; each first moves a verified batch (every element checked on
decode), then timed batches alternate between them (before, after, before, after, ...), so
both see the same machine load. Shapes (the model of ``kvwire bench --compare-staging``: 8
layers x 8 KV heads x 64 int32 dims, prefill pages of 16 tokens):

* ``equal-2to2-16to32``: equal TP, decode pages of 32 tokens (whole rows by 16-token granules);
* ``gather-2to1-16to32``: TP 2 -> 1 with decode pages of 32 (head slices token by token);
* ``mla-2to1``, ``mla-1to2``: one latent row per token and layer (576 bytes: 144 int32).

Before = ``--staging direct`` (one descriptor per granule, page or token); after =
``--staging bulk`` with ``equal_tp=always`` (host pools: the default rule stages whole rows
only on GPU pools; head slices stage by default). Prints GB/s (best batch), p50 ms,
descriptors per request and the ratio after/before, and writes JSON with ``--json``.

    python3 scripts/staged_convert_bench.py --json docs/results/staged_convert_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster, ClusterSpec, RoomPlan
from kvwire.testing.pair import config

MHA = ModelSpec(num_layers=8, total_kv_heads=8, head_dim=64, dtype="int32", page_size=16)
MLA = ModelSpec(
    num_layers=8, total_kv_heads=1, head_dim=144, dtype="int32", page_size=16, is_mla=True
)
#: name -> (model, prefill TP, decode TP, decode page size)
SHAPES: dict[str, tuple[ModelSpec, int, int, int]] = {
    "equal-2to2-16to32": (MHA, 2, 2, 32),
    "gather-2to1-16to32": (MHA, 2, 1, 32),
    "mla-2to1": (MLA, 2, 1, 16),
    "mla-1to2": (MLA, 1, 2, 16),
}
STAGING = {"ring_bytes": 64 << 20, "buffer_bytes": 8 << 20, "block_bytes": 1 << 20}


def _plans(n: int, pages: int, verify: bool) -> list[RoomPlan]:
    half = pages // 2
    return [
        RoomPlan(
            room=secrets.randbits(62), num_pages=pages, chunks=[half, pages - half], verify=verify
        )
        for _ in range(n)
    ]


def _spec(shape: str, staged: bool) -> ClusterSpec:
    model, tp_p, tp_d, pd = SHAPES[shape]
    cfg = config(heartbeat_interval_s=1.0).model_copy(
        update={
            "staging": "bulk" if staged else "direct",
            "staging_options": {**STAGING, "equal_tp": "always"} if staged else {},
        }
    )
    return ClusterSpec(
        model=model,
        prefill_tp=tp_p,
        decode_tp=tp_d,
        slots=512,
        aux_slots=128,
        decode_page_size=pd if pd != model.page_size else None,
        config=cfg,
    )


def bench_shape(shape: str, pages: int, conc: int, requests: int, repeat: int) -> dict[str, Any]:
    """Both clusters of ``shape`` up at once; verified, then ``repeat`` interleaved batches."""
    out: dict[str, Any] = {"shape": shape, "pages": pages, "concurrency": conc}
    with Cluster(_spec(shape, False)) as before, Cluster(_spec(shape, True)) as after:
        clusters = {"before": before, "after": after}
        for name, c in clusters.items():
            check = c.run(_plans(4, pages, True), concurrency=4, timeout_s=600)
            bad = [r for r in check if not r.ok]
            if bad:
                raise SystemExit(f"{shape} {name}: verification failed: {bad[0].reports}")
        runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        for _ in range(repeat):
            for name, c in clusters.items():  # interleaved: before, after, before, ...
                t0 = time.perf_counter()
                res = c.run(_plans(requests, pages, False), concurrency=conc, timeout_s=600)
                wall = time.perf_counter() - t0
                moved = sum(r.bytes for r in res)
                runs[name].append(
                    {
                        "gbps": moved / wall / 1e9,
                        "p50_ms": statistics.median(r.latency_s * 1e3 for r in res),
                        "descs": statistics.mean(r.descriptors for r in res),
                        "mib": moved / len(res) / (1 << 20),
                        "ok": float(all(r.ok for r in res)),
                    }
                )
        for name, rs in runs.items():
            best = max(rs, key=lambda x: x["gbps"])
            out[name] = {
                "best_gbps": best["gbps"],
                "median_gbps": statistics.median(x["gbps"] for x in rs),
                "p50_ms": statistics.median(x["p50_ms"] for x in rs),
                "descs_per_request": rs[0]["descs"],
                "mib_per_request": rs[0]["mib"],
                "ok": all(x["ok"] for x in rs),
                "batches": rs,
            }
    out["ratio_best"] = out["after"]["best_gbps"] / out["before"]["best_gbps"]
    out["ratio_median"] = out["after"]["median_gbps"] / out["before"]["median_gbps"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--pages", type=int, default=16, help="prefill pages per request")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16, help="requests per timed batch")
    p.add_argument("--repeat", type=int, default=3, help="timed batches per mode, interleaved")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    command = " ".join(["scripts/staged_convert_bench.py", *(argv or sys.argv[1:])])
    report: dict[str, Any] = {
        "command": command,
        "machine": {"platform": platform.platform(), "node": platform.node()},
        "shapes": [],
    }
    print("| shape | MiB/req | before GB/s | descs/req | p50 ms | after GB/s | descs/req | "
          "p50 ms | after/before (best, median) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in a.shapes.split(","):
        r = bench_shape(shape, a.pages, a.concurrency, a.requests, a.repeat)
        report["shapes"].append(r)
        b, f = r["before"], r["after"]
        print(
            f"| {shape} | {b['mib_per_request']:.1f} | {b['best_gbps']:.3f} | "
            f"{b['descs_per_request']:.0f} | {b['p50_ms']:.0f} | {f['best_gbps']:.3f} | "
            f"{f['descs_per_request']:.0f} | {f['p50_ms']:.0f} | {r['ratio_best']:.2f}x, "
            f"{r['ratio_median']:.2f}x |",
            flush=True,
        )
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(s["before"]["ok"] and s["after"]["ok"] for s in report["shapes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
