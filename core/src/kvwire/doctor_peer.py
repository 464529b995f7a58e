"""``kvwire doctor --peer HOST:PORT``: ask a prefill instance's bootstrap service what its
ranks announce (protocol, transfer backends, host identity) and say, per link from a rank
configured like this one, which backend the link will take and why, and why not the others
(docs/failover.md). Called by :func:`kvwire.doctor_links.links_section` only.

The bootstrap service's rank lookup (``GET /v1/ranks``, read-only, signed like every
request when a secret is set) carries what each prefill rank registered: from protocol 1.8
its backends, whether ``auto`` chose them and its host identity (:class:`RankInfo`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape

from kvwire.control.bootstrap import BootstrapClient, RankInfo
from kvwire.control.wire import PROTOCOL_MAJOR, PROTOCOL_MINOR
from kvwire.errors import BootstrapError
from kvwire.layout import MemKind
from kvwire.link_choice import (
    LinkFacts,
    LinkPath,
    applied_staging,
    choose_link_path,
    host_identity,
)
from kvwire.plugins import Kind, PluginRegistry, get_registry
from kvwire.selection import BackendPlan

#: The per-link checks doctor cannot run from here (they need the peer's engine metadata).
HANDSHAKE_CHECKS = (
    "each backend's own per-link check with the peer's engine metadata (P2P between the "
    "two GPUs, the peer's handles) runs at handshake; its log line "
    "('handshake with ...; backend ...') has the final word"
)


def add_peer_args(parser: argparse.ArgumentParser) -> None:
    """``kvwire doctor``'s flags for asking a peer."""
    parser.add_argument(
        "--peer",
        metavar="HOST:PORT",
        help="bootstrap address of a prefill instance: show what its ranks announce and "
        "which backend each link from a rank configured like this would use (the shared "
        "secret comes from KVWIRE_SECRET, as for a rank)",
    )
    parser.add_argument(
        "--peer-dp-rank", type=int, default=0, help="the prefill dp rank to ask for (default 0)"
    )
    parser.add_argument(
        "--peer-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for every rank of that dp rank to be registered (default 5)",
    )


@dataclass(frozen=True)
class PeerLink:
    """The verdict for the link between a rank configured like this one and one prefill
    rank: the rule's answer, or why the peer cannot be judged (``problem``)."""

    rank: RankInfo
    same_host: bool | None
    path: LinkPath | None
    problem: str | None


def judge_link(
    rank: RankInfo,
    plan: BackendPlan,
    kinds: frozenset[MemKind],
    registry: PluginRegistry | None = None,
    here: dict[str, str] | None = None,
) -> PeerLink:
    """The link from a decode rank with ``plan`` (and pools of ``kinds``) to prefill rank
    ``rank``, as its handshake would choose it: prefill's order (its announced list), each
    backend checked for what can be told from here (configured on both sides; a link-only
    backend needs one host), then :func:`choose_link_path`. Pure apart from the registry."""
    reg = registry or get_registry()
    here = here if here is not None else host_identity()
    same = (rank.host == here) if rank.host else None
    if rank.protocol != PROTOCOL_MAJOR:
        why = (
            f"speaks control protocol {rank.protocol}.x, this kvwire {PROTOCOL_MAJOR}."
            f"{PROTOCOL_MINOR}: the handshake will be refused; run one kvwire major on both sides"
        )
        return PeerLink(rank, same, None, why)
    if rank.protocol_minor is None or not rank.backends:
        why = (
            "announces no backends: it (or its bootstrap service) runs kvwire older than "
            "protocol 1.8; its link takes its one backend if this rank has it (put the "
            "backend both sides share first here)"
        )
        return PeerLink(rank, same, None, why)
    mine = set(plan.names)
    link_only = {n for n, e in reg.entries[Kind.BACKEND].items() if e.impl.link_only}
    candidates: list[tuple[str, str | None]] = []
    skipped: dict[str, str] = {}
    for name in rank.backends:
        if name not in mine:
            unusable = plan.skipped.get(name)
            skipped[name] = (
                f"not usable here: {unusable}" if unusable else "not configured on this rank"
            )
            continue
        if name in link_only and same is False:
            there, mine_host = rank.host.get("hostname"), here.get("hostname")
            candidates.append((name, f"different hosts (peer on {there!r}, here {mine_host!r})"))
            continue
        candidates.append((name, None))
    for name in plan.names:
        if name not in rank.backends:
            skipped[name] = "the peer does not announce it"
    facts = LinkFacts(
        candidates,
        link_only=frozenset(link_only),
        local_kinds=kinds,
        peer_kinds=None,
        same_host=same,
        auto=rank.backend_auto,
    )
    path = choose_link_path(facts)
    path = LinkPath(path.backend, path.fallbacks, path.staging, path.why,
                    {**skipped, **path.skipped})  # fmt: skip
    return PeerLink(rank, same, path, None)


def peer_section(
    address: str,
    plan: BackendPlan,
    kinds: frozenset[MemKind],
    secret: bytes | None,
    console: Console,
    dp_rank: int = 0,
    timeout_s: float = 5.0,
    staging: str = "direct",
) -> list[str]:
    """Print what the prefill ranks behind bootstrap ``address`` announce and each link's
    verdict (with the staging the rule advises and what ``staging``, the KV pool's
    strategy, makes of it); return advice (empty when every link has a backend)."""
    console.print(f"\n[bold]Links to the peer at {escape(address)}[/] (prefill dp_rank {dp_rank})")
    try:
        ranks = BootstrapClient(address, secret).lookup(dp_rank, timeout_s)
    except BootstrapError as exc:
        console.print(f"  [red]✗[/] {escape(str(exc))}", highlight=False)
        return [f"peer {address}: {exc}"]
    advice: list[str] = []
    for rank in ranks:
        link = judge_link(rank, plan, kinds)
        where = {True: "this host", False: "another host", None: "host not announced"}
        host = rank.host.get("hostname", "?") if rank.host else "?"
        minor = "?" if rank.protocol_minor is None else rank.protocol_minor
        backends = ",".join(rank.backends) or "none announced"
        auto = " (auto)" if rank.backend_auto else ""
        console.print(
            f"  {escape(rank.agent)} ({rank.describe()}) at {escape(rank.endpoint)}: protocol "
            f"{rank.protocol}.{minor}, {where[link.same_host]} ({escape(host)}), backends "
            f"{escape(backends)}{auto}",
            highlight=False,
        )
        if link.problem is not None:
            console.print(f"    [red]✗[/] {escape(link.problem)}", highlight=False)
            advice.append(f"peer {rank.agent}: {link.problem}")
            continue
        assert link.path is not None
        path = link.path
        if path.backend is None:
            reasons = "; ".join(f"{k}: {v}" for k, v in path.skipped.items())
            console.print(f"    [red]✗[/] no backend serves this link: {escape(reasons)}")
            advice.append(f"peer {rank.agent}: no shared backend ({reasons})")
            continue
        fallbacks = f" (fallbacks: {', '.join(path.fallbacks)})" if path.fallbacks else ""
        console.print(
            f"    [green]✓[/] backend {path.backend}{fallbacks}: {escape(path.why)}; "
            f"staging advice: {path.staging}; applied: "
            f"{escape(applied_staging(path.staging, staging))}",
            highlight=False,
        )
        for name, why in path.skipped.items():
            console.print(f"    [yellow]-[/] {name}: {escape(why)}", highlight=False)
    if ranks:
        console.print(f"  {HANDSHAKE_CHECKS}", highlight=False)
    return advice
