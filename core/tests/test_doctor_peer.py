"""``kvwire doctor --peer HOST:PORT`` (docs/failover.md): what a prefill instance's ranks
announce through its bootstrap service, and each link's verdict, on CPU.

A real prefill manager (``tcp``, its own bootstrap service) is asked; an older prefill rank
is a real bootstrap service holding a registration without the 1.8 fields (what such a rank
sends), and an unreachable peer is a port where nothing listens.
"""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from rich.console import Console

from kvwire.cli import build_parser, cmd_doctor
from kvwire.config import ControlOptions, KVWireConfig
from kvwire.control.bootstrap import BootstrapClient, RankInfo
from kvwire.control.bootstrap_server import BootstrapServer
from kvwire.control.wire import PROTOCOL_MINOR
from kvwire.doctor_links import peer_links_section
from kvwire.doctor_peer import judge_link
from kvwire.layout import MemKind
from kvwire.selection import BackendPlan, auto_backend_name, plan_backends
from kvwire.testing.pair import Pair

SECRET = "s3cret-for-the-doctor-test-0123456789abcdef"


def cfg(backend: str, secret: str | None = None) -> KVWireConfig:
    control = ControlOptions(heartbeat_interval_s=0.5, handshake_timeout_s=5.0)
    return KVWireConfig(transfer_backend=backend, secret=secret, control=control)


def ask(argv: list[str]) -> tuple[list[str], str]:
    """Run the peer section of ``kvwire doctor ARGV``: (problems, printed text)."""
    out = io.StringIO()
    console = Console(file=out, width=400, color_system=None)
    args = build_parser().parse_args(["doctor", *argv])
    problems = peer_links_section(args, console)
    return problems, out.getvalue()


@pytest.fixture
def prefill_auto() -> Iterator[Pair]:
    p = Pair(cfg("auto"), cfg("auto"))
    try:
        yield p
    finally:
        p.close()


def test_asks_a_live_prefill_instance(prefill_auto: Pair, monkeypatch: Any) -> None:
    """Both sides on ``auto`` (here: the highest-priority general backend installed, one
    host, host pools): doctor names the peer's protocol, host and backends, and the link's
    backend with auto's reason, which the real link then gives too."""
    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    general = auto_backend_name()
    addr = prefill_auto.addr
    problems, text = ask(["--peer", addr, "--transfer-backend", "auto"])
    assert problems == [], text
    agent = prefill_auto.prefill.agent_name
    assert f"Links to the peer at {addr}" in text
    assert agent in text and f"protocol 1.{PROTOCOL_MINOR}" in text, text
    assert "this host" in text and f"backends {general} (auto)" in text, text
    assert f"✓ backend {general}: auto: host pools" in text, text
    assert "staging advice: configured; applied: auto -> --staging direct" in text, text
    assert "runs at handshake" in text  # what doctor cannot check from here is said
    prefill_auto.transfer(1)
    (peer,) = prefill_auto.prefill.peers.snapshot()
    assert peer.link.choice.backend == general and "auto: host pools" in peer.link.choice.why


def test_whole_doctor_fails_when_no_backend_is_shared(monkeypatch: Any) -> None:
    """A peer that announces only a backend this rank does not have: every reason is printed
    and ``kvwire doctor`` exits 1."""
    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    out = io.StringIO()
    rank = _old_rank(protocol_minor=PROTOCOL_MINOR, backends=["elsewhere-only"])
    with BootstrapServer() as server:
        BootstrapClient(server.address).register(rank)
        args = build_parser().parse_args(
            ["doctor", "--peer", server.address, "--transfer-backend", "tcp"]
        )
        rc = cmd_doctor(args, Console(file=out, width=400, color_system=None))
    text = out.getvalue()
    assert rc == 1, text
    assert "no backend serves this link" in text, text
    assert "elsewhere-only: not configured on this rank" in text, text
    assert "tcp: the peer does not announce it" in text, text


