"""A backend list says, per transfer, whether the member it is on announces the end
(``TransferHandle.pushes``): prefill's workers sleep until woken for a member that pushes
events (``tcp``, ``cudaipc``) and poll on a timer for one that does not (NIXL), and a
failover to another member changes it. Before, a list never pushed, so ``auto`` on a GPU
rank polled its ``cudaipc`` writes on a timer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvwire import plugins
from kvwire.config import ControlOptions, KVWireConfig
from kvwire.session.prefill.pipeline import Pipeline
from kvwire.testing import flaky
from kvwire.testing.pair import Pair


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(plugins, "_registry", plugins.PluginRegistry(extra=[("flaky", flaky)]))
    yield


def tracked(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The handle of every write a prefill worker tracks (strategy copies have none)."""
    seen: list[Any] = []
    track = Pipeline._track

    def record(self: Pipeline, p: Any, tail: Any) -> None:
        if p.copy is None:
            seen.append(p.handle)
        track(self, p, tail)

    monkeypatch.setattr(Pipeline, "_track", record)
    return seen


@pytest.mark.parametrize("flaky_pushes", [True, False])
def test_a_lists_transfer_pushes_as_its_member_does_and_a_failover_changes_it(
    monkeypatch: pytest.MonkeyPatch, flaky_pushes: bool
) -> None:
    monkeypatch.setattr(flaky.FlakyTcpBackend, "pushes_events", flaky_pushes)
    seen = tracked(monkeypatch)
    c = KVWireConfig(
        transfer_backend="flaky,tcp",
        control=ControlOptions(heartbeat_interval_s=0.5, failover_probe_s=60.0),
    )
    p = Pair(c, c)
    agent = p.prefill.agent_name
    try:
        p.transfer(1)  # over flaky: two chunks, every element checked
        assert seen and {h.pushes for h in seen} == {flaky_pushes}
        flaky.break_agent(agent, fail_after_s=0.05)
        seen.clear()
        p.transfer(2)  # its chunks fail on flaky and are posted again on tcp (which pushes)
        assert p.prefill.backend.failovers == 1  # type: ignore[attr-defined]
        assert flaky.swallowed[agent] > 0
        assert seen and all(h.pushes for h in seen)
    finally:
        flaky.heal_agent(agent)
        p.close()


def test_a_lists_members_wake_the_owner_loop_for_their_notifications() -> None:
    """Decode's progress thread sleeps until a member that pushes events queues a
    notification (the list hands its waker to every member)."""
    from kvwire.backends.multi import MultiBackend
    from kvwire.layout import RankPosition
    from kvwire.session import KVManager, Role
    from kvwire.testing.kvfill import make_pool
    from kvwire.testing.pair import MODEL

    layout, _ = make_pool(MODEL, RankPosition(), 4)
    mgr = KVManager(KVWireConfig(transfer_backend="flaky,tcp"), Role.DECODE, layout)
    try:
        backend = mgr.ctx.backend
        assert isinstance(backend, MultiBackend)
        woke: list[bool] = []
        backend.set_notification_waker(lambda: woke.append(True))
        for m in backend.members:
            m._notified()
        assert woke == [True, True]
    finally:
        mgr.close()
