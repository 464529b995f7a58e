"""The ``kvwire bench`` command: options, the tables, the plot and the entry point.

The measurement itself is :func:`kvwire.bench.cluster.measure` (1 prefill -> 1 decode,
kvwire vs raw vs sync) and :func:`kvwire.bench.fanout.measure_fanout` (``--fanout``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from kvwire.bench.cluster import MODES, BenchReport, measure
from kvwire.bench.common import (
    DEFAULT_PAGE_KIB,
    MIN_WAVES,
    BenchError,
    machine_info,
    model_for,
    page_bytes,
)
from kvwire.bench.fanout import (
    DEFAULT_FANOUT_CONCURRENCY,
    DEFAULT_FANOUT_SIZES,
    fanout_requests,
    measure_fanout,
    sync_vs_async,
)
from kvwire.bench.latency import STAGES, SUBSTAGES, TOTALS, LatencyReport, measure_latency
from kvwire.cli_progress import progress_bar
from kvwire.config import KVWireConfig, config_from_args
from kvwire.errors import KVWireError
from kvwire.layout import ModelSpec
from kvwire.selection import auto_backend_name
from kvwire.testing.cluster import ClusterError
from kvwire.testing.remote import RemoteAgentError

logger = logging.getLogger(__name__)

#: Defaults: requests of 2, 32 and 128 MiB (pages of 2 MiB) at 1 and 8 in flight.
DEFAULT_SIZES = (1, 16, 64)
DEFAULT_CONCURRENCY = (1, 8)
DEFAULT_REQUESTS = 32
DEFAULT_REPEAT = 3
#: ``--quick``: pages of 512 KiB, small requests (tests and smoke checks).
QUICK_PAGE_KIB = 512
QUICK_SIZES = (1, 4)
QUICK_CONCURRENCY = (1, 4)
QUICK_REQUESTS = 8
QUICK_REPEAT = 1
QUICK_FANOUT_CONCURRENCY = 8
#: ``--latency``: timed requests, and pages of one token of the bench model (16 rows of 2 KiB).
LATENCY_REQUESTS = 300
LATENCY_PAGE_KIB = 32
LATENCY_WARMUP = 20
PLOT_HINT = "--plot needs matplotlib: pip install kvwire[plot]"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvwire bench`` (kvwire's own options are added by ``add_cli_args``)."""
    g = parser.add_argument_group("benchmark")
    g.add_argument(
        "--page-kib",
        type=int,
        metavar="KIB",
        help=f"bytes of one page (every layer, K and V) in KiB, a multiple of 32 "
        f"(default {DEFAULT_PAGE_KIB}; {QUICK_PAGE_KIB} with --quick)",
    )
    g.add_argument(
        "--sizes",
        type=_int_list,
        metavar="N,N,..",
        help=f"pages per request (default {','.join(map(str, DEFAULT_SIZES))}: 2, 32 and "
        "128 MiB with 2 MiB pages)",
    )
    g.add_argument(
        "--mib",
        type=_int_list,
        metavar="M,M,..",
        help="instead of --sizes: MiB per request (multiples of the page size)",
    )
    g.add_argument(
        "--concurrency",
        type=_int_list,
        metavar="C,C,..",
        help=f"requests in flight (default {','.join(map(str, DEFAULT_CONCURRENCY))})",
    )
    g.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help=f"requests per batch, at least {MIN_WAVES} x concurrency (default {DEFAULT_REQUESTS})",
    )
    g.add_argument(
        "--repeat",
        type=int,
        metavar="R",
        help=f"batches per cell, modes interleaved; a cell's GB/s is its best batch "
        f"(default {DEFAULT_REPEAT})",
    )
    g.add_argument(
        "--fanout",
        type=int,
        metavar="N",
        help="also: 1 prefill -> N decode instances at --fanout-concurrency in flight, async "
        "workers vs the synchronous mode (a second table)",
    )
    g.add_argument(
        "--fanout-concurrency",
        type=int,
        metavar="C",
        help=f"requests in flight of --fanout (default {DEFAULT_FANOUT_CONCURRENCY}; "
        f"{QUICK_FANOUT_CONCURRENCY} with --quick)",
    )
    g.add_argument(
        "--fanout-sizes",
        type=_int_list,
        metavar="N,N,..",
        help=f"pages per request of --fanout (default {','.join(map(str, DEFAULT_FANOUT_SIZES))})",
    )
    g.add_argument(
        "--only-fanout", action="store_true", help="run the --fanout table alone (no 1 -> 1 table)"
    )
    g.add_argument(
        "--quick",
        action="store_true",
        help="small run for tests and smoke checks (defaults become "
        f"--page-kib {QUICK_PAGE_KIB} --sizes {','.join(map(str, QUICK_SIZES))} "
        f"--concurrency {','.join(map(str, QUICK_CONCURRENCY))} --requests {QUICK_REQUESTS} "
        f"--repeat {QUICK_REPEAT})",
    )
    g.add_argument(
        "--engine",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="instead: the selected backend plugin's engine benchmark (kvwire's backend vs raw "
        "engine calls on the same descriptors, e.g. prepared vs one-shot submission); ARGS go "
        "to it (e.g. --engine --repeat 5)",
    )
    g.add_argument(
        "--compare-staging",
        action="store_true",
        help="instead: bulk staging vs the per-token path vs equal TP (TP 2->1 and 1->1; "
        "--sizes gives pages per request, --concurrency the levels)",
    )
    g.add_argument(
        "--latency",
        action="store_true",
        help="instead: one request at a time, timed stage by stage (decode asks -> prefill "
        "sees it -> send -> posted -> decode notified -> Success on both sides), p50/p99 per "
        "stage; --requests timed requests (default 300), --sizes pages per request (one "
        "size; default 1), --page-kib (default 32: one token of the bench model)",
    )
    g.add_argument(
        "--engine-step-us",
        type=float,
        default=50.0,
        metavar="US",
        help="--latency: the rank processes' engine loops sleep this long between polls "
        "(default 50; 0 yields without sleeping)",
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=LATENCY_WARMUP,
        metavar="N",
        help=f"--latency: requests run first and not timed (default {LATENCY_WARMUP})",
    )
    g.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: prefill and decode on two GPUs, kvwire's GPU paths (cudaipc, NIXL with the "
        "default staging, NIXL staged, NIXL per page) beside a torch peer copy of the same "
        "bytes (--mib, --concurrency, --requests, --gpu-paths, --json apply; default sizes "
        "2,16,128,512 MiB)",
    )
    g.add_argument(
        "--gpu-paths",
        type=lambda v: tuple(x for x in v.split(",") if x),
        metavar="P,P,..",
        help="--device cuda: the paths to run (default cudaipc,default,staged,per-page)",
    )
    g.add_argument("--json", metavar="PATH", help="write every figure and the machine as JSON")
    g.add_argument("--plot", metavar="PATH.png", help="draw GB/s vs concurrency (matplotlib)")


