"""How fast can one launch move whole KV pages from GPU 0 into GPU 1? A sweep of the page
mover's launch shape against a torch peer copy of the same bytes, one process, one call.

The model of issue 27 (32 layers x K/V = 64 buffers of 16-token pages, 8 KV heads x 128 dims
bf16: 32 KiB per buffer page, 2 MiB per page of the request), random source and destination
pages. ``kvwire``'s own :class:`~kvwire.movers.triton_pool_pages.PoolPageCopier` (today's
launch: one program of ``num_warps`` 4 per (buffer, page), 8 KiB steps, launched on the
source's GPU: stores over the link) runs beside a copy kernel of this script with the
variables a launch can choose:

- ``block``: bytes one step of a program moves (its loads in flight);
- ``warps``: warps per program;
- ``split``: programs per (buffer, page), each a contiguous part of the page (more programs
  in flight for small requests);
- ``side``: ``push`` launches on GPU 0 (local loads, stores over NVLink), ``pull`` on GPU 1
  (loads over NVLink, local stores);
- ``table``: where the launch's table (page lists, buffer addresses) lives: ``device`` memory
  or ``host`` (pinned, read by every program over PCIe, as kvwire's copier does to keep its
  launch to one call);
- ``align``: the pointers' alignment the kernel is told (16: vector accesses, 4: scalar).

Every variant is checked on the bytes it moved (destination poisoned first, every moved page
compared and one untouched page checked) before it is timed. Timing: a launch queue filled
behind a GPU sleep, then ``--launches`` launches back to back between two CUDA events on the
launching stream (the GPU's time per launch, host cost hidden); the peer copy the same way
on GPU 0's stream. Prints a table per size and the best variants, and writes JSON.

    python3 scripts/gpu_mover_tune.py --json $OUT/mover_tune.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from kvwire.descriptors import ADDR
from kvwire.index import EqualTPMapper
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.movers.triton_pool_pages import PoolPageCopier

MiB = 1 << 20
MODEL = ModelSpec(
    num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16, is_mla=False
)
PAGE_BYTES = MODEL.page_size * MODEL.total_kv_heads * MODEL.head_dim * 2  # 32 KiB per buffer


@triton.jit(do_not_specialize=["table_addr", "npages", "nbuf", "src_slot", "dst_slot", "n"])
def _tune_copy(  # type: ignore[no-untyped-def]
    table_addr,
    npages,
    nbuf,
    src_slot,
    dst_slot,
    n,
    block: tl.constexpr,
    split: tl.constexpr,
    align: tl.constexpr,
):
    # One program per (buffer, page, part): part p of split copies n // split int32 of the
    # page (n divides by split * 4: whole 16-byte vectors).
    table = table_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    part = pid % split
    q = pid // split
    b = q // npages
    i = q - b * npages
    sp = tl.load(table + i)
    dp = tl.load(table + npages + i)
    sa = tl.load(table + 2 * npages + b)
    da = tl.load(table + 2 * npages + nbuf + b)
    m = (n // 4 // split) * 4
    src = tl.multiple_of(sa.to(tl.pointer_type(tl.int32)) + sp * src_slot + part * m, align)
    dst = tl.multiple_of(da.to(tl.pointer_type(tl.int32)) + dp * dst_slot + part * m, align)
    offs = tl.arange(0, block)
    for start in range(0, m, block):
        o = start + offs
        mask = o < m
        tl.store(dst + o, tl.load(src + o, mask=mask), mask=mask)


def pools(slots: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (slots, MODEL.page_size, MODEL.total_kv_heads, MODEL.head_dim)
    src = [
        torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16, device="cuda:0")
        for _ in range(2 * MODEL.num_layers)
    ]
    dst = [torch.empty(shape, dtype=torch.int16, device="cuda:1") for _ in src]
    return src, dst


def gpu_time(dev: int, launch: Any, launches: int) -> float:
    """Median over 3 trials of the GPU's µs per launch of ``launch`` (launches queued behind
    a sleep so the host's launch cost stays hidden)."""
    per = []
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        for _ in range(3):
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(20_000_000)  # ~10 ms at H100 clocks: room to queue every launch
            a.record(stream)
            for _ in range(launches):
                launch()
            b.record(stream)
            b.synchronize()
            per.append(a.elapsed_time(b) * 1e3 / launches)
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,128,512", help="MiB per request")
    ap.add_argument("--blocks", default="8", help="KiB per program step")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--splits", default="1,2")
    ap.add_argument("--sides", default="push")
    ap.add_argument("--tables", default="device,host")
    ap.add_argument("--aligns", default="16,4")
    ap.add_argument(
        "--launches",
        type=int,
        default=12,
        help="timed launches (kvwire's copier has 16 table slots: more would wait for a slot)",
    )
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    from kvwire_cudaipc._cuda import enable_peer_access

    enable_peer_access(0, 1)
    enable_peer_access(1, 0)
    sizes = [int(x) for x in a.sizes.split(",")]
    page_mib = 2 * MODEL.num_layers * PAGE_BYTES / MiB
    slots = int(max(sizes) / page_mib) * 2 + 4
    src, dst = pools(slots)
    nbuf = len(src)
    s_addr = np.array([t.data_ptr() for t in src], np.int64)
    d_addr = np.array([t.data_ptr() for t in dst], np.int64)
    rng = np.random.default_rng(5)
    tables: dict[int, dict[int, torch.Tensor]] = {0: {}, 1: {}}  # device -> size -> table
    host_tables: dict[int, torch.Tensor] = {}  # size -> pinned table
    rows: list[dict[str, Any]] = []
    one = RankPosition(tp_size=1, tp_rank=0)
    mapper = EqualTPMapper(
        KVLayout.from_tensors(MODEL, [t.view(torch.bfloat16) for t in src], one),
        KVLayout.from_tensors(MODEL, [t.view(torch.bfloat16) for t in dst], one),
    )
    mt = mapper.build_tables()
    s_all, d_all = mt.src[:, ADDR].astype(np.int64), mt.dst[:, ADDR].astype(np.int64)
    copier = PoolPageCopier(0)
    variants = list(
        itertools.product(
            a.sides.split(","),
            [int(x) for x in a.blocks.split(",")],
            [int(x) for x in a.warps.split(",")],
            [int(x) for x in a.splits.split(",")],
            a.tables.split(","),
            [int(x) for x in a.aligns.split(",")],
        )
    )

    def one_size(mib: int) -> None:
        npages = int(mib / page_mib)
        sp = rng.permutation(slots)[:npages].astype(np.int64)
        dp = rng.permutation(slots)[:npages].astype(np.int64)
        untouched = int(np.setdiff1d(np.arange(slots), dp)[0])
        table = np.concatenate([sp, dp, s_addr, d_addr]).astype(np.int64)
        for d in (0, 1):
            tables[d][mib] = torch.from_numpy(table).to(f"cuda:{d}")
        host_tables[mib] = torch.from_numpy(table).pin_memory()
        moved = npages * nbuf * PAGE_BYTES
        spt0 = torch.from_numpy(sp).to("cuda:0")
        dpt1 = torch.from_numpy(dp).to("cuda:1")

        def check() -> int:
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            bad = 0
            for s, t in zip(src, dst, strict=True):
                bad += int((s[spt0].to("cuda:1") != t[dpt1]).sum())
                bad += int((t[untouched] != -1).sum())
            return bad

        def poison() -> None:
            for t in dst:
                t.fill_(-1)
            torch.cuda.synchronize(1)

        chunk = mapper.page_chunk(sp, dp)
        assert chunk is not None
        g = chunk.geometry
        cs, cd = s_all[g.src_rows], d_all[g.dst_rows]

        def kvwire_launch() -> None:
            copier.copy_pages(chunk, cs, cd)

        poison()
        kvwire_launch()
        kv_bad = check()
        kv_us = gpu_time(0, kvwire_launch, a.launches)
        flat_s = torch.empty(moved // 2, dtype=torch.int16, device="cuda:0")
        flat_d = torch.empty_like(flat_s, device="cuda:1")
        peer_us = gpu_time(0, lambda: flat_d.copy_(flat_s), a.launches)
        base = {"mib": mib, "moved_mib": moved / MiB, "peer_gbps": moved / peer_us / 1e3}
        rows.append({**base, "variant": "kvwire", "bad": kv_bad, "us": kv_us,
                     "gbps": moved / kv_us / 1e3})  # fmt: skip
        print(f"\n## {mib} MiB ({npages} pages x {nbuf} buffers of 32 KiB)", flush=True)
        print(f"peer copy {peer_us:.0f} us = {moved / peer_us / 1e3:.1f} GB/s", flush=True)
        print(f"kvwire PoolPageCopier {kv_us:.0f} us = {moved / kv_us / 1e3:.1f} GB/s "
              f"({kv_us and peer_us / kv_us:.2f}x peer), bad {kv_bad}", flush=True)  # fmt: skip
        for side, kib, warps, split, where, align in variants:
            dev = 0 if side == "push" else 1
            block = kib * 1024 // 4
            tab = tables[dev][mib] if where == "device" else host_tables[mib]
            grid = (nbuf * npages * split,)
            n = PAGE_BYTES // 4

            def launch(tab: Any = tab, grid: Any = grid, n: int = n, block: int = block,
                       split: int = split, warps: int = warps, dev: int = dev,
                       align: int = align) -> None:  # fmt: skip
                with torch.cuda.device(dev):
                    _tune_copy[grid](
                        tab.data_ptr(), npages, nbuf, n, n, n, block=block, split=split,
                        align=align, num_warps=warps,
                    )  # fmt: skip

            t0 = time.perf_counter()
            poison()
            try:
                launch()
                bad = check()
            except Exception as exc:  # a shape the compiler refuses: recorded, not fatal
                print(f"{side} {where} a{align} b{kib}K w{warps} s{split}: {exc}", flush=True)
                continue
            us = gpu_time(dev, launch, a.launches)
            name = f"{side} {where} a{align} b{kib}K w{warps} s{split}"
            row = {**base, "variant": name, "side": side, "table": where, "align": align,
                   "block_kib": kib, "warps": warps, "split": split, "bad": bad, "us": us,
                   "gbps": moved / us / 1e3, "x_peer": peer_us / us,
                   "first_s": time.perf_counter() - t0}  # fmt: skip
            rows.append(row)
            print(f"{row['variant']:<34} {us:8.0f} us {row['gbps']:7.1f} GB/s "
                  f"{row['x_peer']:.2f}x peer  bad {bad}", flush=True)  # fmt: skip

    for mib in sizes:
        one_size(mib)
    print("\n| MiB | peer GB/s | kvwire today | best variant | best GB/s (x peer) | 2nd | 3rd |")
    print("| ---: | ---: | ---: | --- | ---: | --- | --- |")
    for mib in sizes:
        rs = [r for r in rows if r["mib"] == mib and r["variant"] != "kvwire" and r["bad"] == 0]
        kv = next(r for r in rows if r["mib"] == mib and r["variant"] == "kvwire")
        rs.sort(key=lambda r: -r["gbps"])
        if not rs:
            continue
        top = rs[0]
        print(f"| {mib} | {kv['peer_gbps']:.1f} | {kv['gbps']:.1f} | {top['variant']} | "
              f"{top['gbps']:.1f} ({top['x_peer']:.2f}x) | "
              + " | ".join(f"{r['variant']} {r['gbps']:.0f}" for r in rs[1:3]) + " |")  # fmt: skip
    bad = sum(r["bad"] for r in rows)
    print("summary", "verified" if bad == 0 else f"MISMATCH {bad}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "gpus": [torch.cuda.get_device_name(i) for i in (0, 1)]}, f)


if __name__ == "__main__":
    main()
