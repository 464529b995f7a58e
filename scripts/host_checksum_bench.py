"""Speed of the host KV checksum (:class:`kvwire.integrity.RowHasher`) over one chunk.

A verification pool of 32 layers x K/V, 16-token pages of 16 KiB per buffer (2 MiB a page,
as ``kvwire bench``'s default), one chunk of ``--pages`` pages mapped by the equal-TP mapper:
its pages side by side (the usual case, read through a view) and scattered over the pool
(gathered first). Prints the median GB/s of ``--repeat`` calls after a warm-up call.

    uv run --frozen --no-sync python scripts/host_checksum_bench.py [--pages 8] [--repeat 20] \
        [--one-thread]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvwire import integrity
from kvwire.config import KVWireConfig
from kvwire.descriptors import ADDR, LEN
from kvwire.integrity import RowHasher
from kvwire.layout import ModelSpec, RankPosition
from kvwire.session.handshake import build_mapper
from kvwire.testing.kvfill import make_pool

MODEL = ModelSpec(num_layers=32, total_kv_heads=8, head_dim=32, dtype="int32", page_size=16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=8, help="pages per chunk")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument(
        "--one-thread",
        action="store_true",
        help="sum on the calling thread alone (no helper thread for the second half), as "
        "when the other core is busy",
    )
    a = ap.parse_args()
    if a.one_thread:
        integrity.PARALLEL_MIN_BYTES = 1 << 62
    slots = 8 * a.pages
    layout, _ = make_pool(MODEL, RankPosition(), slots)
    mapper = build_mapper(KVWireConfig(), layout, layout)
    tables = mapper.build_tables()
    hasher = RowHasher(layout)
    cases = {
        "neighbours": np.arange(a.pages),
        "scattered": np.random.default_rng(0).permutation(slots)[: a.pages],
    }
    for name, src in cases.items():
        src_idx, dst_idx = mapper.map_chunk(src, src)
        keys = tables.dst[np.asarray(dst_idx, dtype=np.int64), ADDR]
        nbytes = int(tables.src[np.asarray(src_idx, dtype=np.int64), LEN].sum())
        hasher.sums(tables.src, src_idx, keys)  # warm-up
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            hasher.sums(tables.src, src_idx, keys)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        gbps = nbytes / med / 1e9
        print(f"{name}: {nbytes / 2**20:.1f} MiB in {med * 1e3:.2f} ms = {gbps:.2f} GB/s")


if __name__ == "__main__":
    main()
