"""A checksummed chunk's sums computed beside its write (issue 26 item 1): the first note as a
:class:`~kvwire.transfers.LaterNote`, made once by whoever posts it.

On a GPU, ``cudaipc`` makes the note after the chunk's kernel ended, while the device summed
the chunk on the hasher's own stream (``DeviceRowHasher.page_sums_later``; checked on a GPU
by ``scripts/gpu_later_sums_check.py`` and end to end by ``scripts/gpu_checksum_engine.py``).
Here, on CPU: the note's contract, the template making it at submit for a backend that does
not take later notes, the list of backends passing it on (also across a failover), and the
prefill pipeline sending sums that a deferred hasher computed (the host hasher's
``sums_order`` replaced by an order of a deferred call: the only fake here), with a negative control
that wrong deferred sums fail the request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvwire import plugins
from kvwire.config import KVWireConfig
from kvwire.errors import KVWireError
from kvwire.integrity import LayerSums, RowHasher
from kvwire.integrity_orders import SumsOrder
from kvwire.plugins import PluginRegistry
from kvwire.session import KVPoll
from kvwire.testing import flaky
from kvwire.testing.pair import config, no_rooms, pair, wait_for
from kvwire.transfers import LaterNote, note_bytes


def test_a_later_note_is_made_once_and_keeps_its_error() -> None:
    calls: list[str] = []

    def make() -> bytes:
        calls.append(threading.current_thread().name)
        return b"note"

    n = LaterNote(make)
    got = [b""] * 4
    threads = [
        threading.Thread(target=lambda i=i: got.__setitem__(i, n())) for i in range(4)
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [b"note"] * 4 and len(calls) == 1
    assert note_bytes(n) == b"note" and note_bytes(b"x") == b"x" and note_bytes(None) is None
    assert len(calls) == 1

    def broken() -> bytes:
        calls.append("broken")
        raise RuntimeError("the device failed")

    bad = LaterNote(broken)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the device failed"):
            bad()
    assert calls.count("broken") == 1


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginRegistry]:
    """The process registry with the ``flaky`` test backend added."""
    reg = PluginRegistry(extra=[("flaky", flaky)])
    monkeypatch.setattr(plugins, "_registry", reg)
    yield reg


class Deferred:
    """The host hasher's ``sums_order`` replaced by an order of a deferred call (started at
    submit by the backend's template, the sums computed when the note is made, not before
    the write); ``skew`` adds 1 to one layer's sum."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, skew: int | None = None, broken: bool = False
    ) -> None:
        self.started = 0
        self.made: list[str] = []
        self.sync = 0
        deferred = self
        original = RowHasher.page_sums

        def later(self: RowHasher, *args: Any, **kw: Any) -> Callable[[], LayerSums]:
            deferred.started += 1

            def result() -> LayerSums:
                deferred.made.append(threading.current_thread().name)
                if broken:
                    raise RuntimeError("stand-in: the sums' kernel failed")
                got = dict(original(self, *args, **kw))
                if skew is not None:
                    got[skew] = (got[skew] + 1) % (1 << 64)
                return got

            return result

        def counted(self: RowHasher, *args: Any, **kw: Any) -> LayerSums:
            deferred.sync += 1
            return original(self, *args, **kw)

        def order(self: RowHasher, *args: Any, **kw: Any) -> SumsOrder:
            # an order no writer can take (no plan): the template starts it at submit
            return SumsOrder(1, None, lambda: None, lambda: later(self, *args, **kw), dict)

        monkeypatch.setattr(RowHasher, "sums_order", order)
        monkeypatch.setattr(RowHasher, "page_sums", counted)


def _backends(names: str) -> KVWireConfig:
    c = config(kv_checksum=True, failover_probe_s=0.2)
    return c.model_copy(update={"transfer_backend": names})


def test_a_list_of_backends_sends_sums_made_with_the_note(
    registry: PluginRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill holds ``flaky,tcp`` (a list takes later notes and hands each member the
    note's bytes, made by the member's template at submit): every chunk's first note carries
    sums from the deferred call, made once per chunk; decode checks them against what landed
    (its own sums computed now), and the request succeeds, every element right."""
    d = Deferred(monkeypatch)
    with pair(_backends("flaky,tcp")) as p:
        p.transfer(3, 4, (2, 2))
        assert d.started == 2 and len(d.made) == 2, (d.started, d.made)
        assert d.sync == 2  # decode's two checks; prefill summed nothing before posting
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_a_note_posted_again_after_a_failover_is_made_once(
    registry: PluginRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The primary (``flaky``) is broken: its submit makes the note and swallows the
    write; the list posts it again on ``tcp`` with the same note, not made again."""
    d = Deferred(monkeypatch)
    with pair(_backends("flaky,tcp")) as p:
        p.transfer(1)  # handshake, a first request on flaky
        agent = p.prefill.agent_name
        flaky.break_agent(agent)
        try:
            p.transfer(2, 4, (4,))
        finally:
            flaky.heal_agent(agent)
        assert flaky.swallowed.get(agent, 0) >= 1
        assert d.started == 3 and len(d.made) == 3, (d.started, d.made)


def test_wrong_later_sums_fail_the_request_naming_the_layer(
    monkeypatch: pytest.MonkeyPatch, registry: PluginRegistry
) -> None:
    """Negative control: the deferred sums of layer 1 off by one, the request fails on
    decode with a checksum mismatch naming layer 1 (so the sums decode checked are the ones
    the later note carried)."""
    Deferred(monkeypatch, skew=1)
    with pair(_backends("flaky,tcp")) as p:
        s, r, src, _ = p.start(4, 4)
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Failed)
        with pytest.raises(
            KVWireError, match=r"KV checksum mismatch in chunk 0 .* layers 1 differ"
        ):
            r.failure_exception()
        r.clear()
        s.clear()


def test_sums_that_cannot_be_computed_fail_the_request_on_both_sides(
    monkeypatch: pytest.MonkeyPatch, registry: PluginRegistry
) -> None:
    """The deferred sums raise (a failed kernel): the chunk's transfer fails naming the
    checksums, prefill and decode both end Failed with that reason, nothing is left in the
    rooms' tables, and the next request goes through."""
    d = Deferred(monkeypatch, broken=True)
    with pair(_backends("flaky,tcp")) as p:
        s, r, src, _ = p.start(6, 4)
        s.send(src, last=True)
        wait_for(lambda: s.poll() == KVPoll.Failed and r.poll() == KVPoll.Failed)
        want = r"checksums of chunk 0 could not be computed: stand-in: the sums' kernel failed"
        for side in (s, r):
            with pytest.raises(KVWireError, match=want):
                side.failure_exception()
        assert len(d.made) == 1
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_one_backend_without_later_notes_sums_before_posting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``tcp`` alone does not take later notes: prefill sums a chunk before posting it, as
    before (the deferred call is never started)."""
    d = Deferred(monkeypatch)
    with pair(config(kv_checksum=True), config(kv_checksum=True)) as p:
        p.transfer(5, 4, (4,))
        assert d.started == 0 and d.sync == 2  # prefill's sum and decode's check


def test_capabilities_say_who_takes_later_notes() -> None:
    """A list of backends takes later notes (its members get them as they take them);
    ``tcp`` does not; ``cudaipc`` does (it posts its notes after the kernel)."""
    from kvwire.backends.multi import MultiBackend
    from kvwire.backends.tcp import TcpBackend

    assert MultiBackend.capabilities.later_notes and not TcpBackend.capabilities.later_notes
    cudaipc = pytest.importorskip("kvwire_cudaipc.backend")
    assert cudaipc.CudaIpcBackend.capabilities.later_notes
