"""Several backends per rank with NIXL (UCX on CPU): a link over ``nixl,tcp`` through the
cluster suite (real processes, every element verified), and failover from a broken primary
onto NIXL (docs/failover.md).

The primary that breaks is ``flaky`` (:mod:`kvwire.testing.flaky`: the ``tcp`` backend that
fails on command; no engine here breaks an endpoint on request), the fallback is NIXL."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvwire import plugins
from kvwire.backends.multi import MultiBackend
from kvwire.config import ControlOptions, KVWireConfig
from kvwire.plugins import PluginRegistry
from kvwire.session import KVPoll
from kvwire.testing import flaky
from kvwire.testing.cluster_suite import ClusterConformance
from kvwire.testing.kvfill import count_mismatches, fill_pages
from kvwire.testing.pair import Pair, no_rooms, wait_for


class TestNixlTcpCluster(ClusterConformance):
    """Every rank holds ``nixl`` and ``tcp``; links take NIXL (first, both sides)."""

    backend_name = "nixl,tcp"
    topologies = ("equal-2to2", "gather-2to1")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginRegistry]:
    reg = PluginRegistry(extra=[("flaky", flaky)])
    monkeypatch.setattr(plugins, "_registry", reg)
    yield reg


def test_broken_primary_fails_over_to_nixl(registry: PluginRegistry) -> None:
    c = KVWireConfig(
        transfer_backend="flaky,nixl",
        control=ControlOptions(
            heartbeat_interval_s=0.5, handshake_timeout_s=10.0, failover_probe_s=0.2
        ),
    )
    p = Pair(c, c, slots=64)
    agent = p.prefill.agent_name
    try:
        p.transfer(1)
        backend = p.prefill.backend
        assert isinstance(backend, MultiBackend)
        (peer,) = p.prefill.peers.snapshot()
        assert peer.link.choice.backend == "flaky" and peer.link.choice.fallbacks == ("nixl",)
        rooms = {}
        for room in range(2, 6):
            src = dst = np.arange(4) + room * 4
            r = p.decode.receiver(room, p.addr)
            r.init()
            r.send_metadata(dst, aux_index=room)
            s = p.prefill.sender(room)
            fill_pages(p.play, p.parr, src, room * 1000)
            wait_for(lambda s=s: s.poll() >= KVPoll.WaitingForInput)
            s.init(4, aux_index=room)
            s.send(src[:2], last=False)
            rooms[room] = (s, r, src, dst)
        flaky.break_agent(agent)
        for s, _, src, _ in rooms.values():
            s.send(src[2:], last=True)
        for room, (s, r, _, dst) in rooms.items():
            wait_for(lambda s=s, r=r: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success)
            assert count_mismatches(p.dlay, p.darr, dst, room * 1000) == 0, room
            r.clear()
            s.clear()
        assert flaky.swallowed.get(agent, 0) > 0
        assert backend.failovers == 1
        assert backend.link_backend(peer.link.backend_peer) == "nixl"
        flaky.heal_agent(agent)
        wait_for(lambda: backend.link_backend(peer.link.backend_peer) == "flaky", timeout=30)
        p.transfer(9)
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
        assert all(m.live_handles == 0 for m in backend.members)
    finally:
        flaky.heal_agent(agent)
        p.close()
