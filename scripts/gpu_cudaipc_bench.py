"""Same-host GPU -> GPU KV moves: kvwire over ``cudaipc`` against the link's limit, one run.

Prefill on GPU 0 and decode on GPU 1, the model of issue 27 (32 layers x 8 KV heads x 128
dims bf16, 16-token pages: a page is 2 MiB in 64 runs of 32 KiB, one per layer and K/V; the
harness encodes elements as int32, so it uses 64 int32 dims per head: the same bytes per
run). Phases (1, 2 and 3 live in :mod:`kvwire.bench.gpu_mover` and
:mod:`kvwire.bench.gpu_engine`), every one on fresh random data with the destination poisoned
first:

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
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.bench.gpu_engine import add_engine_args, engine
from kvwire.bench.gpu_mover import RUN, RUNS_PER_PAGE, MiB, log, mover_check, mover_vs_peer


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
    add_engine_args(p, requests=48, verify=8, timeout=300.0, backend="cudaipc")
    p.add_argument("--repeat", type=int, default=20, help="mover/peer timing repeats")
    p.add_argument(
        "--staging",
        default="auto",
        help="the engine phase's staging strategy (default: kvwire's default, auto; "
        "'direct' gives per-descriptor NIXL)",
    )
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-mover", action="store_true")
    p.add_argument("--skip-backend-api", action="store_true")
    p.add_argument("--profile", default="", help="cProfile of the backend API at the first size")
    p.add_argument("--mover-json", default="", help="mover results of an earlier run to merge")
    p.add_argument("--nixl-json", default="")
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

        if a.gpus is None:
            a.gpus = list(range(torch.cuda.device_count()))
        if len(a.gpus) < 2 and not (a.skip_mover and a.skip_backend_api):
            raise SystemExit(f"--gpus {a.gpus}: the bench moves KV between two GPUs at least")
        if len(a.gpus) < 2:  # the engine phase alone: host time, not the link
            print("one GPU: prefill and decode share it (a move inside one GPU)", flush=True)
        report["gpus"] = [f"{i}: {torch.cuda.get_device_name(i)}" for i in a.gpus]
        report["torch"] = torch.__version__
        import triton

        report["triton"] = triton.__version__
        if not a.skip_mover:
            from kvwire_cudaipc._cuda import enable_peer_access

            report["mover_check"] = mover_check((a.gpus[0], a.gpus[1]), enable_peer_access)
            report["mover"] = mover_vs_peer(a.sizes, (a.gpus[0], a.gpus[1]), a.repeat)
        if not a.skip_backend_api:
            report["backend_api"] = backend_api(
                a.sizes, (a.gpus[0], a.gpus[1]), a.repeat, a.profile
            )
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    if not a.skip_engine:
        report["engine"] = engine(a, staging=a.staging)
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
