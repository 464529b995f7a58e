"""The per-link rule (issue 27 item 5; docs/failover.md, "The choice, per link"):
:func:`kvwire.link_choice.choose_link_path` as a table, and its wiring into the real
selection (``MultiBackend.add_link``, a single backend's ``add_link``, the handshake log).

The table feeds the rule *fake capability facts* (GPU pools, one host, P2P verdicts) that
no machine here has: the rule is pure, so the facts are all it sees. The wiring tests run
real ``tcp`` backends on CPU; ``fakeipc`` there is ``tcp`` under another name declared
link-only, standing in for ``cudaipc`` (which refuses every link without CUDA).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from kvwire.backends.multi import MultiBackend
from kvwire.backends.tcp import TcpBackend
from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import MemKind, MemoryRegion
from kvwire.link_choice import LinkFacts, choose_link_path, host_identity
from kvwire.testing.pair import Pair

GPU = frozenset({MemKind.VRAM})
HOST = frozenset({MemKind.DRAM})
OTHER_HOST = "different hosts (peer on 'b' boot 'x', this rank on 'a' boot 'y')"
NO_P2P = "no P2P from cuda:0 to cuda:1"

# fmt: off
#: (id, facts, backend, fallbacks, staging, words the reason must contain)
TABLE: list[tuple[str, LinkFacts, str | None, tuple[str, ...], str, tuple[str, ...]]] = [
    (
        "gpu-same-host-p2p",
        LinkFacts([("cudaipc", None), ("nixl", None), ("tcp", None)], frozenset({"cudaipc"}),
                  GPU, GPU, same_host=True),
        "cudaipc", ("nixl", "tcp"), "direct", ("one host with P2P", "cudaipc"),
    ),
    (
        "gpu-across-hosts",
        LinkFacts([("cudaipc", OTHER_HOST), ("nixl", None), ("tcp", None)],
                  frozenset({"cudaipc"}), GPU, GPU, same_host=False),
        "nixl", ("tcp",), "staged", ("across hosts", "staged bulk writes over nixl", OTHER_HOST),
    ),
    (
        "gpu-same-host-no-p2p",
        LinkFacts([("cudaipc", NO_P2P), ("mooncake", None)], frozenset({"cudaipc"}), GPU, GPU,
                  same_host=True),
        "mooncake", (), "staged", ("without a same-host path", NO_P2P, "over mooncake"),
    ),
    (
        "gpu-no-link-only-installed",
        LinkFacts([("nixl", None)], frozenset(), GPU, GPU, same_host=False),
        "nixl", (), "staged", ("across hosts",),
    ),
    (
        "host-pools",
        LinkFacts([("cudaipc", "this rank registered no VRAM"), ("tcp", None)],
                  frozenset({"cudaipc"}), HOST, HOST, same_host=True),
        "tcp", (), "configured", ("host pools", "tcp with the configured staging"),
    ),
    (
        "host-pools-link-only-kept-as-fallback",
        LinkFacts([("cudaipc", None), ("tcp", None)], frozenset({"cudaipc"}), HOST, HOST),
        "tcp", ("cudaipc",), "configured", ("host pools",),
    ),
    (
        "gpu-to-host-pool",  # HiSparse: prefill's GPU into decode's host memory
        LinkFacts([("nixl", None), ("tcp", None)], frozenset(), GPU, HOST, same_host=False),
        "nixl", ("tcp",), "configured", ("a host pool on one side",),
    ),
    (
        "peer-pools-unknown",
        LinkFacts([("nixl", None)], frozenset(), GPU, None, same_host=False),
        "nixl", (), "staged", ("taken to be like this rank's",),
    ),
    (
        "host-unknown-cudaipc-accepts",  # an old peer without host identity: cudaipc decided
        LinkFacts([("cudaipc", None), ("nixl", None)], frozenset({"cudaipc"}), GPU, GPU),
        "cudaipc", ("nixl",), "direct", ("cudaipc writes decode's pages",),
    ),
    (
        "only-link-only-left",
        LinkFacts([("cudaipc", None), ("nixl", "refused")], frozenset({"cudaipc"}), HOST, HOST),
        "cudaipc", (), "direct", ("only backend left",),
    ),
    (
        "list-keeps-its-order",
        LinkFacts([("tcp", None), ("cudaipc", None), ("nixl", None)], frozenset({"cudaipc"}),
                  GPU, GPU, same_host=True, auto=False),
        "tcp", ("cudaipc", "nixl"), "configured", ("first of the configured list",),
    ),
    (
        "one-named-backend",
        LinkFacts([("mooncake", None)], frozenset(), GPU, GPU, same_host=False, auto=False),
        "mooncake", (), "configured", ("the configured backend",),
    ),
    (
        "one-named-page-writer",  # a named cudaipc: it writes decode's pages, never staged
        LinkFacts([("cudaipc", None)], frozenset(), GPU, GPU, same_host=True, auto=False,
                  page_writers=frozenset({"cudaipc"})),
        "cudaipc", (), "direct", ("the configured backend", "writes decode's pages itself"),
    ),
    (
        "list-led-by-a-link-only-backend",
        LinkFacts([("cudaipc", None), ("nixl", None)], frozenset({"cudaipc"}), GPU, GPU,
                  same_host=True, auto=False),
        "cudaipc", ("nixl",), "direct", ("first of the configured list", "pages itself"),
    ),
    (
        "list-led-by-a-general-backend",  # its first pick does not write pages: as configured
        LinkFacts([("nixl", None), ("cudaipc", None)], frozenset({"cudaipc"}), GPU, GPU,
                  same_host=True, auto=False, page_writers=frozenset({"cudaipc"})),
        "nixl", ("cudaipc",), "configured", ("first of the configured list",),
    ),
    (
        "nothing-serves",
        LinkFacts([("cudaipc", OTHER_HOST), ("nixl", "down")], frozenset({"cudaipc"}), GPU, GPU),
        None, (), "configured", ("no candidate",),
    ),
]
# fmt: on


@pytest.mark.parametrize(("facts", "backend", "fallbacks", "staging", "words"),
                         [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])  # fmt: skip
def test_rule_table(
    facts: LinkFacts,
    backend: str | None,
    fallbacks: tuple[str, ...],
    staging: str,
    words: tuple[str, ...],
) -> None:
    path = choose_link_path(facts)
    assert (path.backend, path.fallbacks, path.staging) == (backend, fallbacks, staging), path
    for w in words:
        assert w in path.why, (w, path.why)
    # every candidate that was refused is named with its own reason, and only those
    assert path.skipped == {n: why for n, why in facts.candidates if why is not None}


# ---------------------------------------------------------------------------------- wiring
class FakeIpc(TcpBackend):
    """``tcp`` under another name, declared link-only below (see the module docstring)."""

    name = "fakeipc"


def _link(auto: bool) -> tuple[Any, MultiBackend, MultiBackend]:
    buf = np.zeros(1 << 14, dtype=np.uint8)
    region = MemoryRegion.from_tensor(buf, item_len=4096)
    ranks = []
    for agent in ("p", "d"):
        m = MultiBackend(agent, [FakeIpc(agent), TcpBackend(agent)], auto=auto,
                         link_only={"fakeipc"})  # fmt: skip
        m.register([region])
        ranks.append(m)
    pre, dec = ranks
    choice = pre.add_link(dec.offers(), host_identity())
    return choice, pre, dec


def test_multibackend_takes_the_rules_pick() -> None:
    """auto on host pools: the rule puts the general backend first although the link-only
    one is first in the member order; a list keeps its order."""
    choice, pre, dec = _link(auto=True)
    try:
        assert (choice.backend, choice.fallbacks) == ("tcp", ("fakeipc",)), choice
        assert choice.staging == "configured"
        assert "auto: host pools" in choice.why and "tcp with the configured staging" in choice.why
        assert "auto: host pools" in choice.describe()
        assert pre.link_backend(choice.peer) == "tcp"
    finally:
        pre.close()
        dec.close()
    choice, pre, dec = _link(auto=False)
    try:
        assert (choice.backend, choice.fallbacks) == ("fakeipc", ("tcp",)), choice
        assert "first of the configured list" in choice.why
        assert pre.link_backend(choice.peer) == "fakeipc"
    finally:
        pre.close()
        dec.close()


def test_handshake_log_says_which_and_why(caplog: pytest.LogCaptureFixture) -> None:
    """``auto`` on this machine is one backend (no MultiBackend): its link still carries the
    rule's reason, and the prefill rank's handshake log line says it."""
    c = KVWireConfig(
        transfer_backend="auto",
        control=ControlOptions(heartbeat_interval_s=0.5, handshake_timeout_s=5.0),
    )
    caplog.set_level(logging.INFO, logger="kvwire.session")
    p = Pair(c, c)
    try:
        p.transfer(1)
        assert p.prefill.backend.auto
        (peer,) = p.prefill.peers.snapshot()
        choice = peer.link.choice
        assert "auto: host pools" in choice.why, choice
        lines = [r.getMessage() for r in caplog.records if "handshake with" in r.getMessage()]
        assert any(f"backend {choice.backend}: auto: host pools" in line for line in lines), lines
    finally:
        p.close()
    named = KVWireConfig(transfer_backend="tcp", control=c.control)
    p = Pair(named, named)
    try:
        p.transfer(2)
        assert not p.prefill.backend.auto
        (peer,) = p.prefill.peers.snapshot()
        assert peer.link.choice.why == "the configured backend", peer.link.choice
    finally:
        p.close()


class PageTcp(TcpBackend):
    """``tcp`` declaring ``page_writes`` (standing in for a named ``cudaipc``); only its
    ``add_link`` runs here, no transfer."""

    name = "pagetcp"
    capabilities = TcpBackend.capabilities.model_copy(update={"page_writes": True})


@pytest.mark.parametrize("cls", [PageTcp, TcpBackend])
def test_a_named_page_writer_is_never_staged(cls: type[TcpBackend]) -> None:
    """A backend named alone that writes decode's pages itself asks for no staging (the
    default ``--staging auto`` staged a named ``cudaipc``'s links through the ring: 0.55x
    of page form at 128 MiB C=8 on two H200s); one that does not keeps the configured
    staging."""
    buf = np.zeros(1 << 14, dtype=np.uint8)
    region = MemoryRegion.from_tensor(buf, item_len=4096)
    pre, dec = cls("p"), cls("d")
    try:
        for b in (pre, dec):
            b.register([region])
        choice = pre.add_link([(dec.name, dec.local_metadata())], host_identity())
        writes = cls is PageTcp
        assert choice.staging == ("direct" if writes else "configured"), choice
        assert ("writes decode's pages itself" in choice.why) == writes, choice.why
    finally:
        pre.close()
        dec.close()
