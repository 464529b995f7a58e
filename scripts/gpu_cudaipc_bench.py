"""Same-host GPU -> GPU KV moves: kvwire over ``cudaipc`` against the link's limit, one run.

Prefill on GPU 0 and decode on GPU 1, the model of issue 27 (32 layers x 8 KV heads x 128
dims bf16, 16-token pages: a page is 2 MiB in 64 runs of 32 KiB, one per layer and K/V; the
harness encodes elements as int32, so it uses 64 int32 dims per head: the same bytes per
run). Phases, every one on fresh random data with the destination poisoned first:

1. **mover check** (this process): the fused Triton mover copies random run lists of every
   element width (1-16 bytes) inside GPU 0 and from GPU 0 into GPU 1 (peer access);
   every byte compared with the CPU reference mover.
2. **mover vs peer copy** (this process): page runs of 2/16/128/512 MiB from a GPU 0 pool
   into random pages of a GPU 1 pool with one mover launch, against ``torch`` copying the same
   number of contiguous bytes GPU 0 -> GPU 1 (the link's limit); CUDA-event medians, every
   run's bytes checked once.
3. **engine API** (:class:`kvwire.testing.cluster.Cluster`: a prefill and a decode rank
   process on GPU 0 and GPU 1 (the harness's ``gpus`` round robin), ``KVManager``
   sender/receiver, the ``cudaipc`` backend): verified requests of
   every size (two chunks, every element and aux row checked on decode), then timed requests
   at each concurrency: GB/s over the wall time of the batch and p50 latency (decode's
   receiver creation to Success).
4. with ``--nixl-json``: raw per-page NIXL figures from ``python -m kvwire_nixl.gpu_bench``
   (same process pair and descriptor size) are merged into the table.

    python3 scripts/gpu_cudaipc_bench.py --json $OUT/cudaipc_bench.json

``--device cpu`` runs phase 3 on host memory (the backend's host path) for a dry run.
"""

from __future__ import annotations

import argparse
import json
import platform
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
RUN = 32 << 10  # bytes per (layer, K/V, page) run
RUNS_PER_PAGE = 64  # 32 layers x K/V


def log(line: str) -> None:
    print(line, flush=True)