def test_secret_is_used_and_a_wrong_one_is_named(monkeypatch: Any) -> None:
    p = Pair(cfg("tcp", SECRET), cfg("tcp", SECRET))
    try:
        monkeypatch.setenv("KVWIRE_SECRET", SECRET)
        problems, text = ask(["--peer", p.addr, "--transfer-backend", "tcp"])
        assert problems == [], text
        assert "✓ backend tcp: the configured backend" in text, text
        monkeypatch.setenv("KVWIRE_SECRET", "not-" + SECRET)
        problems, text = ask(["--peer", p.addr, "--transfer-backend", "tcp"])
        assert len(problems) == 1 and "refused the shared secret" in problems[0], problems
        assert "KVWIRE_SECRET" in text, text
        monkeypatch.delenv("KVWIRE_SECRET")
        problems, _ = ask(["--peer", p.addr, "--transfer-backend", "tcp"])
        assert len(problems) == 1 and "refused the shared secret" in problems[0], problems
    finally:
        p.close()


def test_unreachable_peer_is_named_at_once(monkeypatch: Any) -> None:
    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    problems, text = ask(["--peer", f"127.0.0.1:{port}", "--peer-timeout", "30"])
    assert len(problems) == 1, text
    assert "unreachable" in problems[0] and f"127.0.0.1:{port}" in problems[0], problems
    assert "nothing serves there" in text, text


def _old_rank(**fields: Any) -> RankInfo:
    base: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "endpoint": "tcp://127.0.0.1:1",
        "agent": "old-prefill",
        "session": "s1",
    }
    return RankInfo(**(base | fields))


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({}, "older than protocol 1.8"),  # a 1.7 rank registers none of the new fields
        ({"protocol": 2, "protocol_minor": 0, "backends": ["tcp"]}, "control protocol 2.x"),
    ],
    ids=["older-minor", "other-major"],
)
def test_old_or_incompatible_peer_is_explained(
    fields: dict[str, Any], words: str, monkeypatch: Any
) -> None:
    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    with BootstrapServer() as server:
        BootstrapClient(server.address).register(_old_rank(**fields))
        problems, text = ask(["--peer", server.address, "--transfer-backend", "tcp"])
    assert len(problems) == 1 and words in problems[0], (problems, text)
    assert "old-prefill" in text


def test_link_only_backend_on_another_host_is_passed_over() -> None:
    """A peer on another host that announces ``cudaipc,tcp`` (auto): without VRAM here cudaipc is
    not usable on this rank (its own reason); with it in this rank's plan (the name only:
    there is no GPU here), it is passed over naming both hosts, and tcp takes the link."""
    rank = _old_rank(
        protocol_minor=PROTOCOL_MINOR,
        backends=["cudaipc", "tcp"],
        backend_auto=True,
        host={"boot_id": "b", "hostname": "elsewhere"},
    )
    plan = plan_backends(cfg("cudaipc,tcp"), kinds=(MemKind.DRAM,))
    link = judge_link(rank, plan, frozenset({MemKind.DRAM}))
    assert link.same_host is False and link.problem is None
    assert link.path is not None and link.path.backend == "tcp", link
    assert link.path.skipped["cudaipc"].startswith("not usable here:"), link.path
    tcp = plan.selected[0]
    plan = BackendPlan([replace(tcp, name="cudaipc"), tcp], {})
    here = {"boot_id": "a", "hostname": "here"}
    link = judge_link(rank, plan, frozenset({MemKind.VRAM}), here=here)
    assert link.path is not None and link.path.backend == "tcp", link
    assert "different hosts" in link.path.skipped["cudaipc"], link.path
    why = link.path.skipped["cudaipc"]
    assert "'elsewhere'" in why and "'here'" in why, why
    assert link.path.staging == "staged" and "across hosts" in link.path.why, link.path
    same = judge_link(rank.model_copy(update={"host": here}), plan, frozenset({MemKind.VRAM}),
                      here=here)  # fmt: skip
    assert same.same_host is True and same.path is not None
    assert same.path.backend == "cudaipc" and same.path.staging == "direct", same.path


def test_local_plan_states_the_auto_rule(monkeypatch: Any) -> None:
    """Without ``--peer``, doctor's plan for ``auto`` states the per-link rule with the
    general backend it would use; a list states its order rule instead."""
    from kvwire.doctor_links import links_section

    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    for flag, words in (
        ("auto", f"host pools -> {auto_backend_name()} with the configured staging"),
        ("tcp,nixl", "the next ones are its fallbacks"),
    ):
        out = io.StringIO()
        args = build_parser().parse_args(["doctor", "--transfer-backend", flag])
        assert links_section(args, Console(file=out, width=400, color_system=None)) == []
        assert words in out.getvalue(), out.getvalue()
