"""``kvwire demo``: PD disaggregation on loopback, every element verified.

Each phase starts a real cluster (:mod:`kvwire.testing.cluster`): a prefill instance of
``prefill_tp`` ranks, whose rank 0 runs the bootstrap service, and a decode instance of
``decode_tp`` ranks, every rank its own process with its own backend agent, KV pool and
:class:`~kvwire.session.KVManager`. Requests go through the engine API exactly as an inference
engine drives it (receiver, metadata, sender, chunked prefill, polls, clear), with random page
allocations on both sides and some prefixes already cached on decode; every element a decode
rank receives is checked against the encoding of its coordinates.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    Progress,
    TaskID,
)
from rich.table import Table

from kvwire.cli_progress import progress_bar
from kvwire.config import AUTO, config_from_args
from kvwire.errors import KVWireError
from kvwire.layout import ModelSpec
from kvwire.selection import auto_backend_name, select_backend
from kvwire.testing.cluster import Cluster, ClusterError, ClusterSpec, RequestResult


def add_demo_args(p: argparse.ArgumentParser) -> None:
    """Demo-specific options."""
    p.add_argument("--requests", type=int, default=200, help="requests per phase")
    p.add_argument("--tokens", type=int, default=256, help="largest prompt, in tokens")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8, help="total KV heads of the model")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (prefill)")
    p.add_argument(
        "--decode-page-size",
        type=int,
        default=None,
        help="tokens per decode page when it differs from prefill's (token ranges move)",
    )
    p.add_argument("--mla", action="store_true", help="an MLA model (one latent 'head')")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--max-chunks", type=int, default=3, help="chunks of chunked prefill")
    p.add_argument(
        "--cached-fraction",
        type=float,
        default=0.2,
        help="share of requests with a prefix already cached on decode",
    )
    p.add_argument(
        "--phases",
        default="2:1,2:2",
        help="comma-separated prefill_tp:decode_tp pairs (default 2:1,2:2); "
        "TP x PP on either side as e.g. 2x2:1 or 2x2:1x2",
    )
    p.add_argument(
        "--layerwise",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="share of requests whose chunks are sent layer-wise (send(..., layerwise=True), "
        "then layer_ready per layer); e.g. 1.0",
    )
    p.add_argument("--device", default="cpu", help="KV pools on 'cpu' or 'cuda'")
    p.add_argument("--seed", type=int, default=0)


def parse_phase(text: str) -> tuple[int, int, int, int]:
    """``"2:1"`` -> (prefill_tp, prefill_pp, decode_tp, decode_pp); ``"2x2:1x2"`` adds
    pipeline stages on either side."""
    try:
        left, right = text.split(":")
        tp, _, pp = left.partition("x")
        td, _, pd = right.partition("x")
        return int(tp), int(pp or 1), int(td), int(pd or 1)
    except ValueError as exc:
        raise KVWireError(f"bad phase {text!r}: expected PREFILL_TP[xPP]:DECODE_TP[xPP]") from exc


def _shape(tp: int, pp: int) -> str:
    """``2`` or ``2x2``: a side's TP and, when it has stages, PP."""
    return f"{tp}x{pp}" if pp > 1 else str(tp)


def summarize(results: list[RequestResult]) -> dict[str, float]:
    """Figures of one phase: requests, bytes, GB/s over the phase, latencies, descriptors."""
    ok = [r for r in results if r.ok]
    wall = max(r.t_end for r in results) - min(r.t_start for r in results) if results else 0.0
    moved = sum(r.bytes for r in results)
    lat = [r.latency_s * 1e3 for r in ok] or [0.0]
    return {
        "requests": len(results),
        "ok": len(ok),
        "bytes": moved,
        "gbps": moved / wall / 1e9 if wall > 0 else 0.0,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "descs": statistics.fmean(r.descriptors for r in results) if results else 0.0,
        "corrupt": sum(r.mismatches for r in results),
        "failed": sum(1 for r in results if any(rep.status != 4 for rep in r.reports)),
        "aux_bad": sum(1 for r in results if not all(rep.aux_ok for rep in r.reports)),
    }


