"""KV layouts end to end on a GPU: CUDA pools of every page layout, moved by kvwire between
real processes (one per rank) and checked element by element (CI has no GPU).

Cases: head-major pages on either side, K and V side by side in each row (vLLM's cache:
``kv_fused``) on both or one side, page-size conversion, and DP attention with PP, each with
heterogeneous TP, every pool in VRAM, over the chosen backend; then the staging kernels of
fused pools (``--staging bulk``); then buffer groups in VRAM (head-sharded, replicated and
multi-section states, a window, draft pages), with and without decode checking KV and group
checksums (protocol 1.14). Prints one line per case and writes them to ``--json``;
``--only TEXT`` runs the cases whose name contains it.

    python scripts/gpu_layout_cluster.py --backend nixl --json $OUT/layouts_gpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster, ClusterSpec
from kvwire.testing.cluster_groups import GROUP_KINDS
from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty

BOTH = ("prefill", "decode")
GROUPS = tuple(GROUP_KINDS)
#: name -> ClusterSpec fields beyond the model and backend
CASES: dict[str, dict[str, Any]] = {
    "head-major decode, TP 2->1": {"prefill_tp": 2, "head_major": ("decode",)},
    "head-major both, TP 1->2, pages 8->4": {
        "decode_tp": 2, "head_major": BOTH, "decode_page_size": 4},
    "fused both (vLLM NHD), TP 2->1": {"prefill_tp": 2, "kv_fused": BOTH},
    "fused both, HND->NHD, TP 1->2": {"decode_tp": 2, "kv_fused": BOTH, "head_major": ("prefill",)},
    "fused prefill only, TP 2->1": {"prefill_tp": 2, "kv_fused": ("prefill",)},
    "fused both, pages 8->16, TP 2->1": {
        "prefill_tp": 2, "kv_fused": BOTH, "decode_page_size": 16},
    "DP 2 x TP 2 x PP 2 -> TP 1 x PP 2": {
        "prefill_dp": 2, "prefill_tp": 2, "prefill_pp": 2, "decode_pp": 2},
    "bulk: fused both, TP 2->1": {"prefill_tp": 2, "kv_fused": BOTH, "staging": "bulk"},
    "bulk: head-major decode, TP 1->2": {"decode_tp": 2, "head_major": ("decode",),
                                         "staging": "bulk"},
    "groups, TP 2->1": {"prefill_tp": 2, "groups": GROUPS},
    "groups checked, TP 2->1": {"prefill_tp": 2, "groups": GROUPS, "checksum": True},
    "groups checked, TP 1->2": {"decode_tp": 2, "groups": GROUPS, "checksum": True},
}  # fmt: skip


def run_case(name: str, fields: dict[str, Any], backend: str, device: str) -> dict[str, Any]:
    fields = dict(fields)
    staging = fields.pop("staging", "direct")
    checksum = fields.pop("checksum", False)
    spec = ClusterSpec(
        model=ModelSpec(num_layers=4, total_kv_heads=4, head_dim=64, dtype="int32", page_size=8),
        slots=256,
        aux_slots=64,
        device=device,
        config=KVWireConfig(
            transfer_backend=backend,
            staging=staging,
            control=ControlOptions(heartbeat_interval_s=0.5, kv_checksum=checksum),
        ),
        **fields,
    )
    t0 = time.monotonic()
    with Cluster(spec) as c:
        plans = c.plans(32, pages=(1, 12), cached_fraction=0.3, layerwise_fraction=0.3)
        res = c.run(plans, concurrency=16, timeout_s=300)
        assert_all_ok(res)
        assert_tables_empty(c)
    descs = sum(r.descriptors for r in res)
    return {
        "case": name,
        "requests": len(res),
        "bytes": sum(r.bytes for r in res),
        "descriptors": descs,
        "seconds": round(time.monotonic() - t0, 1),
        "ok": True,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", default="nixl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--only", default="", help="run the cases whose name contains this")
    a = p.parse_args()
    rows = []
    for name, fields in CASES.items():
        if a.only not in name:
            continue
        try:
            row = run_case(name, fields, a.backend, a.device)
        except Exception as exc:  # report every case, then fail
            row = {"case": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))
    bad = [r["case"] for r in rows if not r["ok"]]
    ok = len(rows) - len(bad)
    print(f"{ok} of {len(rows)} layout cases verified on {a.device} ({a.backend})")
    if bad:
        raise SystemExit(f"failed: {bad}")


if __name__ == "__main__":
    main()
