"""The ``kvwire`` command: ``plugins``, ``doctor``, ``demo``, ``bench-backend``, ``bootstrap``."""

from __future__ import annotations

import argparse
import ctypes.util
import logging
import os
import platform
import signal
import sys
import threading
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from types import FrameType

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvwire.plugins import Kind, get_registry

logger = logging.getLogger(__name__)

#: Distributions of transfer engines kvwire plugins use, for `kvwire doctor`.
ENGINE_DISTRIBUTIONS = {
    "NIXL": ["nixl", "nixl-cu12", "nixl-cu13"],
    "Mooncake Transfer Engine": [
        "mooncake-transfer-engine",
        "mooncake-transfer-engine-non-cuda",
        "mooncake-transfer-engine-cuda13",
    ],
}


def _dist_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cmd_plugins(args: argparse.Namespace, console: Console) -> int:
    """List every registered implementation with its origin and import status."""
    reg = get_registry()
    table = Table(title="kvwire plugins")
    for col in ("name", "kind", "distribution", "version", "plugin API", "import status"):
        table.add_column(col, overflow="fold")
    for kind in Kind:
        for name in reg.names(kind):
            entry = reg.entries[kind][name]
            _, err = reg.try_resolve(kind, name)
            failed = escape(entry.import_error or err or "")
            status = "[green]ok[/]" if err is None else f"[red]failed[/]: {failed}"
            table.add_row(name, str(kind), entry.distribution, entry.version, entry.api, status)
    for b in reg.broken:
        table.add_row(
            f"({b.plugin})",
            "plugin",
            b.distribution,
            b.version,
            "",
            f"[red]broken[/]: {escape(b.error)}",
        )
    console.print(table)
    for c in reg.conflicts:
        console.print(
            f"[yellow]conflict[/]: {c.kind} {c.name!r} from {c.refused} refused; kept {c.kept}"
        )
    return 0


def cmd_doctor(args: argparse.Namespace, console: Console) -> int:
    """Report what is installed and usable, and what to do about anything missing."""
    reg = get_registry()
    console.print(f"[bold]kvwire[/] {_dist_version('kvwire') or 'source'}  ")
    console.print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}")
    for dist in ("numpy", "pyzmq", "pydantic", "pluggy", "torch"):
        console.print(f"  {dist:<10} {_dist_version(dist) or '[yellow]not installed[/]'}")
    try:
        import torch

        cuda = torch.cuda.is_available()
        where = f"available: {torch.cuda.device_count()} GPU(s)" if cuda else "not available"
        console.print(f"  CUDA       {where}")
    except ImportError:
        console.print("  torch is not installed: tensors must be described with raw pointers")
    console.print("\n[bold]Transfer engines[/]")
    for engine, dists in ENGINE_DISTRIBUTIONS.items():
        found = [f"{d} {v}" for d in dists if (v := _dist_version(d))]
        console.print(f"  {engine:<26} {', '.join(found) if found else 'not installed'}")
    ibverbs = ctypes.util.find_library("ibverbs")
    console.print(f"  {'libibverbs (system)':<26} {ibverbs or 'not found'}")
    console.print("\n[bold]Transfer backends[/]")
    usable = 0
    advice: list[str] = []
    for name in reg.names(Kind.BACKEND):
        cls, err = reg.try_resolve(Kind.BACKEND, name)
        if cls is None:
            console.print(f"  [red]✗[/] {name}: {err}")
            advice.append(f"fix or uninstall the plugin providing {name!r} (see above)")
            continue
        usable += 1
        caps = cls.capabilities
        what = [k for k in ("write", "read", "notifications", "dram", "vram") if getattr(caps, k)]
        console.print(f"  [green]✓[/] {name}: {', '.join(what)}")
    console.print("\n[bold]Engine checks[/]")
    for plugin, check in reg.doctor_checks():
        mark = "[green]✓[/]" if check.ok else "[red]✗[/]"
        console.print(f"  {mark} {check.subject} ({plugin}): {check.detail}")
        if not check.ok and check.fix:
            advice.append(f"{check.subject}: {check.fix}")
    for b in reg.broken:
        console.print(f"  [red]✗[/] plugin {b.plugin} ({b.distribution} {b.version}): {b.error}")
        advice.append(f"reinstall or remove {b.distribution}: its entry point does not import")
    from kvwire.doctor_links import links_section, peer_links_section

    advice += links_section(args, console)
    peer_problems = peer_links_section(args, console)
    advice += peer_problems
    advice += _doctor_security(console)
    if "nixl" not in reg.entries[Kind.BACKEND]:
        advice.append("for NIXL: install the kvwire-nixl plugin (pip install kvwire-nixl)")
    if "mooncake" not in reg.entries[Kind.BACKEND]:
        advice.append(
            "for Mooncake: install the kvwire-mooncake plugin (pip install kvwire-mooncake)"
        )
    if advice:
        console.print("\n[bold]What to do[/]")
        for line in advice:
            console.print(f"  - {line}")
    return 0 if usable and not peer_problems else 1