def render(report: BenchReport) -> Table:
    """The 1 -> 1 summary table."""
    m = report.machine
    done = sum(c.ok for c in report.cells)
    total = sum(c.requests for c in report.cells)
    good = sum(c.verified for c in report.checks if not c.mode.startswith("fanout"))
    checked = sum(c.requests for c in report.checks if not c.mode.startswith("fanout"))
    repeat = report.setup.get("repeat", 1)
    kib = report.setup.get("page_bytes", 0) >> 10
    table = Table(
        title=f"kvwire bench: {report.backend}, 1 prefill -> 1 decode, pages of {kib} KiB, "
        f"{m.get('cpu_count')} CPUs",
        caption=f"{done}/{total} timed requests completed, {good}/{checked} checked requests "
        f"verified. GB/s: best of {repeat} batches (bytes / batch wall time); kv p50: kvwire "
        "request latency on decode (receiver created -> Success, control round trip "
        "included); raw p50: submit -> DONE; +p50: the difference (ms); C: requests in flight",
    )
    cols = ("MiB/req", "C", "kvwire GB/s", "raw GB/s", "kv/raw", "sync GB/s", "async/sync")
    for col in (*cols, "kv p50", "kv p99", "raw p50", "+p50"):
        table.add_column(col.replace(" ", "\n"), justify="right")
    for r in report.ratios:
        kv = report.cell("kvwire", r.pages, r.concurrency)
        raw = report.cell("raw", r.pages, r.concurrency)
        sync = report.cell("sync", r.pages, r.concurrency)
        table.add_row(
            f"{kv.request_bytes / 2**20:g}",
            str(r.concurrency),
            f"{kv.gbps:.2f}",
            f"{raw.gbps:.2f}",
            f"{r.kvwire_vs_raw:.2f}",
            f"{sync.gbps:.2f}",
            f"{r.async_vs_sync:.2f}",
            f"{kv.decode_p50_ms or kv.p50_ms:.2f}",
            f"{kv.decode_p99_ms or kv.p99_ms:.2f}",
            f"{raw.p50_ms:.2f}",
            f"{r.added_p50_ms:+.2f}",
        )
    return table


