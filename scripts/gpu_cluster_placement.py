"""The cluster harness on a machine with several GPUs (issue 27 item 6): ranks are placed
round robin over the GPUs, prefill first and decode after them
(:func:`kvwire.testing.cluster.rank_gpu`), so a 1P1D pair moves KV from GPU 0 to GPU 1.

For each case: the placement the rule gives, the compute processes ``nvidia-smi`` sees on each
GPU once every rank is up and the memory each GPU gained (every rank's pool is ``--pool-mib``),
then a verified workload (every element and aux row checked on decode). Prints one JSON line
per case.

    python scripts/gpu_cluster_placement.py --backend nixl --json $OUT/placement.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster, ClusterSpec, rank_gpu
from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty

CASES: dict[str, dict[str, Any]] = {
    "1P1D": {},
    "TP 2 -> TP 2": {"prefill_tp": 2, "decode_tp": 2},
    "TP 2 -> TP 1": {"prefill_tp": 2},
    "TP 1 -> TP 2, gpus=(1, 0)": {"decode_tp": 2, "gpus": (1, 0)},
}


def _smi(query: str, kind: str = "gpu") -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_state() -> tuple[dict[int, int], dict[int, int]]:
    """(compute processes, MiB used) per GPU index."""
    rows = _smi("index,pci.bus_id,memory.used")
    index = {bus.lower(): int(i) for i, bus, _ in rows}
    used = {int(i): int(mib) for i, _, mib in rows}
    procs = Counter(index[r[0].lower()] for r in _smi("gpu_bus_id", "compute-apps"))
    return {i: procs.get(i, 0) for i in used}, used


def run_case(name: str, fields: dict[str, Any], backend: str, pool_mib: int) -> dict[str, Any]:
    import torch

    count = torch.cuda.device_count()
    model = ModelSpec(num_layers=4, total_kv_heads=4, head_dim=64, dtype="int32", page_size=16)
    tp_max = max(fields.get("prefill_tp", 1), fields.get("decode_tp", 1))
    page_bytes = 16 * max(1, 4 // tp_max) * 64 * 4 * 2 * 4  # K and V of 4 layers
    spec = ClusterSpec(
        model=model,
        slots=max(64, pool_mib * 2**20 // page_bytes),
        aux_slots=64,
        device="cuda",
        config=KVWireConfig(
            transfer_backend=backend, control=ControlOptions(heartbeat_interval_s=0.5)
        ),
        **fields,
    )
    want = Counter()
    for p_tp in range(spec.prefill_tp):
        want[rank_gpu(spec, "prefill", 0, p_tp, 0, count)] += 1
    for d_tp in range(spec.decode_tp):
        want[rank_gpu(spec, "decode", 0, d_tp, 0, count)] += 1
    procs0, used0 = gpu_state()
    t0 = time.monotonic()
    with Cluster(spec) as c:
        procs1, used1 = gpu_state()
        plans = c.plans(32, pages=(1, 12), cached_fraction=0.3, layerwise_fraction=0.3)
        res = c.run(plans, concurrency=8, timeout_s=300)
        assert_all_ok(res)
        assert_tables_empty(c)
    procs = {i: procs1[i] - procs0.get(i, 0) for i in procs1}
    placed = {i: n for i, n in procs.items() if n}
    return {
        "case": name,
        "gpus": count,
        "ranks_per_gpu_rule": {str(k): v for k, v in sorted(want.items())},
        "processes_per_gpu_seen": {str(k): v for k, v in sorted(placed.items())},
        "mib_gained_per_gpu": {str(i): used1[i] - used0.get(i, 0) for i in sorted(used1)},
        "requests_verified": len(res),
        "bytes": sum(r.bytes for r in res),
        "seconds": round(time.monotonic() - t0, 1),
        "ok": placed == dict(want),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", default="nixl")
    p.add_argument("--pool-mib", type=int, default=512, help="KV pool of each rank")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rows = []
    for name, fields in CASES.items():
        try:
            row = run_case(name, fields, a.backend, a.pool_mib)
        except Exception as exc:  # report every case, then fail
            row = {"case": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))
    bad = [r["case"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} placement cases as the rule says")
    if bad:
        raise SystemExit(f"failed: {bad}")


if __name__ == "__main__":
    main()
