"""Several backends per rank: the ``--transfer-backend`` list, the per-link choice, and
transport failover (docs/failover.md).

Real managers on threads of this process over real backends: ``tcp`` and ``flaky``
(:mod:`kvwire.testing.flaky`: ``tcp`` under another name that fails on command — the one
fake here, since no engine here breaks an endpoint on request). Every request is verified
element by element.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from kvwire import plugins
from kvwire.backends.multi import MultiBackend
from kvwire.config import ControlOptions, KVWireConfig
from kvwire.errors import ConfigError, HandshakeError, TransferError
from kvwire.layout import MemKind
from kvwire.plugins import PluginRegistry
from kvwire.selection import plan_backends
from kvwire.session import KVPoll
from kvwire.testing import flaky
from kvwire.testing.kvfill import count_mismatches, fill_pages
from kvwire.testing.pair import Pair, no_rooms, wait_for


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginRegistry]:
    """The process registry with the ``flaky`` test backend added."""
    reg = PluginRegistry(extra=[("flaky", flaky)])
    monkeypatch.setattr(plugins, "_registry", reg)
    yield reg


def cfg(backends: str, **control: Any) -> KVWireConfig:
    opts = {"heartbeat_interval_s": 0.5, "handshake_timeout_s": 5.0, **control}
    return KVWireConfig(transfer_backend=backends, control=ControlOptions(**opts))


# ------------------------------------------------------------------------------ configuration
def test_backend_list_is_validated() -> None:
    assert KVWireConfig(transfer_backend=" nixl , tcp ").backend_list == ["nixl", "tcp"]
    assert KVWireConfig(transfer_backend="tcp").backend_list == ["tcp"]
    for bad, words in (
        ("tcp,,nixl", "empty backend name"),
        ("auto,tcp", "'auto' cannot be part of a list"),
        ("tcp,nixl,tcp", "tcp listed twice"),
    ):
        with pytest.raises(ValueError, match=words):
            KVWireConfig(transfer_backend=bad)


def test_backend_options_per_backend() -> None:
    c = KVWireConfig(
        transfer_backend="flaky,tcp",
        transfer_backend_options={"tcp.max_part_bytes": 4096, "flaky": {"host": "127.0.0.1"}},
    )
    assert c.backend_options("tcp") == ({"max_part_bytes": 4096}, {})
    assert c.backend_options("flaky") == ({"host": "127.0.0.1"}, {})
    shared = KVWireConfig(transfer_backend="flaky,tcp", transfer_backend_options={"host": "x"})
    assert shared.backend_options("tcp") == ({}, {"host": "x"})
    with pytest.raises(ConfigError, match="must be a mapping"):
        KVWireConfig(
            transfer_backend="flaky,tcp", transfer_backend_options={"tcp": 3}
        ).backend_options("tcp")


def test_plan_skips_unusable_backends_with_reasons(registry: PluginRegistry) -> None:
    plan = plan_backends(KVWireConfig(transfer_backend="nosuch,flaky,tcp"), registry=registry)
    assert plan.names == ["flaky", "tcp"]
    assert "nosuch" in plan.skipped and "nosuch" in plan.skipped["nosuch"]
    with pytest.raises(ConfigError, match=r"none of the transfer backends.*nosuch"):
        plan_backends(KVWireConfig(transfer_backend="nosuch,other"), registry=registry)
    with pytest.raises(ConfigError, match=r"not an option of any of flaky, tcp"):
        plan_backends(
            KVWireConfig(transfer_backend="flaky,tcp", transfer_backend_options={"nope": 1}),
            registry=registry,
        )


def test_auto_offers_link_only_backends_only_where_usable(registry: PluginRegistry) -> None:
    """``cudaipc`` is link-only: auto asks its rank check, which refuses a host pool rank
    (and a rank without CUDA), so auto on this machine is one general backend, as before."""
    if "cudaipc" not in registry.entries[plugins.Kind.BACKEND]:
        pytest.skip("kvwire-cudaipc is not installed in this environment")
    plan = plan_backends(KVWireConfig(transfer_backend="auto"), registry=registry)
    assert len(plan.names) == 1 and plan.names[0] != "cudaipc"
    assert "no VRAM pool" in plan.skipped["cudaipc"]
    cls = registry.resolve(plugins.Kind.BACKEND, "cudaipc")
    why = cls.rank_problem(frozenset({MemKind.VRAM}))
    import torch

    if torch.cuda.is_available():
        assert why is None
    else:
        assert why is not None and "no CUDA" in why


# ----------------------------------------------------------------------------- link choice
def test_link_takes_first_shared_backend_and_names_the_skipped(registry: PluginRegistry) -> None:
    p = Pair(cfg("flaky,tcp"), cfg("tcp"))
    try:
        p.transfer(1)
        assert p.prefill.backend_names == ["flaky", "tcp"]
        assert isinstance(p.prefill.backend, MultiBackend)
        (peer,) = p.prefill.peers.snapshot()
        choice = peer.link.choice
        assert choice.backend == "tcp" and choice.fallbacks == ()
        assert choice.skipped == {"flaky": "the peer does not announce it"}
        (src,) = p.decode.side.sources.links.values()
        assert src.backend == "tcp" and src.fallbacks == ()
    finally:
        p.close()


def test_no_shared_backend_is_refused_naming_both_lists(registry: PluginRegistry) -> None:
    p = Pair(cfg("tcp"), cfg("flaky"))
    try:
        r = p.decode.receiver(7, p.addr)
        r.init()
        wait_for(lambda: r.poll() == KVPoll.Failed)
        with pytest.raises(HandshakeError, match="prefill='tcp' decode='flaky': none in common"):
            r.failure_exception()
        r.clear()
        assert not p.prefill.peers
    finally:
        p.close()


# -------------------------------------------------------------------------------- failover
def _start(p: Pair, room: int, pages: int) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """A request up to ``init()``: distinct source and destination slots and contents."""
    src = np.arange(pages) + room * pages
    dst = np.arange(pages) + room * pages
    r = p.decode.receiver(room, p.addr)
    r.init()
    r.send_metadata(dst, aux_index=room)
    s = p.prefill.sender(room)
    fill_pages(p.play, p.parr, src, room * 1000)
    wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
    s.init(pages, aux_index=room)
    return s, r, src, dst


def _failovers(agent: str, src: str, dst: str) -> float:
    labels = {"role": "prefill", "agent": agent, "src": src, "dst": dst}
    return REGISTRY.get_sample_value("kvwire_transport_failovers_total", labels) or 0.0


@pytest.mark.parametrize("pages", [False, True])
def test_requests_in_flight_fail_over_and_the_primary_comes_back(
    registry: PluginRegistry, monkeypatch: pytest.MonkeyPatch, pages: bool
) -> None:
    """The primary (``flaky``) breaks while 6 requests are half sent: their remaining chunks
    go over ``tcp``, every element lands, the switch is counted; once healed, the probe
    reconnects it and new requests use it again. With ``pages`` the primary takes chunks in
    page form (as ``cudaipc`` does): the list hands them so, and to ``tcp`` as their rows."""
    if pages:
        caps = flaky.FlakyTcpBackend.capabilities.model_copy(update={"page_writes": True})
        monkeypatch.setattr(flaky.FlakyTcpBackend, "capabilities", caps)
    c = cfg("flaky,tcp", failover_probe_s=0.2)
    p = Pair(c, c, slots=64)
    agent = p.prefill.agent_name
    try:
        p.transfer(1)  # handshake over flaky, first request on it
        backend = p.prefill.backend
        assert isinstance(backend, MultiBackend)
        (peer,) = p.prefill.peers.snapshot()
        assert peer.link.choice.backend == "flaky" and peer.link.choice.fallbacks == ("tcp",)
        assert backend.link_backend(peer.link.backend_peer) == "flaky"
        rooms = {room: _start(p, room, 4) for room in range(2, 8)}
        for s, _, src, _ in rooms.values():
            s.send(src[:2], last=False)  # first half in flight on flaky
        flaky.break_agent(agent)
        for s, _, src, _ in rooms.values():
            s.send(src[2:], last=True)
        for room, (s, r, _, dst) in rooms.items():
            wait_for(lambda s=s, r=r: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success)
            assert count_mismatches(p.dlay, p.darr, dst, room * 1000) == 0, room
            r.clear()
            s.clear()
        assert flaky.swallowed.get(agent, 0) > 0  # the fault was hit
        assert (flaky.paged.get(agent, 0) > 0) == pages
        assert backend.failovers == 1
        assert _failovers(agent, "flaky", "tcp") == 1
        assert backend.link_backend(peer.link.backend_peer) == "tcp"
        before = flaky.swallowed[agent]
        p.transfer(9)  # while broken: straight over tcp, nothing swallowed
        assert flaky.swallowed[agent] == before
        flaky.heal_agent(agent)
        wait_for(lambda: backend.link_backend(peer.link.backend_peer) == "flaky", timeout=30)
        assert backend.recoveries == 1
        p.transfer(10)
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
        assert backend.live_handles == 0
        assert all(m.live_handles == 0 for m in backend.members)
    finally:
        flaky.heal_agent(agent)
        p.close()


def test_a_link_without_fallback_fails_cleanly(registry: PluginRegistry) -> None:
    """Prefill has only ``flaky``: when it breaks, the request fails naming the fault on both
    sides, nothing hangs, nothing leaks."""
    p = Pair(cfg("flaky"), cfg("flaky,tcp"))
    agent = p.prefill.agent_name
    try:
        p.transfer(1)
        flaky.break_agent(agent)
        s, r, src, _ = _start(p, 2, 4)
        s.send(src, last=True)
        wait_for(lambda: s.poll() == KVPoll.Failed and r.poll() == KVPoll.Failed, timeout=30)
        with pytest.raises(TransferError, match="injected fault"):
            s.failure_exception()
        s.clear()
        r.clear()
        wait_for(lambda: p.prefill.backend.live_handles == 0)
    finally:
        flaky.heal_agent(agent)
        p.close()


# ---------------------------------------------------------------------------------- doctor
def test_doctor_shows_the_plan_for_the_given_flags() -> None:
    """``kvwire doctor`` takes an engine's flags and says which backends a rank would use,
    in which order, and why the others are not used."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvwire.cli", "doctor", "--transfer-backend", "nosuch,tcp"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )
    text = out.stdout
    assert "Backends for this configuration" in text, out.stderr
    assert "tcp (first choice)" in text
    assert "nosuch: not used here:" in text and "nosuch" in text.split("not used here:")[1]


