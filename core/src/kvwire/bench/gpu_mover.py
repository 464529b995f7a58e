# mypy: disable-error-code="no-untyped-call, misc"
"""GPU phases of the mover benchmark (``scripts/gpu_cudaipc_bench.py``,
``scripts/gpu_staged_bench.py``): the fused mover checked byte by byte for every element width
into the same and a peer GPU, and timed against a torch peer copy with its host cost split
(planning, launch the old way and the new way side by side).

The model of issue 27: a page is 2 MiB in 64 runs of 32 KiB (32 layers x K/V). Needs torch with
CUDA, Triton and two GPUs; imported only by the GPU scripts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MiB = 1 << 20
RUN = 32 << 10  # bytes per (layer, K/V, page) run
RUNS_PER_PAGE = 64  # 32 layers x K/V


def log(line: str) -> None:
    """Print a progress line at once (the GPU machine's output is a log file)."""
    print(line, flush=True)


def mover_check(
    devices: tuple[int, int], enable_peer: Callable[[int, int], None]
) -> list[dict[str, Any]]:
    """Random run lists of every width, GPU 0 -> GPU 0 and GPU 0 -> GPU 1, byte-checked.
    Each width is launched twice, so both the first (compiling) launch and the direct launch
    of the compiled kernel are checked. ``enable_peer(src, dst)`` grants ``src`` access to
    ``dst``'s memory (a backend's own call, e.g. the cudaipc plugin's)."""
    import torch

    from kvwire.movers import copy_runs_reference
    from kvwire.movers.triton_copy import RunCopier

    src_dev, dst_dev = devices
    enable_peer(src_dev, dst_dev)
    rng = np.random.default_rng(11)
    out = []
    span = 8 * MiB
    copier = RunCopier(src_dev, tile_bytes=16 << 10)  # many tiles per run
    for dev in (src_dev, dst_dev):
        for align in (16, 8, 4, 2, 1, 16, 8, 4, 2, 1):
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


def events_ms(fn: Callable[[], Any], repeat: int, device: int) -> list[float]:
    """CUDA-event times (ms) of ``fn`` on ``device``'s current stream, one per repeat."""
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


def mover_vs_peer(
    sizes_mib: list[int], devices: tuple[int, int], repeat: int
) -> list[dict[str, Any]]:
    """One mover launch of page runs GPU0 -> GPU1 vs a torch peer copy of as many contiguous
    bytes; also the host-side time of planning + launching, the launch both ways side by
    side: :func:`~kvwire.movers.triton_copy.launch_plan` (freshly pinned table uploaded with
    a copy, Triton's launcher) and :meth:`RunCopier.launch` (pinned slot read by the kernel,
    the compiled kernel launched directly)."""
    import torch

    from kvwire.movers import plan_tiles
    from kvwire.movers.triton_copy import RunCopier, launch_plan

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
    out: list[dict[str, Any]] = []
    for mib in sizes_mib:
        pages = mib * MiB // (RUN * RUNS_PER_PAGE)
        sp = rng.permutation(slots)[:pages].astype(np.int64)
        dp = rng.permutation(slots)[:pages].astype(np.int64)
        s, d, n = page_runs(src_pool.data_ptr(), dst_pool.data_ptr(), slots, sp, dp)
        dst_pool.fill_(-1)
        torch.cuda.synchronize(d_dev)  # the fill runs on GPU 1's stream, the mover on GPU 0's
        for _ in range(3):  # the first launch compiles; the later ones launch directly
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
        mover_ms = events_ms(lambda s=s, d=d, n=n: copier.copy(s, d, n), repeat, s_dev)
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
        plan_us, launch_us, slot_us = [], [], []
        for _ in range(repeat):
            torch.cuda.synchronize(s_dev)
            t = time.perf_counter()
            plan = plan_tiles(s, d, n)
            t1 = time.perf_counter()
            launch_plan(plan, s_dev)
            t2 = time.perf_counter()
            torch.cuda.synchronize(s_dev)
            t3 = time.perf_counter()
            copier.launch(plan)
            t4 = time.perf_counter()
            plan_us.append((t1 - t) * 1e6)
            launch_us.append((t2 - t1) * 1e6)
            slot_us.append((t4 - t3) * 1e6)
        peer_ms = events_ms(lambda w=words: flat_dst[:w].copy_(flat_src[:w]), repeat, s_dev)
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
            "slot_launch_us": statistics.median(slot_us),
            "slot_path": plan.num_tiles <= copier._slot_tiles,
            "mover_wall_ms": statistics.median(wall_ms),
            "peer_gbps": nb / statistics.median(peer_ms) / 1e6,
        }
        row["mover_over_peer"] = row["mover_gbps"] / row["peer_gbps"]
        log(f"mover vs peer {row}")
        assert row["verified"], row
        out.append(row)
    return out
