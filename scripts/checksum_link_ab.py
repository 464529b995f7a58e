"""What ``kv_checksum`` adds on CPU when a network link, not memory, carries the KV (issue 26
item 1): prefill and decode in two network namespaces (two "hosts" joined by a bridge, root
needed), the decode node's link limited to a rate with a token bucket (``tc tbf``), each way.

For each backend and link rate, two clusters run side by side in the same namespaces, one with
``kv_checksum`` off and one with it on, their timed batches alternating round after round
(``--rounds``), so that drift falls on both alike. Per cell: decode's p50 request time at C=1
(receiver made -> Success) and the batch's GB/s at C>1, off and on, and what the checks add
(``on / off - 1`` in time, median of the rounds). A few verified requests run first on each
cluster (every element checked); the timed batches skip the harness's own fill and check, so
the only CPU work besides the transfer is kvwire's (the sums included)::

    sudo uv run --frozen --no-sync python scripts/checksum_link_ab.py --backends tcp,nixl \\
        --rates 0,2000,8000 --mib 16,128 --concurrency 1,4 --requests 8 --rounds 3

Rate 0: the bridge unthrottled (veth pairs: kernel copies on the same cores, like loopback).
``scripts/checksum_cpu_ab.py`` measures the same-host case (one namespace, shared memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.testing.cluster import Cluster, ClusterSpec, RoomPlan
from kvwire.testing.netns import NetnsBed, unavailable_reason

#: 8 layers x 8 KV heads x 64 int32 dims, 16-token pages: 512 KiB a page (64 KiB runs).
MODEL = ModelSpec(num_layers=8, total_kv_heads=8, head_dim=64, dtype="int32", page_size=16)
PAGE_BYTES = 2 * 8 * 8 * 64 * 4 * 16
#: UCX kept to TCP on the namespace's interface (it would take the nodes for one host).
NIXL_OPTIONS = {"ucx_env": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}}


def role_config(bed: NetnsBed, node: str, backend: str, checksum: bool) -> KVWireConfig:
    addr = bed.addr[node]
    return KVWireConfig(
        transfer_backend=backend,
        transfer_backend_options={"host": addr} if backend == "tcp" else NIXL_OPTIONS,
        control=ControlOptions(
            host=addr,
            bootstrap_host=bed.addr["prefill"],
            kv_checksum=checksum,
            waiting_timeout_s=120.0,
            transfer_timeout_s=120.0,
        ),
    )


def spec(bed: NetnsBed, backend: str, checksum: bool, slots: int) -> ClusterSpec:
    cfg = {node: role_config(bed, node, backend, checksum) for node in ("prefill", "decode")}
    return ClusterSpec(
        model=MODEL,
        slots=slots,
        aux_slots=64,
        config=cfg["prefill"],
        role_config=cfg,
        netns={role: bed.ns[role] for role in ("prefill", "decode")},
        verify=False,
    )


def batch(
    c: Cluster, pages: int, n: int, conc: int, room0: int, verify: bool = False
) -> tuple[list[float], int, float]:
    """``n`` requests of ``pages`` pages (one chunk each) at ``conc`` in flight: decode's
    request times (s), the bytes moved and the batch's wall time. Fails on any failure."""
    plans = [
        RoomPlan(room=room0 + i, num_pages=pages, chunks=[pages], verify=verify) for i in range(n)
    ]
    t0 = time.monotonic()
    results = c.run(plans, concurrency=conc, timeout_s=600)
    wall = time.monotonic() - t0
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"{len(bad)} requests failed: {bad[0].reports}")
    return [r.latency_s for r in results], sum(r.bytes for r in results), wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="tcp")
    ap.add_argument("--rates", default="0,2000,8000", help="Mbit/s each way; 0: unthrottled")
    ap.add_argument("--mib", default="16,128")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8, help="timed requests per batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--verified", type=int, default=4, help="verified requests per cluster")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"network namespaces unavailable: {reason}", file=sys.stderr)
        return 2
    sizes = [int(x) for x in args.mib.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    pages_of = {mib: max(1, (mib << 20) // PAGE_BYTES) for mib in sizes}
    slots = max(concs) * max(pages_of.values())
    rows: list[dict[str, Any]] = []
    room = 1 << 40
    for backend in args.backends.split(","):
        with NetnsBed(("prefill", "decode")) as bed:
            clusters = {on: Cluster(spec(bed, backend, on, slots)) for on in (False, True)}
            for on, c in clusters.items():
                c.__enter__()
                # filled and checked element by element (the timed batches skip the
                # harness's fill and check: only kvwire's work, the sums included, is timed)
                batch(c, pages_of[max(sizes)], args.verified, 1, room, verify=True)
                room += args.verified
                print(f"{backend} checksum={on}: {args.verified} verified requests ok")
            try:
                for rate in rates:
                    if rate:
                        kb = max(64, int(rate * 1000 / 8 / 250))  # ~4 ms of the rate
                        bed.throttle("decode", rate_mbit=rate, queue_kb=kb)
                    else:
                        bed.heal("decode")
                    for mib in sizes:
                        for conc in concs:
                            got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
                            for r in range(args.rounds):
                                order = (False, True) if r % 2 == 0 else (True, False)
                                for on in order:
                                    lat, nbytes, wall = batch(
                                        clusters[on], pages_of[mib], args.requests, conc, room
                                    )
                                    room += args.requests
                                    got[on].append((statistics.median(lat), nbytes / wall / 1e9))
                            adds = [
                                (b[0] / a[0] - 1) if conc == 1 else (a[1] / b[1] - 1)
                                for a, b in zip(got[False], got[True], strict=True)
                            ]
                            row = {
                                "backend": backend, "rate_mbit": rate, "mib": mib, "c": conc,
                                "off_p50_ms": [x[0] * 1e3 for x in got[False]],
                                "on_p50_ms": [x[0] * 1e3 for x in got[True]],
                                "off_gbps": [x[1] for x in got[False]],
                                "on_gbps": [x[1] for x in got[True]],
                                "adds": adds, "adds_median": statistics.median(adds),
                            }  # fmt: skip
                            rows.append(row)
                            key = "p50 ms" if conc == 1 else "GB/s"
                            off = [x[0] * 1e3 if conc == 1 else x[1] for x in got[False]]
                            on_ = [x[0] * 1e3 if conc == 1 else x[1] for x in got[True]]
                            print(
                                f"{backend} {rate or 'free':>6} Mbit {mib:>4} MiB C={conc}: "
                                f"{key} off {'/'.join(f'{v:.2f}' for v in off)} on "
                                f"{'/'.join(f'{v:.2f}' for v in on_)}; checks add "
                                f"{statistics.median(adds) * 100:+.1f}% "
                                f"({', '.join(f'{a * 100:+.0f}%' for a in adds)})",
                                flush=True,
                            )
            finally:
                for c in clusters.values():
                    c.__exit__(None, None, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
