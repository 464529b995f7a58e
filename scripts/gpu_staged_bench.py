"""Equal-TP KV moves over NIXL, staged through bulk staging vs per page, on two GPUs, one run.

Prefill on GPU 0, decode on GPU 1 (one process each), the model of issue 27 (a page is 2 MiB
in 64 runs of 32 KiB). Phases, every one on fresh data with the destination poisoned first:

1. **mover** (:mod:`kvwire.bench.gpu_mover`): the fused mover checked byte by byte (every
   element width, into GPU 0 and GPU 1, first and direct launches), then timed against a torch
   peer copy of as many contiguous bytes, with its host cost split: planning, the old launch
   (table uploaded from freshly pinned memory, Triton's launcher) and the new one (table in a
   pinned slot the kernel reads, compiled kernel launched directly), side by side.
2. **staged** (:mod:`kvwire.bench.gpu_engine`, ``--staging bulk``, equal TP staged by the
   default rule): verified requests of every size (every element and aux row checked on
   decode), then timed requests at each concurrency; chunks of at most ``--chunk-pages``
   pages, each gathered with one mover launch, written as a few ``--block-mib`` descriptors,
   scattered with one launch on decode.
3. **per-page** (the same harness, ``--staging direct``): one descriptor per (layer, K/V,
   page), as kvwire moved equal TP before.
4. with ``--nixl-json``: raw per-page NIXL from ``python -m kvwire_nixl.gpu_bench`` merged in.

Prints a table last (GB/s, p50, and ratios to the peer copy, raw NIXL and the per-page path)
and writes everything to ``--json``.

    python3 scripts/gpu_staged_bench.py --nixl-json $OUT/nixl.json --json $OUT/staged.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from kvwire.bench.gpu_engine import add_engine_args, engine
from kvwire.bench.gpu_mover import MiB, log, mover_check, mover_vs_peer


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def nixl_raw(path: str) -> dict[int, float]:
    """Raw per-page NIXL (``raw_prepped``) median GB/s by MiB."""
    data = json.loads(Path(path).read_text())
    return {
        int(c["bytes"] // MiB): float(c["methods"]["raw_prepped"]["median_gbps"])
        for c in data["cases"]
    }


def render(report: dict[str, Any]) -> str:
    """The comparison as a Markdown table."""
    peer = {r["mib"]: r["peer_gbps"] for r in report.get("mover", [])}
    raw = report.get("raw_nixl", {})
    direct = {(c["mib"], c["concurrency"]): c for c in report.get("per_page", {}).get("cells", [])}
    nan = float("nan")
    lines = [
        "| MiB | C | staged GB/s | p50 ms | descs/req | per-page GB/s | descs/req | "
        "torch peer GB/s | raw NIXL GB/s | x peer | x raw NIXL | x per-page |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report.get("staged", {}).get("cells", []):
        m, k = c["mib"], c["concurrency"]
        d = direct.get((m, k), {})
        pg, rw, dg = peer.get(m, nan), raw.get(m, raw.get(str(m), nan)), d.get("gbps", nan)
        lines.append(
            f"| {m} | {k} | {c['gbps']:.1f} | {c['p50_ms']:.2f} | "
            f"{c['descriptors_per_request']} | {dg:.2f} | {d.get('descriptors_per_request', '-')} "
            f"| {pg:.0f} | {rw:.2f} | {c['gbps'] / pg:.2f} | {c['gbps'] / rw:.1f} | "
            f"{c['gbps'] / dg:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, requests=16, verify=4, timeout=120.0, backend="nixl")
    p.add_argument("--repeat", type=int, default=10, help="mover/peer timing repeats")
    p.add_argument("--chunk-pages", type=int, default=16, help="pages per chunk at most")
    p.add_argument("--block-mib", type=int, default=2, help="staging block (one descriptor)")
    p.add_argument("--ring-mib", type=int, default=512)
    p.add_argument("--buffers", type=int, default=2, help="staging buffers per worker")
    p.add_argument("--per-page-sizes", type=_ints, default=[2, 16, 128])
    p.add_argument("--skip-mover", action="store_true")
    p.add_argument("--skip-per-page", action="store_true")
    p.add_argument("--nixl-json", default="")
    p.add_argument(
        "--staging-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="bulk staging option for the staged phase, over the defaults above (e.g. "
        "equal_tp_min_chunk_bytes=0 to stage 2 MiB requests, offer_ahead=false)",
    )
    a = p.parse_args(argv)
    command = " ".join(["scripts/gpu_staged_bench.py", *(argv or sys.argv[1:])])
    report: dict[str, Any] = {"command": command, "host": platform.node()}
    t0 = time.monotonic()

    def save() -> None:
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=2) + "\n")

    if a.device == "cuda":
        import torch
        import triton

        if a.gpus is None:
            a.gpus = list(range(torch.cuda.device_count()))
        if len(a.gpus) < 2:
            raise SystemExit(f"--gpus {a.gpus}: the bench moves KV between two GPUs at least")
        report["gpus"] = [f"{i}: {torch.cuda.get_device_name(i)}" for i in a.gpus]
        report["torch"], report["triton"] = torch.__version__, triton.__version__
        if not a.skip_mover:

            def enable_peer(src: int, dst: int) -> None:
                from kvwire_cudaipc._cuda import enable_peer_access

                enable_peer_access(src, dst)

            report["mover_check"] = mover_check((a.gpus[0], a.gpus[1]), enable_peer)
            report["mover"] = mover_vs_peer(a.sizes, (a.gpus[0], a.gpus[1]), a.repeat)
            save()
    block = a.block_mib * MiB
    opts: dict[str, Any] = {
        "ring_bytes": a.ring_mib * MiB,
        "block_bytes": block,
        "buffer_bytes": max(block, -(-a.chunk_pages * 2 * MiB // block) * block),
        "buffers_per_worker": a.buffers,
    }
    if a.device == "cpu":  # dry run: small pages on host memory, staged by force
        opts = {"ring_bytes": 4 * MiB, "block_bytes": 64 << 10, "buffer_bytes": MiB}
        opts["equal_tp"] = "always"
    for item in a.staging_option:
        key, _, value = item.partition("=")
        literal = value[:1].isdigit() or value in ("true", "false")
        opts[key] = json.loads(value) if literal else value
    log(f"staged: options {opts}, chunks of <= {a.chunk_pages} pages")
    report["staged"] = engine(
        a, staging="bulk", staging_options=opts, max_chunk_pages=a.chunk_pages
    )
    save()
    if not a.skip_per_page:
        a.sizes = a.per_page_sizes
        a.requests, a.verify_requests = max(4, a.requests // 2), 2
        report["per_page"] = engine(a, staging="direct", max_chunk_pages=a.chunk_pages)
    if a.nixl_json and Path(a.nixl_json).exists():
        report["raw_nixl"] = nixl_raw(a.nixl_json)
    report["duration_s"] = round(time.monotonic() - t0, 1)
    save()
    if "mover" in report:
        print("\nmover alone (one launch, GPU0 -> GPU1 pages) and its host cost:")
        for r in report["mover"]:
            print(
                f"  {r['mib']:>4} MiB: mover {r['mover_gbps']:.0f} GB/s (wall "
                f"{r['mover_wall_gbps']:.0f}), peer {r['peer_gbps']:.0f}, ratio "
                f"{r['mover_over_peer']:.2f}; host us: copy() {r['mover_host_us']:.0f} = plan "
                f"{r['plan_us']:.0f} + launch {r['slot_launch_us']:.0f} (old upload+launch "
                f"{r['upload_launch_us']:.0f})"
            )
    print()
    print(render(report))
    staged_ok = all(c["failed"] == 0 for c in report["staged"]["cells"])
    return 0 if staged_ok else 1


if __name__ == "__main__":
    sys.exit(main())
