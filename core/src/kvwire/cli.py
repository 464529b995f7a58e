"""The ``kvwire`` command: ``plugins``, ``doctor``, ``demo``, ``bench-backend``."""

from __future__ import annotations

import argparse
import ctypes.util
import logging
import platform
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from rich.console import Console
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
    for col in ("name", "kind", "distribution", "version", "import status"):
        table.add_column(col)
    for kind in Kind:
        for name in reg.names(kind):
            entry = reg.entries[kind][name]
            _, err = reg.try_resolve(kind, name)
            status = "[green]ok[/]" if err is None else f"[red]failed[/]: {entry.import_error}"
            table.add_row(name, str(kind), entry.distribution, entry.version, status)
    for b in reg.broken:
        table.add_row(
            f"({b.plugin})", "plugin", b.distribution, b.version, f"[red]broken[/]: {b.error}"
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
    return 0 if usable else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``kvwire`` command."""
    from kvwire import demo
    from kvwire.config import add_cli_args

    parser = argparse.ArgumentParser(prog="kvwire", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list backends, mappers and staging strategies")
    sub.add_parser("doctor", help="check what is installed and usable")
    p_demo = sub.add_parser("demo", help="run a real cross-process KV transfer and verify it")
    add_cli_args(p_demo)
    demo.add_demo_args(p_demo)
    p_bench = sub.add_parser("bench-backend", help="raw backend throughput between two processes")
    add_cli_args(p_bench)
    p_bench.add_argument("--repeat", type=int, default=3, help="timed repetitions per case")
    p_bench.add_argument("--json", metavar="PATH", help="write results as JSON")
    return parser


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
        from kvwire.testing import backend_bench

        return backend_bench.run(args, console)
    return 2


if __name__ == "__main__":
    sys.exit(main())