def render_fanout(report: BenchReport) -> Table:
    """The ``--fanout`` table: async workers vs the synchronous mode."""
    setup = report.setup.get("fanout", {})
    table = Table(
        title=f"kvwire bench --fanout: {report.backend}, 1 prefill -> "
        f"{setup.get('decode_instances')} decode instances, {setup.get('concurrency')} in flight",
        caption="latency on decode (receiver created -> Success), ms; sync/async: the "
        "synchronous mode's mean latency over the async workers'",
    )
    cols = ("MiB/req", "async GB/s", "sync GB/s", "async/sync GB/s", "async mean", "async p50")
    for col in (*cols, "async p99", "sync mean", "sync p50", "sync/async mean"):
        table.add_column(col.replace(" ", "\n"), justify="right")
    for pages in sorted({c.pages for c in report.fanout}):
        a = report.cell("fanout-kvwire", pages, setup.get("concurrency", 0))
        s = report.cell("fanout-sync", pages, setup.get("concurrency", 0))
        lat_ratio, gb_ratio = sync_vs_async(report.fanout, pages)
        table.add_row(
            f"{a.request_bytes / 2**20:g}",
            f"{a.gbps:.2f}",
            f"{s.gbps:.2f}",
            f"{gb_ratio:.2f}",
            f"{a.decode_mean_ms or 0:.1f}",
            f"{a.decode_p50_ms or 0:.1f}",
            f"{a.decode_p99_ms or 0:.1f}",
            f"{s.decode_mean_ms or 0:.1f}",
            f"{s.decode_p50_ms or 0:.1f}",
            f"{lat_ratio:.2f}",
        )
    return table


