"""``kvwire bench --device cuda``: kvwire's GPU paths side by side with the link's limit, one run.

Prefill and decode rank processes on two GPUs (the first two visible, or ``--gpus``), the model
of issue 27 (32 layers x 8 KV heads x 128 dims bf16, 16-token pages: 2 MiB a page), requests of
``--mib`` MiB at each ``--concurrency``. Each path is a :func:`kvwire.bench.gpu_engine.engine`
run (verified requests of every size first, every element and aux row checked on decode,
then timed requests):

* ``cudaipc``: the same-host backend, decode's pages written by the page mover;
* ``default``: NIXL with the default staging (``auto``: on GPU pools bulk staging at its GPU
  sizes, :data:`~kvwire.staging.bulk.GPU_SIZES`), each request sent as one chunk, which
  kvwire cuts into chunks of one staging buffer: what an operator gets without options;
* ``staged``: NIXL with bulk staging at large sizes (64-page chunks of 128 MiB, 8 MiB
  descriptors, a 1 GiB ring: each chunk gathered into one block, written as a few large
  descriptors, scattered on decode);
* ``per-page``: NIXL, one descriptor per (layer, K/V, page), as the peers' connectors move KV;

beside a torch peer copy of as many contiguous bytes from the prefill GPU to the decode GPU
(the link's limit, CUDA-event median of ten). A path whose backend is not installed is
skipped, saying so. The last lines printed are the table: GB/s, p50 latency and the ratios to
the peer copy and to the per-page path. Raw per-page NIXL against kvwire's ``nixl`` backend on
the same descriptors is ``kvwire bench --transfer-backend nixl --engine`` (the plugin's own
benchmark).

:func:`run_suite` also runs on host memory (``device="cpu"``: a small model, no peer copy),
which is how the test suite checks the wiring on a machine without GPUs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvwire.bench.gpu_engine import add_engine_args, engine
from kvwire.cli_progress import progress_bar
from kvwire.errors import KVWireError
from kvwire.layout import MemKind
from kvwire.plugins import Kind, get_registry

MiB = 1 << 20

#: name -> (backend, staging strategy), in the table's order.
PATHS: dict[str, tuple[str, str]] = {
    "cudaipc": ("cudaipc", "direct"),
    "default": ("nixl", "auto"),
    "staged": ("nixl", "bulk"),
    "per-page": ("nixl", "direct"),
}
DEFAULT_MIB = (2, 16, 128, 512)
DEFAULT_CONCURRENCY = (1, 8)
DEFAULT_REQUESTS = 32
#: Bulk staging on GPUs: 64-page chunks (128 MiB) in 8 MiB blocks through a 1 GiB ring.
CHUNK_PAGES = 64
GPU_STAGING = {
    "block_bytes": 8 * MiB,
    "buffer_bytes": CHUNK_PAGES * 2 * MiB,
    "ring_bytes": 1024 * MiB,
    "buffers_per_worker": 2,
}
#: The same on host memory (the CPU run's small pages), every equal-TP chunk staged.
CPU_STAGING = {"ring_bytes": 4 * MiB, "block_bytes": 64 << 10, "buffer_bytes": MiB}


def _engine_args(
    device: str, gpus: Sequence[int] | None, sizes: Sequence[int], concurrency: Sequence[int],
    requests: int, backend: str,
) -> argparse.Namespace:  # fmt: skip
    """The settings :func:`~kvwire.bench.gpu_engine.engine` reads, at their defaults but for
    these."""
    p = argparse.ArgumentParser()
    add_engine_args(p, requests=requests, verify=2, timeout=120.0, backend=backend)
    a = p.parse_args([])
    a.device, a.gpus = device, list(gpus) if gpus is not None else None
    a.sizes, a.concurrency, a.requests = list(sizes), list(concurrency), requests
    return a


def peer_copy_gbps(src: int, dst: int, mib: int, repeat: int = 10) -> float:
    """A torch copy of ``mib`` contiguous MiB from GPU ``src`` into GPU ``dst`` (the link's
    limit), GB/s of the CUDA-event median of ``repeat`` copies after two untimed ones."""
    import torch

    a = torch.empty(mib * MiB, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(mib * MiB, dtype=torch.uint8, device=f"cuda:{dst}")
    times = []
    with torch.cuda.device(src):
        for i in range(repeat + 2):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            b.copy_(a, non_blocking=True)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
    return float(mib * MiB / statistics.median(times) / 1e6)


def run_suite(
    *,
    device: str = "cuda",
    gpus: Sequence[int] | None = None,
    sizes: Sequence[int] = DEFAULT_MIB,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    requests: int = DEFAULT_REQUESTS,
    paths: Sequence[str] = tuple(PATHS),
    log: Callable[[str], None] = print,
    detail: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every path of ``paths`` (names of :data:`PATHS`) and, on GPUs, the peer copy;
    returns the report (``paths``: each path's engine report, or why it was skipped;
    ``peer_gbps`` per size). ``log`` takes a line as each path starts, ends or is skipped;
    ``detail`` the engine's lines (every verified size and timed cell)."""
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise KVWireError(f"unknown GPU bench path(s) {unknown}; known: {', '.join(PATHS)}")
    report: dict[str, Any] = {"device": device, "host": platform.node(), "paths": {}}
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise KVWireError("--device cuda: no CUDA device is visible here")
        used = list(gpus) if gpus is not None else list(range(min(n, 2)))
        report["gpus"] = [f"{i}: {torch.cuda.get_device_name(i)}" for i in used]
        if len(used) < 2:
            log("one GPU: prefill and decode share it (a move inside one GPU, not over a link)")
        src, dst = used[0], used[-1]
        report["peer_gbps"] = {mib: peer_copy_gbps(src, dst, mib) for mib in sizes}
        gpus = used
    reg = get_registry()
    for name in paths:
        backend, staging = PATHS[name]
        cls, err = reg.try_resolve(Kind.BACKEND, backend)
        if cls is not None:  # importable: can it serve a rank with this memory here?
            err = cls.rank_problem(frozenset({MemKind.VRAM if device == "cuda" else MemKind.DRAM}))
        if err is not None:
            report["paths"][name] = {"skipped": f"backend {backend!r} is not usable: {err}"}
            log(f"{name}: skipped ({backend} not usable)")
            continue
        a = _engine_args(device, gpus, sizes, concurrency, requests, backend)
        options: dict[str, Any] = {}
        if staging == "bulk":
            options = dict(GPU_STAGING if device == "cuda" else CPU_STAGING)
        if staging == "bulk" and device != "cuda":
            options = {**options, "equal_tp": "always"}
        chunk = CHUNK_PAGES if staging == "bulk" and device == "cuda" else 0
        log(f"{name}: {backend}, staging {staging}")
        t0 = time.monotonic()
        report["paths"][name] = engine(
            a, staging=staging, staging_options=options, max_chunk_pages=chunk, log=detail
        )
        log(f"{name}: done in {time.monotonic() - t0:.0f} s")
    return report


