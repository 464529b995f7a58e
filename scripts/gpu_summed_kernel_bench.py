"""A checked page write's GPU time (issue 26 item 1): the copy alone, the copy with its sums
in a launch of their own on another stream (how prefill summed before ``summed_writes``), and
the summed kernel (copy and sums in one launch) at several sum tile sizes and program orders;
one process, the prefill pool on GPU 0, the decode pool on GPU 1 (peer access on, as
``cudaipc`` enables it).

The issue's model (32 layers x 8 KV heads x 128 dims, bf16, 16-token pages: 64 buffers of
32 KiB a page), whole pages (TP 1 -> 1) and head slices (TP 1 -> 2), 8 and 64 pages a chunk.
Each case: the fused sums equal the hasher's ``page_sums`` and what landed (summed on GPU 1)
equals them too (every byte); then the GPU time from an event before to an event after, on
the writer's stream, medians of ``--repeat`` launches (the two-stream case joins the sums'
stream back first), the stream held busy while the host enqueues (so host time is not
counted; a first version without that counted the launches' host time, ~0.15 ms).

    python3 scripts/gpu_summed_kernel_bench.py --json $OUT/summed_kernel.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvwire.config import KVWireConfig
from kvwire.descriptors import ADDR
from kvwire.integrity_device import DeviceRowHasher
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.movers.triton_pool_pages import PoolPageCopier
from kvwire.page_form import page_sides
from kvwire.session.handshake import build_mapper


def pool(model: ModelSpec, tp: int, rank: int, slots: int, dev: str) -> tuple[KVLayout, Any]:
    heads = model.total_kv_heads // tp
    shape = (slots, model.page_size, heads, model.head_dim)
    bufs = [
        torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16, device=dev).view(
            torch.bfloat16
        )
        for _ in range(2 * model.num_layers)
    ]
    return KVLayout.from_tensors(model, bufs, RankPosition(tp_size=tp, tp_rank=rank)), bufs


def timed(stream: Any, fn: Any, repeat: int) -> float:
    """Median GPU ms of ``fn()`` (which enqueues on ``stream``) over ``repeat`` calls. The
    stream first sleeps ~1 ms on the GPU, so the host enqueues ``fn``'s work before the
    first event fires: the events time the GPU's work, not the host's launch."""
    out = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def measure(
    a: Any, name: str, n: int, mapper: Any, tables: Any, sides: Any, hashers: Any, mover: Any,
    stream: Any, rng: Any, slots: int,
) -> dict[str, Any]:  # fmt: skip
    """One cell: a chunk of ``n`` random pages on link ``name``, checked and timed."""
    s_side, d_side = sides
    hasher, landed = hashers
    sp, dp = rng.permutation(slots)[:n], rng.permutation(slots)[:n]
    chunk = mapper.page_chunk(sp, dp)
    g = chunk.geometry
    sa = tables.src[g.src_rows, ADDR].astype(np.int64)
    da = tables.dst[g.dst_rows, ADDR].astype(np.int64)
    want = hasher.page_sums(s_side, sp, d_side, dp)
    lane = hasher._lane().stream  # where start() launches (this thread's lane)

    def copy() -> None:
        mover.copy_pages(chunk, sa, da, stream=stream)

    def sums_alone() -> None:
        lane.wait_stream(stream)
        hasher.sums_order(s_side, sp, d_side, dp).start()
        stream.wait_stream(lane)

    def two_streams() -> None:
        lane.wait_stream(stream)
        hasher.sums_order(s_side, sp, d_side, dp).start()
        mover.copy_pages(chunk, sa, da, stream=stream)
        stream.wait_stream(lane)

    orders: list[Any] = []

    def summed() -> None:
        order = hasher.sums_order(s_side, sp, d_side, dp)
        mover.copy_pages(chunk, sa, da, stream=stream, sums=order.take())
        order.launched(stream)
        orders.append(order)

    cell: dict[str, Any] = {"link": name, "pages": n, "mib": n * 2}
    cell["copy_ms"] = timed(stream, copy, a.repeat)
    cell["sums_alone_ms"] = timed(stream, sums_alone, a.repeat)
    cell["two_streams_ms"] = timed(stream, two_streams, a.repeat)
    for mix in a.orders.split(","):
        for block in (int(x) for x in a.blocks.split(",")):
            mover.sum_block, mover.sum_order = block, mix
            cell[f"summed_{mix}_{block}_ms"] = timed(stream, summed, a.repeat)
            got = orders[-1]()
            stream.synchronize()
            there = landed.page_sums(d_side, dp, d_side, dp)
            wrong = got != want or there != want or len(want) != 32
            cell[f"summed_{mix}_{block}_wrong"] = int(wrong)
    mover.sum_block, mover.sum_order = 1024, "alternate"
    # decode's check of what landed (a launch and a wait on its lane), host wall time: in a
    # loop, and after 1.5 ms asleep (as a request's check comes)
    for key, pause in (("check_host_ms", 0.0), ("check_host_after_sleep_ms", 0.0015)):
        walls = []
        for _ in range(a.repeat):
            time.sleep(pause)
            t0 = time.perf_counter()
            landed.page_sums(d_side, dp, d_side, dp)
            walls.append(1e3 * (time.perf_counter() - t0))
        cell[key] = statistics.median(walls)
    if a.profile:  # where decode's check spends its host time (a warm loop)
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            landed.page_sums(d_side, dp, d_side, dp)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(f"--- profile of 300 checks, {name}, {n} pages ---")
        print(out.getvalue()[:7000])
        a.profile = False  # the first cell only
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="8,64")
    ap.add_argument("--blocks", default="1024,256", help="sum tiles of the summed kernel")
    ap.add_argument("--orders", default="alternate,after,before", help="its program orders")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="cProfile decode's check")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    from kvwire_cudaipc._cuda import enable_peer_access

    enable_peer_access(0, 1)
    model = ModelSpec(num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    slots = 80
    rng = np.random.default_rng(5)
    mover = PoolPageCopier("cuda:0")
    stream = torch.cuda.Stream("cuda:0")
    report: dict[str, Any] = {"cells": []}
    bad = 0
    for name, tpd, rd in (("TP 1 -> 1", 1, 0), ("TP 1 -> 2", 2, 1)):
        src, keep_s = pool(model, 1, 0, slots, "cuda:0")
        dst, keep_d = pool(model, tpd, rd, slots, "cuda:1")
        mapper = build_mapper(KVWireConfig(), src, dst)
        tables = mapper.build_tables()
        s_side, d_side = page_sides(mapper.page_geometry, tables.src, tables.dst)
        hasher = DeviceRowHasher(src)
        landed = DeviceRowHasher(dst)
        for n in (int(x) for x in a.pages.split(",")):
            cell = measure(a, name, n, mapper, tables, (s_side, d_side), (hasher, landed), mover,
                           stream, rng, slots)  # fmt: skip
            bad += sum(v for k, v in cell.items() if k.endswith("_wrong"))
            report["cells"].append(cell)
            print(json.dumps(cell))
        del keep_s, keep_d
    print("SUMMED-KERNEL-OK" if not bad else f"SUMMED-KERNEL-BAD {bad}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