def plot(report: BenchReport, path: str | Path) -> None:
    """GB/s against concurrency, one panel per request size, a line per mode (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError(PLOT_HINT) from exc
    sizes = sorted({c.pages for c in report.cells})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.6), squeeze=False)
    labels = {"kvwire": "kvwire (async workers)", "raw": "raw backend", "sync": "kvwire sync"}
    for ax, pages in zip(axes[0], sizes, strict=True):
        mib = 0.0
        for mode in MODES:
            cells = sorted(
                (c for c in report.cells if c.mode == mode and c.pages == pages),
                key=lambda c: c.concurrency,
            )
            mib = cells[0].request_bytes / 2**20 if cells else mib
            ax.plot(
                [c.concurrency for c in cells],
                [c.gbps for c in cells],
                marker="o",
                label=labels[mode],
            )
        concs = sorted({c.concurrency for c in report.cells})
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.minorticks_off()
        unit = "page" if pages == 1 else "pages"
        ax.set_title(f"{pages} {unit} ({mib:g} MiB) per request")
        ax.set_xlabel("requests in flight")
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(
        f"kvwire bench: {report.backend}, {report.machine.get('cpu_count')} CPUs", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sizes(args: argparse.Namespace, model: ModelSpec) -> list[int]:
    if args.mib:
        pb = page_bytes(model)
        bad = [m for m in args.mib if (m << 20) % pb]
        if bad:
            raise BenchError(f"--mib {bad} is not a multiple of the page ({pb >> 10} KiB)")
        return [(m << 20) // pb for m in args.mib]
    return list(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))


def _measure(args: argparse.Namespace, config: KVWireConfig, progress: Progress) -> BenchReport:
    model = model_for(args.page_kib or (QUICK_PAGE_KIB if args.quick else DEFAULT_PAGE_KIB))
    sizes = _sizes(args, model)
    conc = args.concurrency or list(QUICK_CONCURRENCY if args.quick else DEFAULT_CONCURRENCY)
    requests = args.requests or (QUICK_REQUESTS if args.quick else DEFAULT_REQUESTS)
    repeat = args.repeat or (QUICK_REPEAT if args.quick else DEFAULT_REPEAT)
    fan_c = args.fanout_concurrency or (
        QUICK_FANOUT_CONCURRENCY if args.quick else DEFAULT_FANOUT_CONCURRENCY
    )
    fan_sizes = list(args.fanout_sizes or DEFAULT_FANOUT_SIZES)
    extra = fanout_requests(fan_sizes, fan_c, args.fanout, requests, repeat) if args.fanout else 0
    if args.only_fanout:
        if not args.fanout:
            raise BenchError("--only-fanout needs --fanout N")
        task = progress.add_task("fan-out", total=extra)
        report = BenchReport(config.transfer_backend, [], [], [], [], {}, {"page_bytes": 0})
        report.machine = machine_info(config.transfer_backend)
        report.setup = {"page_bytes": page_bytes(model), "model": model.model_dump()}
    else:
        report = measure(config, sizes, conc, requests, repeat, progress, model, extra)
        task = progress.task_ids[-1]
    if args.fanout:
        cells, checks, problems = measure_fanout(
            config,
            fan_sizes,
            fan_c,
            args.fanout,
            requests,
            repeat,
            lambda k: progress.advance(task, k),
            lambda text: progress.update(task, description=text),
            model,
        )
        report.fanout = cells
        report.checks += checks
        report.failures += problems
        report.setup["fanout"] = {
            "decode_instances": args.fanout,
            "concurrency": fan_c,
            "sizes_pages": fan_sizes,
            "requests_per_batch": max(requests, MIN_WAVES * fan_c),
            "repeat": repeat,
        }
    return report


def render_latency(report: LatencyReport) -> Table:
    """The ``--latency`` table: every stage's p50, p99 and mean, then the totals."""
    m = report.machine
    cpu = ", ".join(f"{k} {v:.3f}" for k, v in report.cpu_ms.items() if v >= 0.0005)
    table = Table(
        title=f"kvwire bench --latency: {report.backend}, 1 prefill -> 1 decode, C=1, "
        f"{report.pages} page(s) of {report.page_bytes >> 10} KiB, {m.get('cpu_count')} CPUs",
        caption=f"{report.verified}/{report.requests} timed requests verified element by "
        f"element; engine loops poll every {report.engine_step_us:g} us; ms. CPU ms per "
        f"request by thread: {cpu}"
        + (
            "; staged first chunks by decode's offer: "
            + ", ".join(f"{k} {v}" for k, v in report.offers.items())
            if report.offers
            else ""
        ),
    )
    for col in ("stage", "from -> to", "p50", "p99", "mean"):
        table.add_column(col, justify="left" if col in ("stage", "from -> to") else "right")
    subs = {b_from: s for s in SUBSTAGES for b_from in (s[1],)}
    rows: list[tuple[str, str, str]] = []
    for st in STAGES:
        rows.append(st)
        sub = subs.get(st[1])
        if sub is not None and report.summary.get(sub[0], {}).get("p50") is not None:
            rows.append((f"  {sub[0]}", sub[1], sub[2]))
    last = len(rows) - 1
    for i, (name, a, b) in enumerate((*rows, *TOTALS)):
        s = report.summary.get(name.strip(), {})
        table.add_row(
            name,
            f"{a} -> {b}",
            f"{s.get('p50', 0):.3f}",
            f"{s.get('p99', 0):.3f}",
            f"{s.get('mean', 0):.3f}",
            end_section=i == last,
        )
    return table


