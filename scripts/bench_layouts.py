"""Cost of each layout combination end to end: token-major and head-major pools on each side
(``--set order``), or K and V in separate buffers and side by side in one (``--set fused``,
vLLM's cache), the same workload through real managers (one process per rank, every element
verified), in one run, with ratios to token-major separate K/V on both sides.

    uv run python scripts/bench_layouts.py --transfer-backend tcp --tp 2:1 --requests 96
    uv run python scripts/bench_layouts.py --set fused --transfer-backend nixl --tp 2:1
"""

from __future__ import annotations

import argparse
import time

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster, ClusterSpec
from kvwire.testing.cluster_suite import assert_all_ok

BOTH = ("prefill", "decode")
#: case -> (roles with head-major pages, roles with fused K|V rows)
SETS: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "order": {"token->token": ((), ()), "head->token": (("prefill",), ()),
              "token->head": (("decode",), ()), "head->head": (BOTH, ())},
    "fused": {"sep->sep": ((), ()), "fused->fused": ((), BOTH),
              "fused->sep": ((), ("prefill",)), "sep->fused": ((), ("decode",)),
              "fused-hnd->fused-hnd": (BOTH, BOTH), "fused->fused-hnd": (("decode",), BOTH)},
}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--transfer-backend", default="tcp")
    p.add_argument("--tp", default="2:1", help="prefill_tp:decode_tp")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--staging", default="direct", help="direct or bulk")
    p.add_argument("--set", default="order", choices=sorted(SETS))
    a = p.parse_args()
    tp_p, tp_d = (int(x) for x in a.tp.split(":"))
    model = ModelSpec(num_layers=8, total_kv_heads=8, head_dim=64, dtype="int32", page_size=16)
    rows = []
    for name, (hm, fused) in SETS[a.set].items():
        spec = ClusterSpec(
            model=model, prefill_tp=tp_p, decode_tp=tp_d, slots=512, aux_slots=64,
            head_major=hm, kv_fused=fused, config=KVWireConfig(
                transfer_backend=a.transfer_backend, staging=a.staging, control=ControlOptions()
            ),
        )  # fmt: skip
        with Cluster(spec) as c:
            plans = c.plans(a.requests, pages=(4, 16), seed=1)
            c.run(plans[:8], concurrency=8)  # warm-up: handshakes
            t0 = time.monotonic()
            res = c.run(plans, concurrency=a.concurrency, timeout_s=600)
            took = time.monotonic() - t0
            assert_all_ok(res)
        nbytes = sum(r.bytes for r in res)
        descs = sum(r.descriptors for r in res) / len(res)
        p50 = sorted(r.latency_s for r in res)[len(res) // 2] * 1e3
        rows.append((name, nbytes / took / 1e9, p50, descs))
    base = rows[0][1]
    print(f"{a.transfer_backend} TP {a.tp} {a.staging}, {a.requests} requests, C={a.concurrency}")
    print(f"| layouts | GB/s | p50 ms | descriptors/request | GB/s vs {rows[0][0]} |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, gbs, p50, descs in rows:
        print(f"| {name} | {gbs:.3f} | {p50:.1f} | {descs:.0f} | {gbs / base:.2f}x |")


if __name__ == "__main__":
    main()
