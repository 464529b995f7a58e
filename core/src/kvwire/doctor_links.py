"""``kvwire doctor``'s "Backends for this configuration" section: which transfer backends a
rank configured like this would construct here, why the others are not, and the rule each
applies per link (docs/failover.md); with ``--peer``, the links to a prefill instance
(:mod:`kvwire.doctor_peer`). Called by :func:`kvwire.cli.cmd_doctor` only."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from kvwire.config import config_from_args
from kvwire.doctor_peer import add_peer_args, peer_section
from kvwire.errors import KVWireError
from kvwire.layout import MemKind
from kvwire.link_choice import applied_staging
from kvwire.selection import plan_backends


def add_doctor_args(parser: argparse.ArgumentParser) -> None:
    """``kvwire doctor``'s own flags (besides an engine's, :func:`kvwire.config.add_cli_args`)."""
    parser.add_argument(
        "--pool",
        choices=("dram", "vram"),
        default="dram",
        help="memory of the KV pool of the rank to check (default: dram)",
    )
    add_peer_args(parser)


def links_section(args: argparse.Namespace, console: Console) -> list[str]:
    """Print the plan for the configuration in ``args`` (and ``KVWIRE_*``); return advice."""
    console.print("\n[bold]Backends for this configuration[/] (per link: docs/failover.md)")
    kinds = {MemKind.VRAM if getattr(args, "pool", "dram") == "vram" else MemKind.DRAM}
    try:
        config = config_from_args(args)
        plan = plan_backends(config, kinds=kinds)
    except KVWireError as exc:
        console.print(f"  [red]✗[/] {escape(str(exc))}", highlight=False)
        return [f"transfer backend: {exc}"]
    console.print(f"  --transfer-backend {config.transfer_backend}", highlight=False)
    for i, sel in enumerate(plan.selected):
        role = "first choice" if i == 0 else "fallback"
        console.print(f"  [green]✓[/] {sel.name} ({role})", highlight=False)
        console.print(f"      per link: {escape(sel.cls.link_rule)}", highlight=False)
    for name, why in plan.skipped.items():
        console.print(f"  [yellow]-[/] {name}: not used here: {escape(why)}", highlight=False)
    if plan.auto:
        general = plan.names[-1]
        console.print(
            "  auto picks per link: GPU pools on one host with P2P -> the link-only backend "
            f"(cudaipc) if usable; GPU pools across hosts -> staged bulk writes over {general}; "
            f"host pools -> {general} with the configured staging (--peer shows a peer's links)",
            highlight=False,
        )
        console.print(
            f"  staging applied (--staging {config.staging}): where advised 'staged': "
            f"{escape(applied_staging('staged', config.staging))}; where advised 'direct': "
            f"{escape(applied_staging('direct', config.staging))}",
            highlight=False,
        )
    else:
        console.print(
            "  each link takes the first of these that the peer also announces and whose "
            "per-link check passes; the next ones are its fallbacks (failover)",
            highlight=False,
        )
    return []


def peer_links_section(args: argparse.Namespace, console: Console) -> list[str]:
    """With ``--peer``: the links from a rank configured like ``args`` to that prefill
    instance (:func:`kvwire.doctor_peer.peer_section`); the problems found (empty: every
    link has a backend, or no ``--peer``)."""
    if not getattr(args, "peer", None):
        return []
    kinds = frozenset({MemKind.VRAM if getattr(args, "pool", "dram") == "vram" else MemKind.DRAM})
    try:
        config = config_from_args(args)
        plan = plan_backends(config, kinds=kinds)
    except KVWireError as exc:
        return [f"peer {args.peer}: not asked, this configuration is unusable: {exc}"]
    return peer_section(
        args.peer,
        plan,
        kinds,
        config.secret_bytes,
        console,
        dp_rank=args.peer_dp_rank,
        timeout_s=args.peer_timeout,
        staging=config.staging,
    )
