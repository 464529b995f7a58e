"""The pool-to-pool page mover (cudaipc's page writes) on two GPUs of one process: checked
byte for byte, then timed beside the run mover it replaces and a torch peer copy, one run.

The model of issue 27 (32 layers x K/V = 64 buffers, 16-token pages, 8 KV heads x 128 dims
bf16: 2 KiB token rows, 32 KiB per buffer page). Pools are built as kvwire layouts, the real
mapper gives the chunk's page form (:meth:`IndexMapper.page_chunk`), and the source pool
on GPU 0 is copied into the destination pool on GPU 1 (peer access on) for three links:
equal TP (whole pages), TP 2 -> 1 (a prefill rank's 1 KiB rows into half of decode's 2 KiB
rows) and TP 1 -> 2 (half of prefill's rows into a decode rank's 1 KiB rows). It

1. checks every byte of every moved page, and that no other byte of the destination pool
   changed (poisoned first);
2. times, side by side (medians of ``--repeat``, synchronised): the page mover (host part:
   ``page_chunk``, two gathers of per-pair addresses, the launch), the run mover as the
   backend used it before (``map_chunk``, three gathers of per-row addresses, ``move``),
   and a torch peer copy of as many contiguous bytes.

    python3 scripts/gpu_pool_page_check.py --json $OUT/pool_pages.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvwire.descriptors import ADDR, LEN
from kvwire.index import EqualTPMapper, HeadSliceMapper
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.movers.triton_copy import RunCopier
from kvwire.movers.triton_pool_pages import PoolPageCopier

MiB = 1 << 20
MODEL = ModelSpec(
    num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16, is_mla=False
)


def pool(dev: int, tp: int, rank: int, slots: int, fill: int | None) -> tuple[KVLayout, list[Any]]:
    heads = MODEL.total_kv_heads // tp
    shape = (slots, MODEL.page_size, heads, MODEL.head_dim)
    bufs = []
    for _ in range(2 * MODEL.num_layers):
        if fill is None:
            t = torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16, device=f"cuda:{dev}")
        else:
            t = torch.full(shape, fill, dtype=torch.int16, device=f"cuda:{dev}")
        bufs.append(t.view(torch.bfloat16))
    return KVLayout.from_tensors(MODEL, bufs, RankPosition(tp_size=tp, tp_rank=rank)), bufs


def _wall(fn: Any, repeat: int, devs: tuple[int, int]) -> tuple[float, float]:
    """Median host µs of ``fn`` and median wall µs to its completion (both GPUs synced)."""
    host, wall = [], []
    for _ in range(repeat):
        for d in devs:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        for d in devs:
            torch.cuda.synchronize(d)
        host.append((t1 - t0) * 1e6)
        wall.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(host), statistics.median(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,128", help="MiB per request on the decode side")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    from kvwire_cudaipc._cuda import enable_peer_access

    enable_peer_access(0, 1)
    sizes = [int(x) for x in a.sizes.split(",")]
    page_mib = 2 * MODEL.num_layers * MODEL.page_size * 2048 / MiB  # 2 MiB per page
    slots = int(2 * max(sizes) / page_mib) + 4
    rng = np.random.default_rng(11)
    pages_mover, runs_mover = PoolPageCopier(0), RunCopier(0)
    out: list[dict[str, Any]] = []
    for name, (tps, tpd, rs, rd) in {
        "TP 1 -> 1": (1, 1, 0, 0),
        "TP 2 -> 1": (2, 1, 1, 0),
        "TP 1 -> 2": (1, 2, 0, 1),
    }.items():
        src, sbufs = pool(0, tps, rs, slots, None)
        dst, dbufs = pool(1, tpd, rd, slots, -1)
        mapper = EqualTPMapper(src, dst) if tps == tpd else HeadSliceMapper(src, dst)
        tables = mapper.build_tables()
        s_all, d_all = tables.src[:, ADDR].astype(np.int64), tables.dst[:, ADDR].astype(np.int64)
        lens = tables.src[:, LEN].astype(np.int64)
        for mib in sizes:
            npages = int(mib / page_mib)
            sp = rng.permutation(slots)[:npages].astype(np.int64)
            dp = rng.permutation(slots)[:npages].astype(np.int64)

            def page_move(sp: Any = sp, dp: Any = dp, mapper: Any = mapper, s_all: Any = s_all,
                          d_all: Any = d_all) -> None:  # fmt: skip
                chunk = mapper.page_chunk(sp, dp)
                assert chunk is not None
                g = chunk.geometry
                pages_mover.copy_pages(chunk, s_all[g.src_rows], d_all[g.dst_rows])

            def run_move(sp: Any = sp, dp: Any = dp, mapper: Any = mapper, s_all: Any = s_all,
                         d_all: Any = d_all, lens: Any = lens) -> None:  # fmt: skip
                si, di = mapper.map_chunk(sp, dp)
                runs_mover.move(s_all[si], d_all[di], lens[si])

            checks = {}
            for label, fn in (("pages", page_move), ("runs", run_move)):
                for b in dbufs:
                    b.view(torch.int16).fill_(-1)
                torch.cuda.synchronize(1)
                fn()
                torch.cuda.synchronize(0)
                bad = 0
                spt, dpt = torch.from_numpy(sp).cuda(0), torch.from_numpy(dp).cuda(1)
                rest = torch.ones(slots, dtype=torch.bool, device="cuda:1")
                rest[dpt] = False
                hetero = tps != tpd
                h0 = mapper.src_start if hetero else 0
                nh = mapper.num_heads if hetero else MODEL.total_kv_heads // tps
                g0 = mapper.dst_start if hetero else 0
                for k in range(mapper.num_pairs):
                    sb = sbufs[int(mapper.src_buf[k])].view(torch.int16)
                    db = dbufs[int(mapper.dst_buf[k])].view(torch.int16)
                    got = db[dpt]
                    bad += int(
                        (sb[spt][:, :, h0 : h0 + nh].to("cuda:1") != got[:, :, g0 : g0 + nh]).sum()
                    )
                    bad += int((got[:, :, :g0] != -1).sum() + (got[:, :, g0 + nh :] != -1).sum())
                    bad += int((db[rest] != -1).sum())  # other pages untouched
                checks[label] = bad
            moved = mapper.page_chunk(sp, dp).nbytes  # type: ignore[union-attr]
            flat_s = torch.empty(moved // 2, dtype=torch.int16, device="cuda:0")
            flat_d = torch.empty_like(flat_s, device="cuda:1")
            ph, pw = _wall(page_move, a.repeat, (0, 1))
            rh, rw = _wall(run_move, a.repeat, (0, 1))
            _, cw = _wall(lambda fs=flat_s, fd=flat_d: fd.copy_(fs), a.repeat, (0, 1))
            row = {
                "link": name, "mib": mib, "moved_mib": moved / MiB, "bad_pages": checks["pages"],
                "bad_runs": checks["runs"], "page_host_us": ph, "page_wall_us": pw,
                "run_host_us": rh, "run_wall_us": rw, "peer_wall_us": cw,
                "page_gbps": moved / pw / 1e3, "run_gbps": moved / rw / 1e3,
                "peer_gbps": moved / cw / 1e3,
            }  # fmt: skip
            out.append(row)
            print(
                f"| {name} | {mib} | {moved / MiB:.0f} | {ph:.0f} / {rh:.0f} | {pw:.0f} / {rw:.0f} "
                f"| {row['page_gbps']:.0f} / {row['run_gbps']:.0f} / {row['peer_gbps']:.0f} | "
                f"{checks['pages']} / {checks['runs']} |",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cases": out, "gpus": [torch.cuda.get_device_name(i) for i in (0, 1)]}, f)
    print(
        "verified" if all(r["bad_pages"] == 0 and r["bad_runs"] == 0 for r in out) else "MISMATCH"
    )


if __name__ == "__main__":
    main()