def test_a_transfer_failed_after_delivery_is_counted_once(registry: PluginRegistry) -> None:
    """The primary delivers a chunk (data and notification) but reports it FAILED, as an
    engine whose acknowledgement was lost: the fallback resends it and decode sees its note
    twice. It is counted once, so the request (3 chunks) completes, verified; counted twice,
    decode would see 4 chunks of 3 announced and fail the request."""
    c = cfg("flaky,tcp", failover_probe_s=30.0)
    p = Pair(c, c, slots=64)
    agent = p.prefill.agent_name
    try:
        p.transfer(1)
        backend = p.prefill.backend
        s, r, src, dst = _start(p, 2, 6)
        flaky.break_agent(agent, delivered=True)
        s.send(src[:2], last=False)
        wait_for(lambda: backend.failovers == 1 and backend.live_handles == 0)
        assert flaky.swallowed.get(agent, 0) == 1  # sent (and reported failed) once
        s.send(src[2:4], last=False)
        s.send(src[4:], last=True)
        wait_for(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success)
        assert count_mismatches(p.dlay, p.darr, dst, 2000) == 0
        r.clear()
        s.clear()
    finally:
        flaky.heal_agent(agent)
        p.close()


def test_a_member_that_refuses_the_memory_is_disabled_not_fatal() -> None:
    """At startup, a backend of a list that cannot register the rank's memory (``cudaipc``
    with VRAM on two GPUs, say) is disabled with its reason; the rank runs on the others and
    no longer announces it. Refused when it is the last one."""
    from kvwire.backends.tcp import TcpBackend
    from kvwire.errors import ConfigError as _ConfigError
    from kvwire.layout import MemoryRegion

    class Refusing(TcpBackend):
        name = "refusing"

        def _register(self, regions: list[MemoryRegion]) -> None:
            raise _ConfigError("cannot register this memory (test)")

    buf = np.zeros(1 << 12, dtype=np.uint8)
    region = MemoryRegion.from_tensor(buf, item_len=4096)
    multi = MultiBackend("agent-r", [Refusing("agent-r"), TcpBackend("agent-r")])
    try:
        multi.register([region])
        assert multi.member_names == ["tcp"]
        assert "cannot register this memory" in multi.disabled[0]
        assert [n for n, _ in multi.offers()] == ["tcp"]
    finally:
        multi.close()
    alone = MultiBackend("agent-s", [Refusing("agent-s")])
    try:
        with pytest.raises(_ConfigError, match="cannot register"):
            alone.register([region])
    finally:
        alone.close()