def _run_latency(
    args: argparse.Namespace, config: KVWireConfig, console: Console, command: str
) -> int:
    """``kvwire bench --latency``."""
    sizes = _sizes(args, model_for(args.page_kib or LATENCY_PAGE_KIB)) if args.sizes else [1]
    if len(sizes) != 1:
        console.print("[red]error[/]: --latency takes one size (--sizes N)", highlight=False)
        return 1
    try:
        report = measure_latency(
            config,
            args.requests or LATENCY_REQUESTS,
            sizes[0],
            args.page_kib or LATENCY_PAGE_KIB,
            args.engine_step_us / 1e6,
            args.warmup,
        )
    except (BenchError, KVWireError) as exc:
        console.print(f"[red]error[/]: {type(exc).__name__}: {escape(str(exc))}", highlight=False)
        return 1
    report.command = command
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if not console.is_terminal:
        console.width = max(console.width, 120)
    for line in report.failures[:10]:
        console.print(f"[red]failed[/]: {escape(line)}", highlight=False)
    console.print(render_latency(report))
    if not report.ok_all:
        console.print("[red]kvwire bench --latency FAILED[/]", highlight=False)
        return 1
    return 0


def run(args: argparse.Namespace, console: Console, argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvwire bench``."""
    config = config_from_args(args)
    if config.transfer_backend == "auto":
        config = config.model_copy(update={"transfer_backend": auto_backend_name()})
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        console.print(f"[red]error[/]: {escape(PLOT_HINT)}", highlight=False)
        return 1
    command = shlex.join(["kvwire", *(argv or [])])
    if args.device == "cuda":
        from kvwire.bench import gpu_suite

        return gpu_suite.run(args, console, command)
    if args.engine is not None:
        from kvwire.plugins import get_registry

        name = config.transfer_backend
        try:
            bench = get_registry().engine_benchmark(name)
        except KVWireError as exc:
            console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
            return 1
        if bench is None:
            console.print(
                f"[red]error[/]: backend {name!r} registers no engine benchmark; for the tcp "
                "backend use `kvwire bench-backend`",
                highlight=False,
            )
            return 1
        return int(bench(list(args.engine)))
    if args.latency:
        return _run_latency(args, config, console, command)
    if args.compare_staging:
        from kvwire.bench import staging as staging_bench

        try:
            return staging_bench.run(args, config, console, command)
        except (ClusterError, KVWireError, RuntimeError) as exc:
            console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
            return 1
    t0 = time.monotonic()
    try:
        with progress_bar(console) as progress:
            report = _measure(args, config, progress)
    except (BenchError, ClusterError, KVWireError, RemoteAgentError) as exc:
        console.print(f"[red]error[/]: {type(exc).__name__}: {escape(str(exc))}", highlight=False)
        return 1
    report.command = command
    report.machine["duration_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.plot and report.cells:
        try:
            plot(report, args.plot)
        except BenchError as exc:
            console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
            return 1
    if not console.is_terminal:
        console.width = max(console.width, 150)  # the tables' columns, not cut (logs, files)
    for line in report.failures[:10]:
        console.print(f"[red]failed[/]: {escape(line)}", highlight=False)
    if report.cells:
        console.print(render(report))
    if report.fanout:
        console.print(render_fanout(report))
    if not report.ok:
        console.print(
            f"[red]kvwire bench FAILED[/]: {len(report.failures)} problem(s); failed "
            "requests are left out of the figures",
            highlight=False,
        )
        return 1
    return 0
