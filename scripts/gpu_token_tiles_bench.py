"""The pool-to-pool page mover alone on head slices of token-major pages (heterogeneous TP
over ``cudaipc``), with a page's pieces moved one token at a time (``tile_bytes=0``, as
before session 22) and in tiles of several tokens, beside whole pages and a peer copy.

Model of issue 27 (32 layers x K/V, 8 KV heads x 128 dims bf16, 16-token pages), 64 pages
(128 MiB of the source's pool) into random slots, one process with peer access between the
GPUs (as ``cudaipc`` enables it). Cases, each checked element by element (destination
poisoned first) before it is timed, CUDA-synchronised wall time, median of ``--repeat``:

* ``1->1``: whole pages, GPU 0 -> GPU 1 (the baseline: one piece a page);
* ``1->2``: GPU 0's pages, 4 heads each into GPUs 1 and 2 (TP 1 -> 2's prefill rank: both
  halves in one ``copy_batch``, as a ``cudaipc`` worker's turn launches them);
* ``2->1``: GPUs 0 and 1, 4 heads each, into GPU 2's pages (TP 2 -> 1, both at once).

With two GPUs, 1->2 writes two pools on GPU 1 and 2->1 reads two pools on GPU 0 (the
kernel's work is the same; one GPU's links carry it).

    python3 scripts/gpu_token_tiles_bench.py --json $OUT/tiles.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

L, H, D, PS = 32, 8, 128, 16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--tiles", default="0,8192,16384", help="tile_bytes values to compare")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    import torch

    from kvwire.descriptors import ADDR
    from kvwire.index import EqualTPMapper, HeadSliceMapper
    from kvwire.layout import KVLayout, ModelSpec, RankPosition
    from kvwire.movers.triton_pool_pages import PoolPageCopier
    from kvwire_cudaipc._cuda import enable_peer_access

    n_gpu = torch.cuda.device_count()
    if n_gpu < 2:
        print("needs two GPUs")
        return 2
    for s in range(min(n_gpu, 3)):
        for d in range(min(n_gpu, 3)):
            if s != d:
                enable_peer_access(s, d)
    model = ModelSpec(num_layers=L, total_kv_heads=H, head_dim=D, dtype="bfloat16", page_size=PS)
    slots = 2 * a.pages
    rng = np.random.default_rng(7)

    def pool(dev: int, tp: int, rank: int) -> tuple[KVLayout, list[Any]]:
        shape = (slots, PS, H // tp, D)
        ts = [
            torch.randint(-30000, 30000, shape, dtype=torch.int16, device=f"cuda:{dev}")
            for _ in range(2 * L)
        ]
        pos = RankPosition(tp_size=tp, tp_rank=rank)
        return KVLayout.from_tensors(model, [t.view(torch.bfloat16) for t in ts], pos), ts

    def links(case: str) -> list[dict[str, Any]]:
        """One entry per (source, destination) of the case."""
        x, y = (1, 2) if n_gpu > 2 else (1, 1)  # 1->2's destinations
        u, v = (0, 1) if n_gpu > 2 else (0, 0)  # 2->1's sources
        if case == "1->1":
            pairs = [((0, 1, 0), (1, 1, 0))]
        elif case == "1->2":
            pairs = [((0, 1, 0), (x, 2, 0)), ((0, 1, 0), (y, 2, 1))]
        else:
            pairs = [((u, 2, 0), (y, 1, 0)), ((v, 2, 1), (y, 1, 0))]
        pools: dict[tuple[int, int, int], tuple[KVLayout, list[Any]]] = {}
        out = []
        sp = rng.permutation(slots)[: a.pages]
        dp = rng.permutation(slots)[: a.pages]
        for s, d in pairs:
            src = pools.setdefault(s, pool(*s))
            dst = pools.setdefault(d, pool(*d))
            cls = EqualTPMapper if s[1] == d[1] else HeadSliceMapper
            mapper = cls(src[0], dst[0])
            chunk = mapper.page_chunk(sp, dp)
            tables = mapper.build_tables()
            g = chunk.geometry
            out.append(
                {
                    "src": src,
                    "dst": dst,
                    "sdev": s[0],
                    "ddev": d[0],
                    "lo": getattr(mapper, "src_start", 0) * D,
                    "dlo": getattr(mapper, "dst_start", 0) * D,
                    "w": getattr(mapper, "num_heads", H // max(s[1], d[1])) * D,
                    "item": (
                        chunk,
                        tables.src[g.src_rows, ADDR].astype(np.int64),
                        tables.dst[g.dst_rows, ADDR].astype(np.int64),
                    ),
                }
            )
        for e in out:
            e["sp"], e["dp"] = sp, dp
        return out

    copiers = {d: PoolPageCopier(d) for d in range(min(n_gpu, 3))}
    streams = {d: torch.cuda.Stream(device=d) for d in range(min(n_gpu, 3))}
    tiles = [int(x) for x in a.tiles.split(",")]
    rows: list[dict[str, Any]] = []
    for case in ("1->1", "1->2", "2->1"):
        ls = links(case)
        by_src: dict[int, list[Any]] = {}
        for e in ls:
            by_src.setdefault(e["sdev"], []).append(e["item"])
        nbytes = sum(e["item"][0].nbytes for e in ls)
        devs = {e["sdev"] for e in ls} | {e["ddev"] for e in ls}

        def go(by_src: dict[int, list[Any]] = by_src) -> None:
            for dev, items in by_src.items():
                copiers[dev].copy_batch(items, stream=streams[dev])

        def sync(devs: set[int] = devs) -> None:
            for d in devs:
                streams[d].synchronize()
                torch.cuda.synchronize(d)

        for rnd in range(2):  # two rounds, the tile sizes alternating within each
            for tb in tiles:
                for c in copiers.values():
                    c.tile_bytes = tb
                bad = 0
                if rnd == 0:  # check once per tile size
                    for e in ls:
                        for t in e["dst"][1]:
                            t.fill_(-1)
                    sync()
                    go()
                    sync()
                    for e in ls:
                        sdev, ddev = e["sdev"], e["ddev"]
                        for b in range(2 * L):
                            want = e["src"][1][b][torch.as_tensor(e["sp"], device=f"cuda:{sdev}")]
                            want = want.view(a.pages, PS, -1)[:, :, e["lo"] : e["lo"] + e["w"]]
                            got = e["dst"][1][b][torch.as_tensor(e["dp"], device=f"cuda:{ddev}")]
                            got = got.view(a.pages, PS, -1)[:, :, e["dlo"] : e["dlo"] + e["w"]]
                            bad += int((got != want.to(f"cuda:{ddev}")).sum())
                times = []
                for _ in range(a.repeat):
                    sync()
                    t0 = time.perf_counter()
                    go()
                    sync()
                    times.append(time.perf_counter() - t0)
                med = statistics.median(times)
                row = {
                    "case": case,
                    "round": rnd,
                    "tile_bytes": tb,
                    "mib": nbytes / (1 << 20),
                    "ms": med * 1e3,
                    "gbps": nbytes / med / 1e9,
                    "mismatches": bad if rnd == 0 else None,
                    "shape": copiers[min(by_src)].last_shape,
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
        del ls, by_src
        torch.cuda.empty_cache()
    x = torch.empty(128 << 20, dtype=torch.uint8, device="cuda:0")
    y = torch.empty(128 << 20, dtype=torch.uint8, device="cuda:1")
    times = []
    for _ in range(a.repeat):
        torch.cuda.synchronize(0)
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        times.append(time.perf_counter() - t0)
    peer = (128 << 20) / statistics.median(times) / 1e9
    print(f"peer copy 128 MiB GPU 0 -> 1: {peer:.1f} GB/s")
    print(f"{'case':<5} {'tile':>6} {'round':>5} {'ms':>7} {'GB/s':>7} {'x peer':>7} {'bad':>4}")
    for r in rows:
        print(
            f"{r['case']:<5} {r['tile_bytes']:>6} {r['round']:>5} {r['ms']:>7.3f} "
            f"{r['gbps']:>7.1f} {r['gbps'] / peer:>7.2f} {r['mismatches']!s:>4}"
        )
    if a.json:
        gpus = [torch.cuda.get_device_name(i) for i in range(n_gpu)]
        Path(a.json).write_text(
            json.dumps({"gpus": gpus, "peer_gbps": peer, "cells": rows}, indent=1)
        )
    return 0 if all(not r["mismatches"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