# ------------------------------------------------------------------------------ probing
def test_probe_does_not_take_back_a_backend_whose_peer_cannot_be_reached() -> None:
    """The probe asks ``link_problem`` before reconnecting: a ``tcp`` member whose peer's
    data endpoint refuses connections (decode's tcp engine closed) stays unhealthy, its
    back-off doubles; the other member keeps the link. Real tcp engines on loopback."""
    import time

    from kvwire.backends.tcp import TcpBackend
    from kvwire.layout import MemoryRegion
    from kvwire.link_choice import host_identity

    class Other(TcpBackend):
        name = "other"

    buf = np.zeros(1 << 14, dtype=np.uint8)
    region = MemoryRegion.from_tensor(buf, item_len=4096)
    pre = MultiBackend("p", [TcpBackend("p"), Other("p")], probe_s=0.05, probe_max_s=0.4)
    dec = MultiBackend("d", [TcpBackend("d"), Other("d")])
    try:
        for m in (pre, dec):
            m.register([region])
        choice = pre.add_link(dec.offers(), host_identity())
        assert choice.backend == "tcp"
        route = pre._routes[choice.peer]
        dec.members[0].close()  # decode's tcp endpoint is gone: connections are refused
        pre._member_failed(route, 0, "test: transfer failed")
        assert pre.link_backend(choice.peer) == "other"
        deadline = time.monotonic() + 30
        while route.backoff[0] < 0.4:  # probes ran and failed, each doubling the wait
            assert time.monotonic() < deadline, route.backoff
            time.sleep(0.02)
        assert pre.recoveries == 0 and not route.healthy[0]
        assert pre.link_backend(choice.peer) == "other"
    finally:
        pre.close()
        dec.close()