def _doctor_security(console: Console) -> list[str]:
    """``kvwire doctor``'s security section, from this environment's ``KVWIRE_*`` settings:
    the secret, and every address a rank would listen on. Returns advice lines."""
    from kvwire.config import KVWireConfig
    from kvwire.security import exposure_checks

    console.print("\n[bold]Security[/] (from KVWIRE_* in this environment; docs/security.md)")
    try:
        config = KVWireConfig()
    except Exception as exc:  # a broken environment is reported, not raised
        console.print(f"  [red]✗[/] configuration: {exc}", highlight=False)
        return [f"fix the KVWIRE_* environment: {exc}"]
    advice = []
    for check in exposure_checks(config):
        mark = "[green]✓[/]" if check.ok else "[red]✗[/]"
        console.print(f"  {mark} {check.subject}: {check.detail}", highlight=False)
        if not check.ok and check.fix:
            advice.append(f"{check.subject}: {check.fix}")
    return advice


def _is_loopback(host: str) -> bool:
    from kvwire.security import is_loopback

    return is_loopback(host)


def cmd_bootstrap(args: argparse.Namespace, console: Console) -> int:
    """Run the bootstrap service in the foreground until SIGINT or SIGTERM.

    The shared secret comes from ``KVWIRE_SECRET`` (never the command line, where ``ps`` would
    show it).
    """
    from kvwire.control.bootstrap_server import BootstrapServer
    from kvwire.errors import BootstrapError, ConfigError
    from kvwire.security import enforce_secret_policy

    secret = os.environ.get("KVWIRE_SECRET", "").encode() or None
    required = os.environ.get("KVWIRE_REQUIRE_SECRET", "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )
    try:
        enforce_secret_policy(required, secret, "kvwire bootstrap")
    except ConfigError as e:
        console.print(f"[red]error[/]: {e}", highlight=False)
        return 1
    if secret is None and not _is_loopback(args.host):
        console.print(
            f"[yellow]warning[/]: listening on {args.host} without a shared secret: anyone who "
            "can reach it can register ranks; set KVWIRE_SECRET on every prefill and decode "
            "instance and here",
            highlight=False,
        )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = BootstrapServer(args.host, args.port, secret)
    try:
        server.start()
    except BootstrapError as e:
        console.print(f"[red]error[/]: {e}", highlight=False)
        return 1
    try:
        auth = "with shared secret" if secret else "without shared secret"
        # Keep this line's shape stable: scripts and tests parse the address from it.
        console.print(
            f"kvwire bootstrap listening on {server.address} ({auth})",
            highlight=False,
            soft_wrap=True,
        )
        while not stop.wait(0.1):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    console.print("kvwire bootstrap stopped", highlight=False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``kvwire`` command."""
    from kvwire import demo
    from kvwire.bench import layerwise as layerwise_bench
    from kvwire.bench.cli import add_bench_args
    from kvwire.config import add_cli_args
    from kvwire.doctor_links import add_doctor_args

    parser = argparse.ArgumentParser(prog="kvwire", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list backends, mappers and staging strategies")
    p_doctor = sub.add_parser(
        "doctor",
        help="check what is installed and usable, and which backends a rank configured with "
        "the same flags would use per link",
    )
    add_cli_args(p_doctor)
    add_doctor_args(p_doctor)
    p_demo = sub.add_parser("demo", help="run a real cross-process KV transfer and verify it")
    add_cli_args(p_demo)
    demo.add_demo_args(p_demo)
    p_bench = sub.add_parser("bench-backend", help="raw backend throughput between two processes")
    add_cli_args(p_bench)
    p_bench.add_argument("--repeat", type=int, default=3, help="timed repetitions per case")
    p_bench.add_argument("--json", metavar="PATH", help="write results as JSON")
    p_cbench = sub.add_parser(
        "bench",
        help="kvwire end to end vs the raw backend, and async workers vs sync, in one run",
    )
    add_cli_args(p_cbench)
    add_bench_args(p_cbench)
    p_lbench = sub.add_parser(
        "bench-layerwise",
        help="time to decode-ready: layer-wise vs per-chunk transfer behind a real forward pass",
    )
    layerwise_bench.add_args(p_lbench)
    p_boot = sub.add_parser(
        "bootstrap",
        help="run the bootstrap service in the foreground (secret from KVWIRE_SECRET)",
    )
    p_boot.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only)"
    )
    p_boot.add_argument(
        "--port", type=int, default=8998, help="port to listen on (0: any free port)"
    )
    p_new = sub.add_parser(
        "new-plugin", help="write the starting point of a third-party backend plugin"
    )
    p_new.add_argument("name", help="the backend's name (lowercase, e.g. myengine)")
    p_new.add_argument("--dir", help="where to write it (default: ./kvwire-NAME)")
    p_new.add_argument("--force", action="store_true", help="write into a non-empty --dir")
    return parser


def cmd_new_plugin(args: argparse.Namespace, console: Console) -> int:
    """Write the plugin template (see :mod:`kvwire.plugin_template`)."""
    from pathlib import Path

    from kvwire.errors import ConfigError
    from kvwire.plugin_template import write_plugin

    dest = Path(args.dir or f"kvwire-{args.name.replace('_', '-')}")
    try:
        written = write_plugin(args.name, dest, force=args.force)
    except ConfigError as e:
        console.print(f"[red]error[/]: {e}", highlight=False)
        return 2
    for path in written:
        console.print(f"  wrote {path}", highlight=False, markup=False)
    console.print(
        f"next: implement src/kvwire_{args.name}/backend.py, then "
        f"`uv pip install -e '{dest}[test]'` and `pytest {dest}`",
        highlight=False,
        markup=False,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvwire`` command."""
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    if args.command == "plugins":
        return cmd_plugins(args, console)
    if args.command == "doctor":
        return cmd_doctor(args, console)
    if args.command == "demo":
        from kvwire import demo

        return demo.run(args, console)
    if args.command == "bench-backend":
        from kvwire.bench import backend as backend_bench

        return backend_bench.run(args, console)
    if args.command == "bench":
        from kvwire.bench import cli as bench_cli

        return bench_cli.run(args, console, sys.argv[1:] if argv is None else argv)
    if args.command == "bench-layerwise":
        from kvwire.bench import layerwise as layerwise_bench

        return layerwise_bench.run(args, console)
    if args.command == "new-plugin":
        return cmd_new_plugin(args, console)
    if args.command == "bootstrap":
        return cmd_bootstrap(args, console)
    return 2


if __name__ == "__main__":
    sys.exit(main())
