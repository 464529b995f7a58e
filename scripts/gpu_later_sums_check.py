"""Prefill's checksums computed beside the write (issue 26 item 1): ``SentSums.chunk_later``
(``DeviceRowHasher.page_sums_later``) on a GPU, checked and timed, one GPU.

For the links of ``scripts/gpu_page_sums_check.py`` (the issue's model, equal TP and head
slices both ways, pools on the GPU), random chunks of 1-16 pages:

1. a later call's sums, taken on another thread (as ``cudaipc``'s kernel watcher makes the
   note), equal ``SentSums.chunk``'s for the same chunk; a second later call on the same
   thread before the first was taken (it reuses the lane's buffers: the first is settled
   first), and a plain call after both, give theirs;
2. the calling thread's host time per chunk (medians): ``chunk`` (launch and wait) against
   ``chunk_later`` (launch and event, no wait), what a transfer worker pays before it can
   launch the chunk's write.

    python3 scripts/gpu_later_sums_check.py --json $OUT/later_sums.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import numpy as np
from gpu_page_sums_check import LINKS, pools

from kvwire.config import KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.session.checksums import SentSums
from kvwire.session.handshake import build_mapper


def on_thread(fn: Any) -> Any:
    """``fn()`` called on a thread of its own (the result taken elsewhere than launched)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    a.device = "cuda"
    model = ModelSpec(num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    slots = 40
    rng = np.random.default_rng(11)
    report: dict[str, Any] = {"links": {}}
    bad = 0
    for name, (tps, tpd, rs, rd) in LINKS.items():
        src, _, keep_s = pools(a, model, tps, rs, slots)
        dst, _, keep_d = pools(a, model, tpd, rd, slots)
        sent = SentSums(build_mapper(KVWireConfig(), src, dst), src)

        def chunk() -> tuple[Any, Any]:
            n = int(rng.integers(1, 17))
            return rng.permutation(slots)[:n], rng.permutation(slots)[:n]

        wrong = 0
        for _ in range(a.rounds):
            (s1, d1), (s2, d2), (s3, d3) = chunk(), chunk(), chunk()
            first = sent.chunk_later(s1, d1)
            second = sent.chunk_later(s2, d2)  # settles the first
            third = sent.chunk(s3, d3)
            assert first is not None and second is not None, name
            got = (on_thread(first), on_thread(second), third)
            want = (sent.chunk(s1, d1), sent.chunk(s2, d2), sent.chunk(s3, d3))
            pairs = zip(got, want, strict=True)
            wrong += sum(g != w or len(w) != model.num_layers for g, w in pairs)
        s, d = chunk()
        times = {"chunk": [], "chunk_later": [], "result_after_1ms": []}
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            sent.chunk(s.copy(), d)
            t1 = time.perf_counter()
            later = sent.chunk_later(s.copy(), d)
            t2 = time.perf_counter()
            time.sleep(0.001)
            t3 = time.perf_counter()
            assert later is not None
            later()
            t4 = time.perf_counter()
            times["chunk"].append(t1 - t0)
            times["chunk_later"].append(t2 - t1)
            times["result_after_1ms"].append(t4 - t3)
        med = {k: round(1e3 * statistics.median(v), 4) for k, v in times.items()}
        report["links"][name] = {"rounds": a.rounds, "wrong": wrong, "host_ms": med}
        print(f"{name}: {3 * a.rounds} chunks, {wrong} wrong; host ms per call {med}")
        bad += wrong
        del keep_s, keep_d
    print("LATER-SUMS-OK" if not bad else f"LATER-SUMS-BAD {bad}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
