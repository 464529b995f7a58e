"""One engine run with a chosen staging strategy and options (a device run's building block):
the GPU engine of :mod:`kvwire.bench.gpu_engine` (its flags: backend, sizes, TP, ...) plus
``--staging``, ``--staging-options`` (JSON) and ``--max-chunk-pages``. Used by
``scripts/gpu_staging_default_run.sh`` for the A/B of staging strategies on one backend.

    python3 scripts/gpu_staging_ab.py --backend cudaipc --prefill-tp 2 --decode-tp 1 \
        --staging bulk --sizes 16,128 --concurrency 1,8 --json out.json
"""

from __future__ import annotations

import argparse
import json

from kvwire.bench.gpu_engine import add_engine_args, engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_engine_args(p, requests=32, verify=2, timeout=120.0, backend="cudaipc")
    p.add_argument("--staging", default="direct")
    p.add_argument("--staging-options", default="{}", help="JSON")
    p.add_argument("--max-chunk-pages", type=int, default=0)
    p.add_argument("--checksum", action="store_true", help="kv_checksum on (issue 26)")
    a = p.parse_args()
    if a.device == "cuda" and not a.gpus:  # every visible GPU, ranks round robin
        import torch

        a.gpus = list(range(torch.cuda.device_count()))
    report = engine(
        a,
        staging=a.staging,
        staging_options=json.loads(a.staging_options),
        max_chunk_pages=a.max_chunk_pages,
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    ok = all(v["mismatches"] == 0 for v in report["verified"])
    cells = " ".join(
        f"{c['mib']}/{c['concurrency']}:{c['gbps']:.1f}({c['p50_ms']:.2f}ms,failed {c['failed']})"
        for c in report["cells"]
    )
    # the switch interval of each rank process after the last cell (prefill's first): a
    # GIL watch that lowered it moves a run's figures by up to 1.5x (docs/benchmarks.md,
    # session 26), so every summary line says where it stood
    gil = (report["cells"][-1].get("gil") or {}) if report["cells"] else {}
    us = "/".join(f"{v:g}" for v in gil.get("interval_us", []))
    # the driver's and the first prefill rank's share of a core in the last cell: a driver
    # near 1.0 caps the request rate (the harness, not kvwire)
    cpu = (report["cells"][-1].get("cpu_share") or {}) if report["cells"] else {}
    pre = next((v for k, v in cpu.items() if "prefill" in k), "-")
    print("summary", "verified" if ok else "MISMATCH", cells, f"gil_us {us or '-'}",
          f"cpu driver/prefill {cpu.get('driver', '-')}/{pre}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