def test_a_flapping_member_waits_longer_each_time() -> None:
    """A member that fails again soon after its recovery is probed after twice the wait
    its last probe had; one that stayed healthy long starts again from ``probe_s``."""
    import time

    from kvwire.backends.multi_routes import Route
    from kvwire.backends.tcp import TcpBackend

    class Other(TcpBackend):
        name = "other"

    m = MultiBackend("a", [TcpBackend("a"), Other("a")], probe_s=0.5, probe_max_s=30.0)
    m._start_prober = lambda: None  # type: ignore[method-assign]  # the wait is what is tested
    route = Route("p", [0, 1], {0: "p", 1: "p"}, {}, {0: True, 1: True})
    m._routes["p"] = route
    try:
        m._member_failed(route, 0, "first")
        assert route.backoff[0] == 0.5
        route.backoff[0] = 2.0  # its probes failed twice before one succeeded
        route.healthy[0], route.recovered_at[0] = True, time.monotonic()
        m._member_failed(route, 0, "again, soon after")
        assert route.backoff[0] == 4.0
        route.healthy[0], route.recovered_at[0] = True, time.monotonic() - 60.0
        m._member_failed(route, 0, "again, a minute later")
        assert route.backoff[0] == 0.5
        assert m.failovers == 3
    finally:
        m.close()