def render(report: dict[str, Any]) -> Table:
    """The table: each path's GB/s and p50 per size and concurrency, with its ratio to the
    peer copy of the same bytes and to the per-page path, and each rank process's GIL
    switch interval after the cell (prefill's first): kvwire's GIL watch lowers it after a
    burst of Python, and a run with it lowered moved up to 1.5x the GB/s of one without on
    the GPU hosts (docs/benchmarks.md, session 26), so a table says where it stood."""
    peer: dict[Any, float] = {int(k): v for k, v in (report.get("peer_gbps") or {}).items()}
    base = {
        (c["mib"], c["concurrency"]): c["gbps"]
        for c in (report["paths"].get("per-page") or {}).get("cells", [])
    }
    t = Table(title=f"kvwire on {report['device']}: {', '.join(report.get('gpus', [])) or 'host'}")
    cols = ("path", "MiB", "C", "GB/s", "p50 ms", "x peer copy", "x per-page", "GIL µs", "failed")
    for col in cols:
        t.add_column(col, justify="left" if col == "path" else "right")
    for name, rep in report["paths"].items():
        if "skipped" in rep:
            t.add_row(name, "", "", "", "", "", "", "", escape(rep["skipped"]))
            continue
        for c in rep["cells"]:
            key, g = (c["mib"], c["concurrency"]), c["gbps"]
            x_peer = f"{g / peer[c['mib']]:.2f}" if c["mib"] in peer else "-"
            x_base = f"{g / base[key]:.1f}" if key in base and name != "per-page" else "-"
            gil = "/".join(f"{v:g}" for v in (c.get("gil") or {}).get("interval_us", [])) or "-"
            t.add_row(name, str(c["mib"]), str(c["concurrency"]), f"{g:.1f}",
                      f"{c['p50_ms']:.2f}", x_peer, x_base, gil, str(c["failed"]))  # fmt: skip
    for mib, g in sorted(peer.items()):
        t.add_row("torch peer copy", str(mib), "", f"{g:.1f}", "", "1.00", "", "", "")
    return t


def run(args: argparse.Namespace, console: Console, command: str) -> int:
    """``kvwire bench --device cuda`` (the bench's ``--mib``, ``--concurrency``,
    ``--requests``, ``--gpu-paths``, ``--json``)."""
    paths = args.gpu_paths or tuple(PATHS)
    details: list[str] = []
    try:
        with progress_bar(console) as progress:
            task = progress.add_task("GPU bench", total=len(paths))

            def step(line: str) -> None:
                progress.update(task, description=escape(line))
                if line.endswith(" s") or "skipped" in line:  # a path ended
                    progress.advance(task)

            report = run_suite(
                device="cuda",
                sizes=args.mib or DEFAULT_MIB,
                concurrency=args.concurrency or DEFAULT_CONCURRENCY,
                requests=args.requests or DEFAULT_REQUESTS,
                paths=paths,
                log=step,
                detail=details.append,
            )
    except (KVWireError, RuntimeError) as exc:
        console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
        return 1
    report["command"] = command
    report["engine_log"] = details
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    console.width = max(console.width, 120)
    console.print(render(report))
    failed = sum(c["failed"] for r in report["paths"].values() for c in r.get("cells", []))
    return 1 if failed else 0
