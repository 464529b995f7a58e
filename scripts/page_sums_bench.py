"""Host KV checksums of one chunk summed from its page form against the same chunk as rows.

For each link shape (equal TP: whole pages; TP 2 -> 1 and 1 -> 2: head slices, 16 pieces a
page) it times, side by side in one run, what each side pays per chunk: prefill's
:meth:`SentSums.chunk <kvwire.session.checksums.SentSums.chunk>` (a fresh page array per call,
as a new chunk) and decode's :meth:`LandedSums.chunk
<kvwire.session.checksums.LandedSums.chunk>`, once from the page form (the default where a
link has one) and once as rows (the link's page form switched off: map the chunk, then sum the
listed rows), checks both give the same sums, and prints medians and the ratio rows / pages.
Host pools (NumPy); the GPU kernel's figures come from ``scripts/gpu_checksum_engine.py``.

    uv run --frozen --no-sync python scripts/page_sums_bench.py [--pages 8] [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvwire.config import KVWireConfig
from kvwire.layout import ModelSpec, RankPosition
from kvwire.session.checksums import LandedSums, SentSums
from kvwire.session.handshake import build_mapper
from kvwire.testing.kvfill import make_pool

#: 32 layers x K/V, 8 KV heads of 128 bytes, 16-token pages: 16 KiB per buffer and page.
MODEL = ModelSpec(num_layers=32, total_kv_heads=8, head_dim=32, dtype="int32", page_size=16)


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=8, help="pages per chunk")
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args()
    slots = 4 * a.pages
    rng = np.random.default_rng(0)
    print("| link | side | rows | MiB | rows ms | pages ms | rows / pages |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, (tp_p, tp_d) in {
        "TP 1 -> 1": (1, 1),
        "TP 2 -> 1": (2, 1),
        "TP 1 -> 2": (1, 2),
    }.items():
        src_layout, src_arrs = make_pool(MODEL, RankPosition(tp_size=tp_p, tp_rank=0), slots)
        dst_layout, dst_arrs = make_pool(MODEL, RankPosition(tp_size=tp_d, tp_rank=0), slots)
        for arr in (*src_arrs, *dst_arrs):
            arr.reshape(-1)[:] = rng.integers(-(1 << 31), 1 << 31, arr.size, dtype=np.int32)
        mapper = build_mapper(KVWireConfig(), src_layout, dst_layout)
        sent = SentSums(mapper, src_layout)
        landed = LandedSums(KVWireConfig(), src_layout, dst_layout)
        assert sent.sides is not None and landed.side is not None, name
        src = rng.permutation(slots)[: a.pages].astype(np.int64)
        dst = rng.permutation(slots)[: a.pages].astype(np.int64)
        si, _ = mapper.map_chunk(src, dst)
        rows = int(si.size)
        mib = rows * sent.tables.src[int(si[0]), 1] / (1 << 20)
        n = a.pages

        def prefill(sent: SentSums = sent, src: Any = src, dst: Any = dst) -> Any:
            return sent.chunk(src.copy(), dst)

        def decode(landed: LandedSums = landed, dst: Any = dst, n: int = n) -> Any:
            return landed.chunk(n, dst, 0, (0, n))

        for side, fn, obj, attr in (
            ("prefill", prefill, sent, "sides"),
            ("decode", decode, landed, "side"),
        ):
            form = getattr(obj, attr)
            paged_ms = median_ms(fn, a.repeat)
            want = fn()
            setattr(obj, attr, None)  # the row path
            rows_ms = median_ms(fn, a.repeat)
            assert fn() == want, (name, side)
            setattr(obj, attr, form)
            print(
                f"| {name} | {side} | {rows} | {mib:.1f} | {rows_ms:.2f} | {paged_ms:.2f} | "
                f"{rows_ms / paged_ms:.2f} |"
            )


if __name__ == "__main__":
    main()