def _advance(progress: Progress, task: TaskID, _result: RequestResult) -> None:
    progress.advance(task)


def run(args: argparse.Namespace, console: Console) -> int:
    """Entry point of ``kvwire demo``; non-zero exit on any corruption or failure."""
    config = config_from_args(args)
    try:
        if config.transfer_backend == AUTO:
            config = config.model_copy(update={"transfer_backend": auto_backend_name()})
        # fail here, naming why, rather than in every spawned rank
        select_backend(config)
    except KVWireError as exc:
        console.print(f"[red]FAILED[/]: {escape(str(exc))}", highlight=False)
        return 1
    model = ModelSpec(
        num_layers=args.layers,
        total_kv_heads=1 if args.mla else args.kv_heads,
        head_dim=args.head_dim,
        dtype="int32",
        page_size=args.page_size,
        is_mla=args.mla,
    )
    max_pages = max(1, -(-args.tokens // args.page_size))
    try:
        phases = [parse_phase(p) for p in args.phases.split(",")]
    except KVWireError as exc:
        console.print(f"[red]FAILED[/]: {exc}")
        return 1
    dps = args.decode_page_size
    if dps is not None and dps < 1:
        console.print(f"[red]FAILED[/]: --decode-page-size must be >= 1, got {dps}")
        return 1
    decode_pages = f" (decode pages of {dps})" if dps and dps != args.page_size else ""
    console.print(
        f"kvwire demo: backend [bold]{config.transfer_backend}[/], {args.requests} requests per "
        f"phase (1-{max_pages} pages of {args.page_size} tokens{decode_pages}, up to "
        f"{args.max_chunks} chunks, "
        f"{args.concurrency} in flight), model {model.num_layers} layers x "
        f"{model.total_kv_heads} KV heads x {model.head_dim} dims{' (MLA)' if args.mla else ''}"
    )
    rows = []
    try:
        with progress_bar(console) as progress:
            for tp, pp, td, dpp in phases:
                name = f"{_shape(tp, pp)}->{_shape(td, dpp)}"
                task = progress.add_task(f"{name}: starting ranks", total=args.requests)
                spec = ClusterSpec(
                    model=model,
                    prefill_tp=tp,
                    prefill_pp=pp,
                    decode_tp=td,
                    decode_pp=dpp,
                    decode_page_size=dps,
                    slots=max(64, 2 * args.concurrency * max_pages + 8),
                    aux_slots=max(16, 2 * args.concurrency + 8),
                    device=args.device,
                    config=config,
                    seed=args.seed,
                )
                with Cluster(spec) as cluster:
                    progress.update(task, description=f"{name}: transferring")
                    plans = cluster.plans(
                        args.requests,
                        pages=(1, max_pages),
                        max_chunks=args.max_chunks,
                        cached_fraction=args.cached_fraction,
                        layerwise_fraction=args.layerwise,
                    )
                    results = cluster.run(
                        plans,
                        concurrency=args.concurrency,
                        timeout_s=120 + 2.0 * args.requests,
                        on_result=functools.partial(_advance, progress, task),
                    )
                rows.append((name, summarize(results)))
    except (KVWireError, ClusterError) as exc:
        console.print(f"[red]FAILED[/]: {type(exc).__name__}: {exc}")
        return 1
    table = Table(title="kvwire demo results")
    cols = ["phase", "reqs", "GB", "GB/s", "p50 ms", "p99 ms", "descs/req", "failed", "corrupt"]
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    ok = True
    for name, s in rows:
        table.add_row(
            name,
            str(int(s["requests"])),
            f"{s['bytes'] / 1e9:.3f}",
            f"{s['gbps']:.3f}",
            f"{s['p50_ms']:.1f}",
            f"{s['p99_ms']:.1f}",
            f"{s['descs']:.0f}",
            str(int(s["failed"])),
            str(int(s["corrupt"] + s["aux_bad"])),
        )
        ok &= s["ok"] == s["requests"] and s["corrupt"] == 0
    console.print(table)
    console.print("[green]every element verified[/]" if ok else "[red]FAILED[/]")
    return 0 if ok else 1


__all__ = ["add_demo_args", "parse_phase", "run", "summarize"]