# ----------------------------------------------------------------------------- phase 1
def mover_check(devices: tuple[int, int]) -> list[dict[str, Any]]:
    """Random run lists of every width, GPU 0 -> GPU 0 and GPU 0 -> GPU 1, byte-checked."""
    import torch

    from kvwire.movers import copy_runs_reference
    from kvwire.movers.triton_copy import RunCopier
    from kvwire_cudaipc import _cuda

    src_dev, dst_dev = devices
    _cuda.enable_peer_access(src_dev, dst_dev)
    rng = np.random.default_rng(11)
    out = []
    span = 8 * MiB
    copier = RunCopier(src_dev, tile_bytes=16 << 10)  # many tiles per run
    for dev in (src_dev, dst_dev):
        for align in (16, 8, 4, 2, 1):
            src = torch.randint(0, 256, (span,), dtype=torch.uint8, device=f"cuda:{src_dev}")
            dst = torch.randint(0, 256, (span,), dtype=torch.uint8, device=f"cuda:{dev}")
            count = 700
            slot = span // 1024
            s = rng.permutation(1024)[:count] * slot + align
            d = rng.permutation(1024)[:count] * slot + 3 * align
            n = rng.integers(1, (slot - 4 * align) // align, count) * align
            mem = np.concatenate([src.cpu().numpy(), dst.cpu().numpy()])
            copy_runs_reference(mem, s, d + span, n)
            plan = copier.copy(s + src.data_ptr(), d + dst.data_ptr(), n)
            torch.cuda.synchronize(src_dev)
            ok = bool(np.array_equal(dst.cpu().numpy(), mem[span:]))
            asm = getattr(copier.last_kernel, "asm", {}) or {}
            ptx = asm.get("ptx", "")
            vec = "v4.b32" if "st.global.v4.b32" in ptx else ("v2" if ".v2." in ptx else "scalar")
            ok_src = bool(np.array_equal(src.cpu().numpy(), mem[:span]))
            out.append(
                {
                    "dst": f"cuda:{dev}",
                    "align": align,
                    "width": plan.width,
                    "tiles": plan.num_tiles,
                    "bytes": int(n.sum()),
                    "ok": ok and ok_src,
                    "stores": vec,
                }
            )
            log(f"mover check cuda:{src_dev}->cuda:{dev} align {align}: {out[-1]}")
            assert ok and ok_src, out[-1]
    return out


# ----------------------------------------------------------------------------- phase 2
def page_runs(
    src_base: int, dst_base: int, slots: int, src_pages: np.ndarray, dst_pages: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of ``pages`` in pools ``[64 buffers, slots, 32 KiB]``: buffer-major, as the
    mappers order them."""
    buf = np.repeat(np.arange(RUNS_PER_PAGE, dtype=np.int64), src_pages.size)
    sp = np.tile(src_pages, RUNS_PER_PAGE)
    dp = np.tile(dst_pages, RUNS_PER_PAGE)
    src = src_base + (buf * slots + sp) * RUN
    dst = dst_base + (buf * slots + dp) * RUN
    return src, dst, np.full(src.size, RUN, dtype=np.int64)


def _events_ms(fn: Any, repeat: int, device: int) -> list[float]:
    import torch

    times = []
    for _ in range(repeat):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record(torch.cuda.current_stream(device))
        fn()
        b.record(torch.cuda.current_stream(device))
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def mover_vs_peer(sizes_mib: list[int], devices: tuple[int, int], repeat: int) -> list[dict]:
    """One mover launch of page runs GPU0 -> GPU1 vs a torch peer copy of as many contiguous
    bytes; also the host-side time of planning + launching."""
    import torch

    from kvwire.movers.triton_copy import RunCopier

    s_dev, d_dev = devices
    pages_max = max(sizes_mib) * MiB // (RUN * RUNS_PER_PAGE)
    slots = 2 * pages_max
    nbytes_pool = RUNS_PER_PAGE * slots * RUN
    torch.cuda.set_device(s_dev)
    src_pool = torch.randint(
        -(2**31), 2**31 - 1, (nbytes_pool // 4,), dtype=torch.int32, device=f"cuda:{s_dev}"
    )
    dst_pool = torch.full((nbytes_pool // 4,), -1, dtype=torch.int32, device=f"cuda:{d_dev}")
    flat_src = torch.randint(
        0, 1 << 30, (max(sizes_mib) * MiB // 4,), dtype=torch.int32, device=f"cuda:{s_dev}"
    )
    flat_dst = torch.empty_like(flat_src, device=f"cuda:{d_dev}")
    copier = RunCopier(s_dev)
    rng = np.random.default_rng(5)
    out = []
    for mib in sizes_mib:
        pages = mib * MiB // (RUN * RUNS_PER_PAGE)
        sp = rng.permutation(slots)[:pages].astype(np.int64)
        dp = rng.permutation(slots)[:pages].astype(np.int64)
        s, d, n = page_runs(src_pool.data_ptr(), dst_pool.data_ptr(), slots, sp, dp)
        dst_pool.fill_(-1)
        torch.cuda.synchronize(d_dev)  # the fill runs on GPU 1's stream, the mover on GPU 0's
        copier.copy(s, d, n)
        torch.cuda.synchronize(s_dev)
        # check: every page of every buffer landed where it should
        sv = src_pool.view(RUNS_PER_PAGE, slots, RUN // 4)
        dv = dst_pool.view(RUNS_PER_PAGE, slots, RUN // 4)
        ok = bool(
            torch.equal(
                sv[:, torch.from_numpy(sp).to(sv.device)].to(dv.device),
                dv[:, torch.from_numpy(dp).to(dv.device)],
            )
        )
        untouched = torch.ones(slots, dtype=torch.bool, device=dv.device)
        untouched[torch.from_numpy(dp).to(dv.device)] = False
        ok = ok and bool((dv[:, untouched] == -1).all())
        words = mib * MiB // 4
        mover_ms = _events_ms(lambda s=s, d=d, n=n: copier.copy(s, d, n), repeat, s_dev)
        host_us = []
        for _ in range(repeat):
            torch.cuda.synchronize(s_dev)
            t = time.perf_counter()
            copier.copy(s, d, n)
            host_us.append((time.perf_counter() - t) * 1e6)
            torch.cuda.synchronize(s_dev)
        wall_ms = []
        for _ in range(repeat):
            torch.cuda.synchronize(s_dev)
            t = time.perf_counter()
            copier.copy(s, d, n)
            torch.cuda.synchronize(s_dev)
            wall_ms.append((time.perf_counter() - t) * 1e3)
        gpu_ms = []  # GPU time alone: a sleep kernel holds the stream while the host launches
        for _ in range(repeat):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(3_000_000)
            start.record()
            copier.copy(s, d, n)
            end.record()
            end.synchronize()
            gpu_ms.append(start.elapsed_time(end))
        from kvwire.movers import plan_tiles
        from kvwire.movers.triton_copy import launch_plan

        plan_us, launch_us = [], []
        for _ in range(repeat):
            torch.cuda.synchronize(s_dev)
            t = time.perf_counter()
            plan = plan_tiles(s, d, n)
            t1 = time.perf_counter()
            launch_plan(plan, s_dev)
            t2 = time.perf_counter()
            plan_us.append((t1 - t) * 1e6)
            launch_us.append((t2 - t1) * 1e6)
        peer_ms = _events_ms(lambda w=words: flat_dst[:w].copy_(flat_src[:w]), repeat, s_dev)
        ok_peer = bool(torch.equal(flat_dst[:words].to(f"cuda:{s_dev}"), flat_src[:words]))
        nb = mib * MiB
        row = {
            "mib": mib,
            "runs": int(n.size),
            "verified": ok and ok_peer,
            "mover_gbps": nb / statistics.median(mover_ms) / 1e6,
            "mover_wall_gbps": nb / statistics.median(wall_ms) / 1e6,
            "mover_host_us": statistics.median(host_us),
            "plan_us": statistics.median(plan_us),
            "gpu_only_gbps": nb / statistics.median(gpu_ms) / 1e6,
            "upload_launch_us": statistics.median(launch_us),
            "mover_wall_ms": statistics.median(wall_ms),
            "peer_gbps": nb / statistics.median(peer_ms) / 1e6,
        }
        row["mover_over_peer"] = row["mover_gbps"] / row["peer_gbps"]
        log(f"mover vs peer {row}")
        assert row["verified"], row
        out.append(row)
    return out


# ------------------------------------------------------------------------- phase 2b
def _pattern(torch: Any, words: int, start: int, device: str) -> Any:
    """int32 words ``(w * 2654435761 + 12345) & 0x7fffffff`` for w in [start, start+words)."""
    w = torch.arange(start, start + words, dtype=torch.int64, device=device)
    return ((w * 2654435761 + 12345) & 0x7FFFFFFF).to(torch.int32)


def _backend_target(conn: Any, dev: int, slots: int) -> None:
    """Spawned: a cudaipc agent on GPU ``dev`` holding a poisoned pool ``[64, slots, 32 KiB]``;
    checks pages on request and counts notifications."""
    import torch

    from kvwire.config import KVWireConfig
    from kvwire.layout import MemoryRegion
    from kvwire.selection import create_backend

    torch.cuda.set_device(dev)
    words = RUNS_PER_PAGE * slots * RUN // 4
    pool = torch.full((words,), -1, dtype=torch.int32, device=f"cuda:{dev}")
    b = create_backend(KVWireConfig(transfer_backend="cudaipc"), "bench-target", need=())
    b.register([MemoryRegion.from_tensor(pool, item_len=RUN)])
    conn.send(("ready", b.local_metadata()))
    notes = 0
    try:
        while True:
            notes += len(b.get_notifications())
            if not conn.poll(0.0002):
                continue
            msg = conn.recv()
            if msg[0] == "stop":  # notifications may still be on their way: drain a while
                end = time.monotonic() + 2.0
                while time.monotonic() < end:
                    notes += len(b.get_notifications())
                    time.sleep(0.01)
                break
            if msg[0] == "poison":
                pool.fill_(-1)
                torch.cuda.synchronize()
                conn.send(("ok",))
            elif msg[0] == "check":  # (src_slots, dst_slots, src_slots_total) per request
                _, pairs, src_slots = msg
                view = pool.view(RUNS_PER_PAGE, slots, RUN // 4)
                bad = 0
                for sp, dp in pairs:
                    sp = torch.as_tensor(sp, device=pool.device)
                    dp = torch.as_tensor(dp, device=pool.device)
                    rows = torch.arange(RUNS_PER_PAGE, device=pool.device)[:, None] * src_slots
                    first = (rows + sp[None, :]) * (RUN // 4)  # word index of each source run
                    idx = first[..., None] + torch.arange(RUN // 4, device=pool.device)
                    want = ((idx * 2654435761 + 12345) & 0x7FFFFFFF).to(torch.int32)
                    bad += int((view[:, dp] != want).sum())
                untouched = torch.ones(slots, dtype=torch.bool, device=pool.device)
                for _, dp in pairs:
                    untouched[torch.as_tensor(dp, device=pool.device)] = False
                bad += int((view[:, untouched] != -1).sum())  # nothing else was written
                conn.send(("checked", bad, notes))
    finally:
        b.close()
        conn.send(("notes", notes))


def backend_api(
    sizes_mib: list[int], devices: tuple[int, int], repeat: int, profile: str = ""
) -> list[dict]:
    """kvwire's TransferBackend API over cudaipc across two processes (prepare once; submit
    with a notification, poll until DONE, release), C=1 and C=8 concurrent submits; first
    request and first batch of each size checked element by element on the target."""
    import multiprocessing as mp

    import torch

    from kvwire.backend import XferOp, XferState
    from kvwire.config import KVWireConfig
    from kvwire.descriptors import make_table
    from kvwire.layout import MemoryRegion
    from kvwire.selection import create_backend

    s_dev, d_dev = devices
    pages_max = max(sizes_mib) * MiB // (RUN * RUNS_PER_PAGE)
    src_slots, dst_slots = 2 * pages_max, 8 * pages_max + 8
    torch.cuda.set_device(s_dev)
    src = _pattern(torch, RUNS_PER_PAGE * src_slots * RUN // 4, 0, f"cuda:{s_dev}")
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_backend_target, args=(child, d_dev, dst_slots), daemon=True)
    proc.start()
    out: list[dict] = []
    a = create_backend(KVWireConfig(transfer_backend="cudaipc"), "bench-initiator", need=())
    try:
        if not parent.poll(180):
            raise RuntimeError("backend target did not start")
        _, meta = parent.recv()
        a.register([MemoryRegion.from_tensor(src, item_len=RUN)])
        peer = a.add_peer(meta)
        from kvwire_cudaipc.meta import parse_peer

        dst_base = parse_peer(meta, "cudaipc", 1).regions[0].addr
        rows_s = RUNS_PER_PAGE * src_slots
        rows_d = RUNS_PER_PAGE * dst_slots
        pair = a.prepare(
            peer,
            make_table(src.data_ptr() + np.arange(rows_s) * RUN, RUN, s_dev),
            make_table(dst_base + np.arange(rows_d) * RUN, RUN, d_dev),
        )
        rng = np.random.default_rng(9)
        buf = np.arange(RUNS_PER_PAGE, dtype=np.int64)[:, None]

        def request(pages: int, slot0: int) -> tuple[np.ndarray, np.ndarray]:
            sp = rng.permutation(src_slots)[:pages].astype(np.int64)
            dp = slot0 + rng.permutation(pages).astype(np.int64)
            return sp, dp

        def submit(sp: np.ndarray, dp: np.ndarray) -> Any:
            li = (buf * src_slots + sp[None, :]).ravel()
            ri = (buf * dst_slots + dp[None, :]).ravel()
            return a.submit(XferOp.WRITE, pair, li, ri, notification=b"req")

        def wait(hs: list[Any]) -> None:
            for h in hs:
                while (st := a.poll(h)) is XferState.PENDING:
                    pass
                assert st is XferState.DONE, h.error
                a.release(h)

        def check(reqs: list[tuple[np.ndarray, np.ndarray]]) -> int:
            parent.send(("check", [(sp, dp) for sp, dp in reqs], src_slots))
            _, bad, _ = parent.recv()
            return int(bad)

        submitted = 0
        for mib in sizes_mib:
            pages = mib * MiB // (RUN * RUNS_PER_PAGE)
            for conc in (1, 8):
                parent.send(("poison",))
                parent.recv()
                reqs = [request(pages, i * pages) for i in range(conc)]
                wait([submit(sp, dp) for sp, dp in reqs])
                submitted += conc
                bad = check(reqs)
                times = []
                for _ in range(repeat):
                    reqs = [request(pages, i * pages) for i in range(conc)]
                    t = time.perf_counter()
                    wait([submit(sp, dp) for sp, dp in reqs])
                    times.append(time.perf_counter() - t)
                    submitted += conc
                if profile and mib == sizes_mib[0] and conc == 1:
                    import cProfile
                    import io
                    import pstats

                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(100):
                        sp, dp = request(pages, 0)
                        wait([submit(sp, dp)])
                    prof.disable()
                    submitted += 100
                    text = io.StringIO()
                    st = pstats.Stats(prof, stream=text)
                    st.sort_stats("tottime").print_stats(25)
                    st.sort_stats("cumulative").print_stats(40)
                    Path(profile).write_text(text.getvalue())
                med = statistics.median(times)
                row = {
                    "mib": mib,
                    "concurrency": conc,
                    "descriptors_per_request": pages * RUNS_PER_PAGE,
                    "mismatches": bad,
                    "gbps": conc * mib * MiB / med / 1e9,
                    "ms": med * 1e3,
                }
                log(f"backend api {row}")
                out.append(row)
                assert bad == 0, row
        a.remove_peer(peer)
    finally:
        a.close()
        parent.send(("stop",))
        notes = parent.recv()[1] if parent.poll(30) else -1
        proc.join(30)
    log(f"backend api: {submitted} requests submitted, {notes} notifications received")
    for r in out:
        r["notifications_ok"] = notes == submitted
    return out


# ----------------------------------------------------------------------------- phase 3
def engine(a: argparse.Namespace) -> dict[str, Any]:
    from kvwire.config import KVWireConfig
    from kvwire.layout import ModelSpec
    from kvwire.testing.cluster import Cluster, ClusterSpec, RoomPlan
    from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty

    model = ModelSpec(num_layers=32, total_kv_heads=8, head_dim=64, dtype="int32", page_size=16)
    if a.device == "cpu":  # dry run: small pages on host memory
        model = ModelSpec(num_layers=4, total_kv_heads=2, head_dim=16, dtype="int32", page_size=4)
    m = model
    page_mib = m.num_layers * 2 * m.page_size * m.total_kv_heads * m.head_dim * 4 / MiB
    sizes = a.sizes
    pages = {m: max(1, round(m / page_mib)) for m in sizes}
    slots = max(2, *a.concurrency) * max(pages.values()) + 64
    spec = ClusterSpec(
        model=model,
        slots=slots,
        aux_slots=256,
        device=a.device,
        gpus=tuple(a.gpus) if a.device == "cuda" else None,
        engine_step_s=a.engine_step,
        prefill_tp=a.prefill_tp,
        decode_tp=a.decode_tp,
        config=KVWireConfig(transfer_backend=a.backend),
    )
    rng = np.random.default_rng(3)

    def plans(n: int, p: int, verify: bool) -> list[RoomPlan]:
        out = []
        for _ in range(n):
            cut = int(rng.integers(0, p + 1)) if verify else p
            out.append(
                RoomPlan(
                    room=secrets.randbits(62), num_pages=p, chunks=[cut, p - cut], verify=verify
                )
            )
        return out

    report: dict[str, Any] = {
        "verified": [],
        "cells": [],
        "slots": slots,
        "pages": pages,
        "tp": f"{a.prefill_tp}->{a.decode_tp}",
    }
    t0 = time.perf_counter()
    with Cluster(spec) as c:
        log(f"cluster up in {time.perf_counter() - t0:.1f}s (slots {slots})")
        for mib in sizes:
            n = a.verify_requests if mib < 512 else max(2, a.verify_requests // 2)
            res = c.run(
                plans(n, pages[mib], True), concurrency=max(a.concurrency), timeout_s=a.timeout
            )
            assert_all_ok(res)
            cell = {"mib": mib, "requests": len(res), "mismatches": sum(r.mismatches for r in res)}
            report["verified"].append(cell)
            log(f"verified {cell}")
        c.run(plans(4, pages[sizes[0]], False), concurrency=2, timeout_s=a.timeout)  # warm-up
        for mib in sizes:
            for conc in a.concurrency:
                n = a.requests if mib < 512 else max(conc * 2, a.requests // 4)
                n = max(n, conc * 2)
                res = c.run(plans(n, pages[mib], False), concurrency=conc, timeout_s=a.timeout)
                failed = [r for r in res if any(x.status != 4 for x in r.reports)]
                span = max(r.t_end for r in res) - min(r.t_start for r in res)
                nbytes = sum(r.bytes for r in res)
                lat = sorted(r.latency_s for r in res)
                cell = {
                    "mib": mib,
                    "concurrency": conc,
                    "requests": len(res),
                    "failed": len(failed),
                    "bytes_per_request": nbytes // len(res),
                    "descriptors_per_request": res[0].descriptors,
                    "gbps": nbytes / span / 1e9,
                    "p50_ms": 1e3 * lat[len(lat) // 2],
                    "p90_ms": 1e3 * lat[int(len(lat) * 0.9)],
                }
                pre = [x for r in res for x in r.reports if x.role == "prefill"]
                for k in ("queue_s", "post_s", "transfer_s", "latency_s"):
                    vals = sorted(getattr(x, k) for x in pre)
                    cell[f"prefill_{k[:-2]}_ms"] = 1e3 * vals[len(vals) // 2]
                report["cells"].append(cell)
                log(f"engine {cell}")
        assert_tables_empty(c)
    return report


# ------------------------------------------------------------------------------ output
def nixl_rows(path: str) -> dict[int, dict[str, float]]:
    """Raw per-page NIXL (``raw_prepped``) and kvwire-over-nixl GB/s by MiB, from
    ``kvwire_nixl.gpu_bench --json``."""
    data = json.loads(Path(path).read_text())
    out = {}
    for c in data["cases"]:
        m = c["methods"]
        out[int(c["bytes"] // MiB)] = {
            "raw_nixl_gbps": m["raw_prepped"]["median_gbps"],
            "kvwire_nixl_gbps": m["kvwire"]["median_gbps"],
            "nixl_verified": bool(c["verified"]),
        }
    return out


def render(report: dict[str, Any]) -> str:
    peer = {r["mib"]: r for r in report.get("mover", [])}
    nixl = report.get("nixl", {})
    lines = [
        "| MiB/request | C | kvwire cudaipc GB/s | p50 ms | torch peer GB/s | x peer | "
        "mover alone GB/s | raw NIXL GB/s | x raw NIXL |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report["engine"]["cells"]:
        p = peer.get(c["mib"], {})
        pg = p.get("peer_gbps", float("nan"))
        raw = nixl.get(c["mib"], {}).get("raw_nixl_gbps", float("nan"))
        lines.append(
            f"| {c['mib']} | {c['concurrency']} | {c['gbps']:.1f} | {c['p50_ms']:.2f} | "
            f"{pg:.0f} | {c['gbps'] / pg:.2f} | {p.get('mover_gbps', float('nan')):.0f} | "
            f"{raw:.2f} | {c['gbps'] / raw:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    p.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[2, 16, 128, 512],
        help="MiB per request",
    )
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--requests", type=int, default=48, help="timed requests per cell")
    p.add_argument("--verify-requests", type=int, default=8)
    p.add_argument("--repeat", type=int, default=20, help="mover/peer timing repeats")
    p.add_argument("--engine-step", type=float, default=0.0002)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-mover", action="store_true")
    p.add_argument("--skip-backend-api", action="store_true")
    p.add_argument("--profile", default="", help="cProfile of the backend API at the first size")
    p.add_argument("--mover-json", default="", help="mover results of an earlier run to merge")
    p.add_argument("--nixl-json", default="")
    p.add_argument("--backend", default="cudaipc", help="transfer backend of the engine phase")
    p.add_argument("--prefill-tp", type=int, default=1, help="engine phase: prefill ranks")
    p.add_argument("--decode-tp", type=int, default=1, help="engine phase: decode ranks")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    command = " ".join(
        ["scripts/gpu_cudaipc_bench.py", *(argv if argv is not None else sys.argv[1:])]
    )
    report: dict[str, Any] = {"command": command, "host": platform.node()}
    if a.mover_json and Path(a.mover_json).exists():
        earlier = json.loads(Path(a.mover_json).read_text())
        keys = ("mover_check", "mover", "backend_api")
        report.update({k: earlier[k] for k in keys if k in earlier})
    if a.device == "cuda":
        import torch

        report["gpus"] = [torch.cuda.get_device_name(i) for i in a.gpus]
        report["torch"] = torch.__version__
        import triton

        report["triton"] = triton.__version__
        if not a.skip_mover:
            report["mover_check"] = mover_check((a.gpus[0], a.gpus[1]))
            report["mover"] = mover_vs_peer(a.sizes, (a.gpus[0], a.gpus[1]), a.repeat)
        if not a.skip_backend_api:
            report["backend_api"] = backend_api(
                a.sizes, (a.gpus[0], a.gpus[1]), a.repeat, a.profile
            )
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    if not a.skip_engine:
        report["engine"] = engine(a)
    if a.nixl_json and Path(a.nixl_json).exists():
        report["nixl"] = nixl_rows(a.nixl_json)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    if "mover" in report:
        print("\nmover alone (one launch, GPU0 -> GPU1 pages) vs torch peer copy:")
        for r in report["mover"]:
            print(
                f"  {r['mib']:>4} MiB: mover {r['mover_gbps']:.0f} GB/s (wall "
                f"{r['mover_wall_gbps']:.0f}, GPU alone {r.get('gpu_only_gbps', 0):.0f}, "
                f"host {r['mover_host_us']:.0f} us: plan "
                f"{r.get('plan_us', 0):.0f} + upload/launch {r.get('upload_launch_us', 0):.0f}), "
                "peer "
                f"{r['peer_gbps']:.0f} GB/s, ratio {r['mover_over_peer']:.2f}"
            )
    if "engine" in report:
        print()
        print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
