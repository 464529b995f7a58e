"""The pool-to-pool page mover between GPUs with head-major pages on a side (cudaipc's page
writes of a ``head_rows`` link), against token-major pages and a torch peer copy, in one
process (peer access between the GPUs, as cudaipc enables it).

Model of issue 27 (32 layers x K/V, 8 KV heads x 128 dims bf16, 16-token pages: 2 MiB a page),
a 128 MiB chunk (64 pages, random slots on both sides). Cases, each checked element by element
(destination poisoned first, untouched slots still poisoned) before it is timed:

* ``tm 1->1``: token-major to token-major (whole pages; the baseline);
* ``hm dst 1->1`` / ``hm src 1->1``: token-major into head-major pages, and back;
* ``tm 2->1`` / ``hm dst 2->1``: two source GPUs (4 heads each) into one GPU's 8 heads at once
  (TP 2 -> 1; the head-major destination is what a head-major decode rank receives);
each head-major case in both piece orders of the head kernel (``t``: tokens of a head
consecutive, ``h``: heads of a token) and the automatic choice.

    python3 scripts/gpu_pool_heads_bench.py --json $OUT/pool_heads.json
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
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    import torch

    from kvwire.descriptors import ADDR
    from kvwire.index import EqualTPMapper, HeadSliceMapper, default_mapper_name
    from kvwire.index.head_rows import HeadRowsMapper
    from kvwire.layout import KVLayout, ModelSpec, RankPosition
    from kvwire.movers.triton_pool_pages import PoolPageCopier
    from kvwire_cudaipc._cuda import enable_peer_access

    n_gpu = torch.cuda.device_count()
    dst_dev = 2 if n_gpu > 2 else 1
    for s in (0, 1):
        if s != dst_dev:
            enable_peer_access(s, dst_dev)
    mappers = {
        "equal_tp": EqualTPMapper,
        "head_slice": HeadSliceMapper,
        "head_rows": HeadRowsMapper,
    }
    model = ModelSpec(num_layers=L, total_kv_heads=H, head_dim=D, dtype="bfloat16", page_size=PS)
    slots = 2 * a.pages
    rng = np.random.default_rng(5)

    def pool(dev: int, tp: int, rank: int, hm: bool) -> tuple[KVLayout, list[Any]]:
        h = H // tp
        shape = (slots, h, PS, D) if hm else (slots, PS, h, D)
        ts = [
            torch.randint(-30000, 30000, shape, dtype=torch.int16, device=f"cuda:{dev}").view(
                torch.bfloat16
            )
            for _ in range(2 * L)
        ]
        pos = RankPosition(tp_size=tp, tp_rank=rank)
        return KVLayout.from_tensors(model, ts, pos, head_major=hm), ts

    def canon(t: Any, hm: bool) -> Any:  # [slot, token, head, dim]
        return t.permute(0, 2, 1, 3) if hm else t

    out: list[dict[str, Any]] = []
    cases = [
        ("tm 1->1", 1, (False, False)),
        ("hm dst 1->1", 1, (False, True)),
        ("hm src 1->1", 1, (True, False)),
        ("tm 2->1", 2, (False, False)),
        ("hm dst 2->1", 2, (False, True)),
    ]
    for name, tps, (shm, dhm) in cases:
        dst_layout, dst_ts = pool(dst_dev, 1, 0, dhm)
        srcs = []
        for r in range(tps):
            dev = r if r != dst_dev else 0
            lay, ts = pool(dev, tps, r, shm)
            mapper = mappers[default_mapper_name(lay, dst_layout)](lay, dst_layout)
            sp = rng.permutation(slots)[: a.pages]
            dp = rng.permutation(slots)[: a.pages]
            if r:  # TP 2 -> 1: both sources fill the same destination pages
                dp = srcs[0]["dp"]
            chunk = mapper.page_chunk(sp, dp)
            tables = mapper.build_tables()
            g = chunk.geometry
            srcs.append(
                {
                    "dev": dev,
                    "ts": ts,
                    "sp": sp,
                    "dp": dp,
                    "chunk": chunk,
                    "s": tables.src[g.src_rows, ADDR].astype(np.int64),
                    "d": tables.dst[g.dst_rows, ADDR].astype(np.int64),
                    "copier": PoolPageCopier(dev),
                    "stream": torch.cuda.Stream(device=dev),
                    "start": mapper.src_start if hasattr(mapper, "src_start") else 0,
                    "dstart": getattr(mapper, "dst_start", 0),
                    "heads": getattr(mapper, "num_heads", H // tps),
                }
            )
        nbytes = sum(s["chunk"].nbytes for s in srcs)
        orders = ("auto", "t", "h") if (shm or dhm) else ("auto",)
        for order in orders:

            def go(srcs: list[dict[str, Any]] = srcs, order: str = order) -> None:
                for s in srcs:
                    s["copier"].heads_order = order
                    s["copier"].copy_pages(s["chunk"], s["s"], s["d"], stream=s["stream"])

            def sync(srcs: list[dict[str, Any]] = srcs) -> None:
                for s in srcs:
                    s["stream"].synchronize()

            for t in dst_ts:
                t.view(torch.int16).fill_(-1)
            torch.cuda.synchronize(dst_dev)
            go()
            sync()
            bad = 0
            mask = torch.ones(slots, dtype=torch.bool, device=f"cuda:{dst_dev}")
            mask[torch.as_tensor(srcs[0]["dp"], device=f"cuda:{dst_dev}")] = False
            for b in range(2 * L):
                got = canon(dst_ts[b], dhm)
                for s in srcs:
                    want = canon(s["ts"][b], shm)[torch.as_tensor(s["sp"], device=want_dev(s))]
                    want = want[:, :, s["start"] : s["start"] + s["heads"]].to(f"cuda:{dst_dev}")
                    dsel = got[torch.as_tensor(s["dp"], device=f"cuda:{dst_dev}")]
                    dsel = dsel[:, :, s["dstart"] : s["dstart"] + s["heads"]]
                    bad += int((dsel.view(torch.int16) != want.view(torch.int16)).sum())
                bad += int((dst_ts[b][mask].view(torch.int16) != -1).sum())
            times = []
            for _ in range(a.repeat):
                sync()
                t0 = time.perf_counter()
                go()
                sync()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            row = {
                "case": name,
                "order": order,
                "mib": nbytes / (1 << 20),
                "ms": med * 1e3,
                "gbps": nbytes / med / 1e9,
                "mismatches": bad,
            }
            print(json.dumps(row), flush=True)
            out.append(row)
        del srcs, dst_ts
        torch.cuda.empty_cache()
    # the link's limit: one contiguous copy of 128 MiB, GPU 0 -> the destination GPU
    x = torch.empty(128 << 20, dtype=torch.uint8, device="cuda:0")
    y = torch.empty(128 << 20, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    times = []
    for _ in range(a.repeat):
        torch.cuda.synchronize(0)
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(dst_dev)
        times.append(time.perf_counter() - t0)
    peer = (128 << 20) / statistics.median(times) / 1e9
    print(f"peer copy 128 MiB GPU 0 -> {dst_dev}: {peer:.1f} GB/s")
    print(f"{'case':<12} {'order':<5} {'ms':>7} {'GB/s':>7} {'x peer':>7} {'bad':>4}")
    for r in out:
        print(
            f"{r['case']:<12} {r['order']:<5} {r['ms']:>7.3f} {r['gbps']:>7.1f} "
            f"{r['gbps'] / peer:>7.2f} {r['mismatches']:>4}"
        )
    if a.json:
        gpus = [torch.cuda.get_device_name(i) for i in range(n_gpu)]
        Path(a.json).write_text(
            json.dumps({"gpus": gpus, "peer_gbps": peer, "cells": out}, indent=1)
        )
    return 0 if all(r["mismatches"] == 0 for r in out) else 1


def want_dev(s: dict[str, Any]) -> str:
    """The device of a source's tensors."""
    return f"cuda:{s['dev']}"


if __name__ == "__main__":
    sys.exit(main())
