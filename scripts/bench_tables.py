"""Time building descriptor tables and mapping a chunk, for realistic pool sizes.

    ./dev.sh kvwire --help >/dev/null && uv run python scripts/bench_tables.py

Pools are described with raw pointers (no memory is allocated), so any size can be timed.
Prints one row per case: rows per table, table memory, build time, and per-chunk map time.
"""

from __future__ import annotations

import time

import numpy as np

from kvwire.index import EqualTPMapper, HeadSliceMapper
from kvwire.layout import KVLayout, MemoryRegion, ModelSpec, RankPosition


def layout(model: ModelSpec, tp: int, rank: int, slots: int, base: int) -> KVLayout:
    heads = 1 if model.is_mla else max(1, model.total_kv_heads // tp)
    item = model.page_size * heads * model.head_dim * model.dtype_size
    nbuf = model.num_layers * (1 if model.is_mla else 2)
    regions = tuple(
        MemoryRegion.from_pointer(base + i * slots * item, slots * item, item) for i in range(nbuf)
    )
    return KVLayout(model=model, rank=RankPosition(tp_size=tp, tp_rank=rank), buffers=regions)


def main() -> None:
    cases = [
        ("equal TP, 64 layers x2 x 100k slots, page 1", 64, 100_000, 1, 1, 1),
        ("equal TP, 64 layers x2 x 10k slots, page 16", 64, 10_000, 16, 1, 1),
        ("head slice TP2->TP1, 32 layers x2 x 10k, page 16", 32, 10_000, 16, 2, 1),
        ("head slice TP1->TP2, 32 layers x2 x 10k, page 16", 32, 10_000, 16, 1, 2),
    ]
    print(f"{'case':<52} {'rows':>11} {'MiB':>8} {'build s':>8} {'map 64 pages us':>16}")
    for label, layers, slots, ps, tp_s, tp_d in cases:
        model = ModelSpec(num_layers=layers, total_kv_heads=8, head_dim=128, page_size=ps)
        src = layout(model, tp_s, 0, slots, 1 << 40)
        dst = layout(model, tp_d, 0, slots, 1 << 44)
        mapper_cls = EqualTPMapper if tp_s == tp_d else HeadSliceMapper
        t0 = time.perf_counter()
        mapper = mapper_cls(src, dst)
        tables = mapper.build_tables()
        build = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        pages_s, pages_d = rng.choice(slots, 64, False), rng.choice(slots, 64, False)
        t0 = time.perf_counter()
        for _ in range(100):
            mapper.map_chunk(pages_s, pages_d)
        per = (time.perf_counter() - t0) / 100 * 1e6
        rows = tables.src.shape[0] + tables.dst.shape[0]
        print(f"{label:<52} {rows:>11,} {tables.nbytes / 2**20:>8.0f} {build:>8.2f} {per:>16.0f}")


if __name__ == "__main__":
    main()
