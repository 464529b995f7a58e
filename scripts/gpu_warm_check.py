"""The page mover's warm-up (``PoolPageCopier.warm``, run by ``cudaipc``'s lane at a link's
handshake), and bulk staging's (``KVTensors.warm``), on two GPUs: a link's first writes
(gathers and scatters) with and without it, each in a fresh process
with an empty Triton cache (a fresh host), one run.

For each link shape (TP 1 -> 1 whole pages, TP 2 -> 1 and TP 1 -> 2 head slices, head-major
decode pages: the tiled kernel), a child process builds the pools of the issue-27 model
(``scripts/gpu_pool_page_check.py``'s), then ``cold``: launches the link's first batch (two
one-page chunks, ``copy_batch``) and first single chunk (eight pages, ``copy_pages``), each
synchronised and timed; ``warm``: calls ``warm`` first (timed), then the same. It checks
every moved element of both writes (and that the rest of decode's pool is untouched) and
counts the kernel variants compiled by the writes themselves: none is the warm-up's claim.

    python3 scripts/gpu_warm_check.py --json $OUT/warm.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SHAPES = ("TP 1 -> 1", "TP 2 -> 1", "TP 1 -> 2", "head-major decode")


def _child(shape: str, mode: str) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_pool_page_check import MODEL, pool  # type: ignore[import-not-found]

    from kvwire.descriptors import ADDR
    from kvwire.index import EqualTPMapper, HeadSliceMapper
    from kvwire.index.head_rows import HeadRowsMapper
    from kvwire.layout import KVLayout, RankPosition
    from kvwire.movers.triton_pool_pages import PoolPageCopier
    from kvwire_cudaipc._cuda import enable_peer_access

    enable_peer_access(0, 1)
    slots = 32
    tps, tpd, rs, rd = {
        "TP 1 -> 1": (1, 1, 0, 0),
        "TP 2 -> 1": (2, 1, 1, 0),
        "TP 1 -> 2": (1, 2, 0, 1),
        "head-major decode": (1, 1, 0, 0),
    }[shape]
    src, sbufs = pool(0, tps, rs, slots, None)
    dst, dbufs = pool(1, tpd, rd, slots, -1)
    if shape == "head-major decode":  # decode's buffers [slot, head, token, dim]
        heads = MODEL.total_kv_heads
        dbufs = [
            torch.full(
                (slots, heads, MODEL.page_size, MODEL.head_dim), -1, dtype=torch.int16,
                device="cuda:1",
            ).view(torch.bfloat16)
            for _ in dbufs
        ]  # fmt: skip
        dst = KVLayout.from_tensors(MODEL, dbufs, RankPosition(), head_major=True)
    if shape == "head-major decode":
        mapper: Any = HeadRowsMapper(src, dst)
    else:
        mapper = EqualTPMapper(src, dst) if tps == tpd else HeadSliceMapper(src, dst)
    tables = mapper.build_tables()
    s_all, d_all = tables.src[:, ADDR].astype(np.int64), tables.dst[:, ADDR].astype(np.int64)
    g = mapper.page_geometry
    assert g is not None, f"{shape}: no page geometry"
    sa, da = s_all[g.src_rows], d_all[g.dst_rows]
    mover = PoolPageCopier(0)
    out: dict[str, Any] = {"shape": shape, "mode": mode, "heads": g.heads}
    if mode == "warm":
        t0 = time.perf_counter()
        out["warm_compiled"] = mover.warm(g, sa, da)
        out["warm_s"] = round(time.perf_counter() - t0, 3)
    before = len(mover._kernels.kernels())
    rng = np.random.default_rng(5)
    perm = rng.permutation(slots)
    sp, dp = perm[:10].astype(np.int64), rng.permutation(slots)[:10].astype(np.int64)
    batch = [mapper.page_chunk(sp[i : i + 1], dp[i : i + 1]) for i in (0, 1)]
    single = mapper.page_chunk(sp[2:], dp[2:])
    for name, fn in (
        ("first_batch_ms", lambda: mover.copy_batch([(c, sa, da) for c in batch])),
        ("first_single_ms", lambda: mover.copy_pages(single, sa, da)),
    ):
        torch.cuda.synchronize(0)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(0)
        out[name] = round(1e3 * (time.perf_counter() - t0), 2)
    out["variants_compiled_by_writes"] = len(mover._kernels.kernels()) - before
    torch.cuda.synchronize(1)
    # every element moved: decode's view of each pair's buffer against prefill's rows
    spt, dpt = torch.from_numpy(sp).cuda(0), torch.from_numpy(dp).cuda(1)
    rest = torch.ones(slots, dtype=torch.bool, device="cuda:1")
    rest[dpt] = False
    hetero = tps != tpd or shape == "head-major decode"
    h0 = mapper.src_start if hetero else 0
    nh = mapper.num_heads if hetero else MODEL.total_kv_heads // tps
    g0 = mapper.dst_start if hetero else 0
    bad = 0
    for k in range(mapper.num_pairs):
        sb = sbufs[int(mapper.src_buf[k])].view(torch.int16)
        db = dbufs[int(mapper.dst_buf[k])].view(torch.int16)
        got = db[dpt]
        if shape == "head-major decode":
            got = got.transpose(1, 2)  # [page, token, head, dim]
        want = sb[spt][:, :, h0 : h0 + nh].to("cuda:1")
        bad += int((want != got[:, :, g0 : g0 + nh]).sum())
        bad += int((got[:, :, :g0] != -1).sum() + (got[:, :, g0 + nh :] != -1).sum())
        bad += int((db[rest] != -1).sum())
    out["bad_elements"] = bad
    return out


STAGED = ("staged whole rows", "staged head slice")


def _staged_child(shape: str, mode: str) -> dict[str, Any]:
    """Bulk staging's gather (prefill) then scatter (decode) of one chunk through
    ``KVTensors.move_block``, cold or after ``KVTensors.warm`` (both on GPU 0: the movers
    are one GPU's), every byte of the block and of the scattered pages checked."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_pool_page_check import MODEL, pool

    from kvwire.staging.kernels import KVTensors

    slots, ps = 32, MODEL.page_size
    src, sbufs = pool(0, 1, 0, slots, None)
    dst, dbufs = pool(0, 1, 0, slots, -1)
    kv, kv2 = KVTensors(src, sbufs), KVTensors(dst, dbufs)
    row = src.token_row_bytes
    lo, hi = (0, row) if shape == "staged whole rows" else (row // 2, row)
    bufs = np.arange(len(src.buffers), dtype=np.int64)
    out: dict[str, Any] = {"shape": shape, "mode": mode}
    if mode == "warm":
        t0 = time.perf_counter()
        n = kv.warm(bufs, lo, hi, ps, to_pool=False) + kv2.warm(bufs, lo, hi, ps, to_pool=True)
        out["warm_compiled"], out["warm_s"] = n, round(time.perf_counter() - t0, 3)
    before = len(kv.moves.copier._kernels.kernels()) + len(kv2.moves.copier._kernels.kernels())  # type: ignore[union-attr]
    rng = np.random.default_rng(7)
    sp = rng.permutation(slots)[:8].astype(np.int64)
    dp = rng.permutation(slots)[:8].astype(np.int64)
    mem = torch.zeros(bufs.size * sp.size * ps * (hi - lo), dtype=torch.uint8, device="cuda:0")
    for name, fn in (
        ("first_gather_ms", lambda: kv.move_block(bufs, sp, lo, hi, mem, 0, ps, to_pool=False)),
        ("first_scatter_ms", lambda: kv2.move_block(bufs, dp, lo, hi, mem, 0, ps, to_pool=True)),
    ):
        torch.cuda.synchronize(0)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(0)
        out[name] = round(1e3 * (time.perf_counter() - t0), 2)
    after = len(kv.moves.copier._kernels.kernels()) + len(kv2.moves.copier._kernels.kernels())  # type: ignore[union-attr]
    out["variants_compiled_by_writes"] = after - before
    block = mem.view(bufs.size, sp.size, ps, hi - lo)
    spt, dpt = torch.from_numpy(sp).cuda(0), torch.from_numpy(dp).cuda(0)
    bad = 0
    for b in range(bufs.size):
        s_rows = sbufs[b].view(torch.uint8).reshape(slots, ps, row)
        d_rows = dbufs[b].view(torch.uint8).reshape(slots, ps, row)
        bad += int((block[b] != s_rows[spt][:, :, lo:hi]).sum())
        bad += int((d_rows[dpt][:, :, lo:hi] != s_rows[spt][:, :, lo:hi]).sum())
        bad += int((d_rows[dpt][:, :, :lo] != 255).sum())  # -1 int16: bytes of 0xff
    out["bad_elements"] = bad
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default=",".join(SHAPES + STAGED))
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.child:
        shape, mode = a.child
        run = _staged_child if shape in STAGED else _child
        print(json.dumps(run(shape, mode)), flush=True)
        return 0
    rows: list[dict[str, Any]] = []
    for shape in a.shapes.split(","):
        for mode in ("cold", "warm"):
            with tempfile.TemporaryDirectory() as cache:  # an empty Triton cache: a fresh host
                env = {**os.environ, "TRITON_CACHE_DIR": cache}
                cmd = [sys.executable, __file__, "--child", shape, mode]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode:
                print(done.stdout, done.stderr, file=sys.stderr)
                rows.append({"shape": shape, "mode": mode, "error": done.stderr[-2000:]})
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(row, flush=True)
    ok = all(
        "error" not in r
        and r["bad_elements"] == 0
        and (r["mode"] == "cold" or r["variants_compiled_by_writes"] == 0)
        for r in rows
    )
    print(
        "| link | cold: first batch (gather) / single (scatter) ms | warm-up s | warm: the same |"
    )
    print("| --- | --- | ---: | --- |")
    for shape in a.shapes.split(","):
        c = next((r for r in rows if r["shape"] == shape and r["mode"] == "cold"), {})
        w = next((r for r in rows if r["shape"] == shape and r["mode"] == "warm"), {})
        first = ("first_gather_ms", "first_scatter_ms") if shape in STAGED else (
            "first_batch_ms", "first_single_ms")  # fmt: skip
        print(
            f"| {shape} | {c.get(first[0])} / {c.get(first[1])} | "
            f"{w.get('warm_s')} ({w.get('warm_compiled')} variants) | "
            f"{w.get(first[0])} / {w.get(first[1])} |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "ok": ok}, indent=1))
    print("verified, no compile at a warmed link's first writes" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
