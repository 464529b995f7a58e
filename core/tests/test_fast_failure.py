"""Fast failure on both sides (the request-path issue's table): every bad input and every
mismatch fails the room on prefill *and* decode within 1 s, with a message naming it, also when
prefill does not know the room's destinations yet. In-process managers over the real tcp
backend, bootstrap service and ZeroMQ channels; long timeouts everywhere else, so only the push
can make these fast."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvwire.control.wire import MESSAGE_TYPES
from kvwire.errors import ConfigError, DescriptorError, KVWireError
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.session import KVManager, KVPoll, Role
from kvwire.session.decode.side import DecodeSide
from kvwire.session.manager import COMMON_HANDLERS, dispatch_table
from kvwire.session.peers import Peer, PeerTable
from kvwire.session.prefill.links import DecodeLinker
from kvwire.session.prefill.side import PrefillSide
from kvwire.testing.kvfill import make_pool
from kvwire.testing.pair import MODEL, config, no_rooms, pair, wait_for

#: A pushed failure arrives within this (the deadlines it must beat are 30-60 s: SLOW); room
#: for a loaded host's starvation (1.2-1.4 s seen on CI).
FAST_S = 3.0
#: Long deadlines: a test passes only if the failure is pushed, not timed out.
SLOW = {"bootstrap_timeout_s": 60.0, "waiting_timeout_s": 60.0, "handshake_timeout_s": 30.0}


def failed_within(handle: object, limit_s: float = FAST_S) -> str:
    """Wait until ``handle`` polls Failed (at most ``limit_s``); its error text."""
    t0 = time.monotonic()
    wait_for(lambda: handle.poll() is KVPoll.Failed, timeout=limit_s)  # type: ignore[attr-defined]
    assert time.monotonic() - t0 <= limit_s
    with pytest.raises(KVWireError) as ei:
        handle.failure_exception()  # type: ignore[attr-defined]
    return str(ei.value)


@pytest.mark.parametrize("bad", [[-1], [10_000], [2**40]], ids=["negative", "range", "huge"])
def test_bad_prefill_pages_fail_both_sides(bad: list[int]) -> None:
    with pair(config(**SLOW)) as p:
        r = p.decode.receiver(1, p.addr)
        r.send_metadata([3, 4], aux_index=0)
        s = p.prefill.sender(1)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(2, aux_index=0)
        with pytest.raises(DescriptorError):
            s.send(bad)
        assert s.poll() is KVPoll.Failed
        assert "bad pages" in failed_within(r)
        r.clear()
        s.clear()
        p.transfer(2)  # the pair still works


def test_bad_pages_before_prefill_knows_the_destinations() -> None:
    """The engine sends a bad chunk before decode asked: the failure still reaches decode
    once its request arrives (prefill answers a failed room's request with the failure)."""
    with pair(config(**SLOW)) as p:
        s = p.prefill.sender(3)
        s.init(2, aux_index=0)
        with pytest.raises(DescriptorError):
            s.send([-1])
        r = p.decode.receiver(3, p.addr)
        r.send_metadata([3, 4], aux_index=0)
        assert "bad pages" in failed_within(r)
        r.clear()
        s.clear()


def test_decode_bad_pages_then_abort_fail_prefill_fast() -> None:
    with pair(config(**SLOW)) as p:
        s = p.prefill.sender(4)
        r = p.decode.receiver(4, p.addr)
        with pytest.raises(DescriptorError, match="out of range"):
            r.send_metadata([1, 99_999], aux_index=0)
        r.abort()
        assert r.poll() is KVPoll.Failed
        text = failed_within(s)
        assert "decode failed the request" in text and "out of range" in text
        s.clear()
        r.clear()


def test_decode_failure_before_the_sender_exists_fails_it_at_creation() -> None:
    with pair(config(**SLOW)) as p:
        r = p.decode.receiver(5, p.addr)
        with pytest.raises(DescriptorError, match="repeat"):
            r.send_metadata([1, 1], aux_index=0)
        # the failure reached prefill before the engine created the sender (waited for by
        # its record, not a guessed time: a loaded host took longer than 0.3 s)
        wait_for(lambda: 5 in p.prefill.side.early.failures, timeout=10)  # type: ignore[attr-defined]
        s = p.prefill.sender(5)
        assert s.poll() is KVPoll.Failed
        with pytest.raises(KVWireError, match="repeat"):
            s.failure_exception()
        s.clear()
        r.clear()
        wait_for(lambda: no_rooms(p.prefill), timeout=10)


def test_incompatible_layout_fails_prefill_fast_naming_the_field() -> None:
    other = MODEL.model_copy(update={"head_dim": 4})
    with pair(config(**SLOW), dmodel=other) as p:
        s = p.prefill.sender(6)
        r = p.decode.receiver(6, p.addr)
        r.send_metadata([1, 2], aux_index=0)
        assert "head_dim: prefill=8 decode=4" in failed_within(r)
        assert "head_dim: prefill=8 decode=4" in failed_within(s)
        s.clear()
        r.clear()


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_secret_on_one_side_only_is_named(side: str) -> None:
    pcfg = config(secret="s3cret" if side == "prefill" else None, **SLOW)
    dcfg = config(secret="s3cret" if side == "decode" else None, **SLOW)
    with pair(pcfg, dcfg) as p:
        s = p.prefill.sender(7)
        r = p.decode.receiver(7, p.addr)
        r.send_metadata([1, 2], aux_index=0)
        assert "KVWIRE_SECRET" in failed_within(r)
        if side == "decode":
            # decode signs; prefill (no secret) reads signed frames, so the failure reaches it
            assert "KVWIRE_SECRET" in failed_within(s)
        s.clear()
        r.clear()


def test_send_after_success_is_an_error() -> None:
    with pair(config()) as p:
        r = p.decode.receiver(8, p.addr)
        r.send_metadata([1, 2], aux_index=0)
        s = p.prefill.sender(8)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(2, aux_index=0)
        s.send([0, 1], last=True)
        wait_for(lambda: s.poll() is KVPoll.Success and r.poll() is KVPoll.Success)
        with pytest.raises(ConfigError, match="after the request succeeded"):
            s.send([0])
        assert s.poll() is KVPoll.Success and r.poll() is KVPoll.Success
        s.clear()
        r.clear()


def test_two_decode_instances_with_default_names_do_not_collide() -> None:
    with pair(config()) as p:
        lay2, _ = make_pool(MODEL, RankPosition(), 32)
        second = KVManager(config(), Role.DECODE, lay2)
        try:
            assert second.agent_name != p.decode.agent_name
            p.transfer(1)
            r2 = second.receiver(2, p.addr)
            r2.send_metadata([1, 2], aux_index=0)
            s2 = p.prefill.sender(2)
            wait_for(lambda: s2.poll() >= KVPoll.WaitingForInput)
            s2.init(2, aux_index=0)
            s2.send([0, 1], last=True)
            wait_for(lambda: r2.poll() is KVPoll.Success)
            r2.clear()
            s2.clear()
            p.transfer(3)  # the first decode instance was not evicted
            assert len(p.prefill.peers) == 2
        finally:
            second.close()


def test_live_namesake_is_refused_not_evicted() -> None:
    with pair(config(**SLOW)) as p:
        p.transfer(1)
        lay2, _ = make_pool(MODEL, RankPosition(), 32)
        twin = KVManager(config(**SLOW), Role.DECODE, lay2, agent_name=p.decode.agent_name)
        try:
            r = twin.receiver(2, p.addr)
            r.init()
            assert "already used by a live decode rank" in failed_within(r, 5.0)
            r.clear()
            p.transfer(3)  # the original is still served
        finally:
            twin.close()


def _linker(interval_s: float) -> DecodeLinker:
    """A linker with just what :meth:`DecodeLinker._namesake_alive` reads (no threads)."""
    linker = DecodeLinker.__new__(DecodeLinker)
    linker.ctx = SimpleNamespace(  # type: ignore[assignment]
        options=SimpleNamespace(heartbeat_interval_s=interval_s), stopping=False
    )
    linker._namesake_lock = threading.Lock()
    linker._namesake_waits = set()
    return linker


def test_restart_faster_than_the_heartbeat_bound_is_a_restart() -> None:
    """A namesake last heard just before the new session's hello (a restart within 1.5
    heartbeat intervals, as in a partition test whose restart took 0.73 s of a 0.75 s
    bound) is waited out and taken as a restart, not refused as a live namesake; a
    stall of the liveness thread (``defer``) does not count as a sign of life."""
    linker = _linker(0.2)
    old = Peer("old", "decode0", "tcp://10.0.0.2:1", time.monotonic())
    table = PeerTable()
    table.add(old)
    arrived = time.monotonic()
    table.defer(5.0, arrived + 0.1)  # the liveness thread stalled: last_seen moves, heard not
    assert linker._namesake_alive(old, arrived) is False
    assert time.monotonic() - old.heard >= 0.3  # it waited out the quiet bound


def test_namesake_heard_after_the_hello_is_alive() -> None:
    linker = _linker(5.0)  # a bound far longer than the wait: only the evidence ends it
    live = Peer("live", "decode0", "tcp://10.0.0.2:1", time.monotonic())
    table = PeerTable()
    table.add(live)
    arrived = time.monotonic()
    timer = threading.Timer(0.05, table.touch, args=("live",))
    timer.start()
    t0 = time.monotonic()
    assert linker._namesake_alive(live, arrived) is True
    assert time.monotonic() - t0 < 5.0
    timer.join()


def test_a_handshake_that_raises_is_rejected_naming_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in prefill's handshake (an exception where it does not answer itself) reaches
    decode as a rejection naming it, instead of a silent handshake timeout."""

    def broken(self: DecodeLinker, hello: Any, *rest: Any) -> None:
        raise RuntimeError("a bug in the handshake")

    monkeypatch.setattr(DecodeLinker, "handshake", broken)
    with pair(config(**SLOW)) as p:  # a 30 s handshake timeout: only the rejection is fast
        r = p.decode.receiver(4, p.addr)
        r.init()
        assert "a bug in the handshake" in failed_within(r, 20.0)
        r.clear()


def test_a_second_hello_on_a_namesake_being_waited_on_is_refused_at_once() -> None:
    """Hellos under a taken name cannot hold every handshake thread: while one waits to tell
    a restart from a live namesake, another on the same namesake is refused without waiting."""
    linker = _linker(20.0)  # a namesake heard just now is waited on for up to 30 s
    old = Peer("old", "decode0", "tcp://10.0.0.2:1", time.monotonic())
    verdicts: list[bool] = []
    first = threading.Thread(
        target=lambda: verdicts.append(linker._namesake_alive(old, time.monotonic()))
    )
    first.start()
    wait_for(lambda: "old" in linker._namesake_waits, timeout=30)
    assert linker._namesake_alive(old, time.monotonic()) is True  # refused, not waited
    assert first.is_alive()  # the first hello was still waiting meanwhile
    old.heard = time.monotonic()  # the namesake speaks: alive
    first.join(30)
    assert verdicts == [True]
    assert not linker._namesake_waits


def test_every_message_kind_has_exactly_one_handler_per_side() -> None:
    for side in (PrefillSide, DecodeSide):
        kinds = list(COMMON_HANDLERS) + list(side.HANDLERS)
        assert len(kinds) == len(set(kinds)), f"{side.__name__}: a kind is handled twice"
        assert set(kinds) == set(MESSAGE_TYPES), side.__name__
        for method in side.HANDLERS.values():
            assert callable(getattr(side, method)), method
    with pair(config()) as p:  # what the managers actually built
        for mgr in (p.prefill, p.decode):
            assert set(dispatch_table(mgr, mgr.side)) == set(MESSAGE_TYPES)


def test_layout_keeps_its_tensors_alive() -> None:
    torch = pytest.importorskip("torch")
    model = ModelSpec(num_layers=1, total_kv_heads=1, head_dim=4, dtype="float32", page_size=2)
    tensors = [torch.zeros(8, 2, 1, 4) for _ in range(2)]
    ref = weakref.ref(tensors[0])
    layout = KVLayout.from_tensors(model, tensors)
    del tensors
    gc.collect()
    assert ref() is not None  # the caller dropped them; the layout did not
    t = ref()
    assert t is not None and layout.buffers[0].addr == t.data_ptr()
    t.fill_(7.0)
    assert np.all(t.numpy() == 7.0)
    del t, layout
    gc.collect()
    assert ref() is None  # and frees them with itself


def test_waiting_deadline_is_on_progress_not_wall_clock() -> None:
    """A request whose own chunks have not moved for longer than ``waiting_timeout_s`` lives
    while other requests from the same prefill rank advance; once nothing advances it fails."""
    # a 2 s deadline: a loaded host starves the whole process for up to 1.4 s (CI), and the
    # deadline is not told of that (0.6 s failed requests that had not stopped advancing)
    deadline_s = 2.0
    with pair(config(waiting_timeout_s=deadline_s)) as p:
        slow_r = p.decode.receiver(30, p.addr)
        slow_r.send_metadata([20, 21], aux_index=3)
        slow_s = p.prefill.sender(30)
        wait_for(lambda: slow_s.poll() >= KVPoll.WaitingForInput)
        t0 = time.monotonic()
        room = 31
        while time.monotonic() - t0 < 2.5 * deadline_s:  # others keep advancing
            p.transfer(room, pages=2, chunks=(1, 1))
            room += 1
            time.sleep(0.05)
            assert slow_r.poll() is KVPoll.Transferring
        text = failed_within(slow_r, deadline_s + FAST_S)  # now nothing moves: it fails
        assert "no progress" in text
        slow_r.clear()
        slow_s.clear()


def test_backlog_is_visible() -> None:
    with pair(config(num_workers=1, max_queued_chunks=2)) as p:
        assert p.prefill.backlog == {"queued_chunks": 0, "live_rooms": 0}
        assert not p.prefill.saturated
        r = p.decode.receiver(40, p.addr)
        r.send_metadata(list(range(8)), aux_index=0)
        s = p.prefill.sender(40)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(8, aux_index=0)
        gate = threading.Event()
        pipeline_accept = p.prefill.side.workers  # hold the one worker busy on a slow job
        original = p.prefill.backend.submit

        def slow_submit(*a: object, **kw: object) -> object:
            gate.wait(30)  # released by the test; bounded so a failed test cannot hang
            return original(*a, **kw)  # type: ignore[arg-type]

        p.prefill.backend.submit = slow_submit  # type: ignore[method-assign]
        for i in range(4):
            s.send([2 * i, 2 * i + 1], last=i == 3)
        wait_for(lambda: pipeline_accept.queued >= 2, timeout=20)
        assert p.prefill.backlog["queued_chunks"] >= 2 and p.prefill.saturated
        gate.set()
        wait_for(lambda: r.poll() is KVPoll.Success and s.poll() is KVPoll.Success)
        assert p.prefill.backlog["queued_chunks"] == 0 and not p.prefill.saturated
        p.prefill.backend.submit = original  # type: ignore[method-assign]
        r.clear()
        s.clear()
