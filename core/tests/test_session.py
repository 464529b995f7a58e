"""Engine API and control plane, in one process (managers on threads, real tcp backend, real
bootstrap service and ZeroMQ control channels): status rules, handshake refusals, secrets,
bad input, timeouts, late messages, restarts and metrics."""

from __future__ import annotations

import time

import pytest

from kvwire.backend import Notification
from kvwire.control.channel import ControlChannel
from kvwire.control.wire import ChunkNote, Codec, Failure, Heartbeat
from kvwire.errors import (
    BootstrapError,
    ConfigError,
    DescriptorError,
    HandshakeError,
    TransferError,
)
from kvwire.layout import RankPosition
from kvwire.session import KVManager, KVPoll, Role, reduce_polls
from kvwire.session.poll import StatusTable, merge_status
from kvwire.testing.kvfill import make_pool
from kvwire.testing.pair import MODEL, config, no_rooms, pair, wait_for


# ------------------------------------------------------------------------------- status rules
def test_kvpoll_order_and_merge_rules() -> None:
    order = [KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput]
    order += [KVPoll.Transferring, KVPoll.Success]
    assert [int(p) for p in order] == [0, 1, 2, 3, 4]
    assert merge_status(KVPoll.Transferring, KVPoll.Bootstrapping) is KVPoll.Transferring
    assert merge_status(KVPoll.Success, KVPoll.Failed) is KVPoll.Failed
    assert merge_status(KVPoll.Failed, KVPoll.Success) is KVPoll.Failed
    assert reduce_polls([KVPoll.Success, 3, KVPoll.Success]) is KVPoll.Transferring
    assert reduce_polls([KVPoll.Success, KVPoll.Failed]) is KVPoll.Failed
    with pytest.raises(ValueError):
        reduce_polls([])
    t = StatusTable()
    assert t.update(7, KVPoll.Failed) is None and len(t) == 0  # no resurrection
    t.update(7, KVPoll.Transferring)
    t.update(7, KVPoll.Bootstrapping)
    assert t.get(7, KVPoll.Failed) is KVPoll.Transferring
    t.update(7, KVPoll.Failed)
    t.update(7, KVPoll.Success)
    assert t.get(7, KVPoll.Success) is KVPoll.Failed
    t.clear(7)
    assert len(t) == 0


# ------------------------------------------------------------------------------ happy paths
@pytest.mark.parametrize("sync", [False, True], ids=["workers", "sync"])
def test_round_trip_and_clean_tables(sync: bool) -> None:
    with pair(config(sync_transfers=sync)) as p:
        for room in (1, 2, 3):
            p.transfer(room, pages=5, chunks=(2, 0, 3))
        assert no_rooms(p.prefill) and no_rooms(p.decode)


def test_decode_restart_with_same_name_rehandshakes() -> None:
    with pair(config()) as p:
        p.transfer(1)
        p.decode.close()
        p.decode = KVManager(config(), Role.DECODE, p.dlay)
        p.transfer(2)
        assert len(p.prefill.peers) == 1


# --------------------------------------------------------------------------- refusals
def test_incompatible_layout_refused_at_handshake() -> None:
    other = MODEL.model_copy(update={"num_layers": 3, "head_dim": 4})
    with pair(config(), dmodel=other) as p:
        r = p.decode.receiver(5, p.addr)
        r.init()
        wait_for(lambda: r.poll() is KVPoll.Failed)
        with pytest.raises(HandshakeError) as ei:
            r.failure_exception()
        text = str(ei.value)
        assert "num_layers: prefill=2 decode=3" in text
        assert "head_dim: prefill=8 decode=4" in text
        r.clear()
        assert not p.prefill.peers  # nothing was added for the refused rank


def test_wrong_secret_is_refused() -> None:
    with pair(config(secret="right"), config(secret="wrong")) as p:
        r = p.decode.receiver(5, p.addr)
        r.init()
        wait_for(lambda: r.poll() is KVPoll.Failed)
        with pytest.raises(BootstrapError, match="secret"):
            r.failure_exception()


def test_unauthenticated_control_messages_are_dropped_and_counted() -> None:
    with pair(config(secret="s3cret")) as p:
        s = p.prefill.sender(9)
        forger = ControlChannel(Codec(b"not-the-secret"))
        plain = ControlChannel(Codec())
        try:
            forger.tell(p.prefill.channel.endpoint, Failure(room=9, session="x", reason="forged"))
            plain.tell(p.prefill.channel.endpoint, Heartbeat(session="x"))
            wait_for(lambda: p.prefill.dropped.get("unauthenticated", 0) >= 2)
        finally:
            forger.close()
            plain.close()
        assert s.poll() is KVPoll.Bootstrapping  # the forged failure had no effect
        s.clear()
        p.transfer(10)  # authenticated traffic still works


# --------------------------------------------------------------------------- bad input
def test_bad_sender_input_gets_clear_errors_and_fails_the_room_on_both_sides() -> None:
    with pair(config()) as p:
        early = p.prefill.sender(2)
        with pytest.raises(ConfigError, match="before init"):
            early.send([0, 1])
        assert early.poll() is KVPoll.Failed
        early.clear()
        s = p.prefill.sender(3)
        with pytest.raises(DescriptorError, match="aux_index"):
            s.init(4, aux_index=10_000)
        for room, last, match in (
            (30, False, "state_indices come with the last chunk"),
            (31, True, "no state or window buffer groups"),
        ):
            bad = p.prefill.sender(room)
            with pytest.raises(ConfigError, match=match):
                bad.send([0], last=last, state_indices=[1])
            assert bad.poll() is KVPoll.Failed
            bad.clear()
        r = p.decode.receiver(3, p.addr)
        r.init()
        r.send_metadata([1, 2, 3, 4], aux_index=0)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(4, aux_index=0)
        with pytest.raises(DescriptorError):
            s.send([0, 99_999])
        assert s.poll() is KVPoll.Failed
        wait_for(lambda: r.poll() is KVPoll.Failed)  # pushed to decode
        with pytest.raises(TransferError, match="prefill failed the request: bad pages"):
            r.failure_exception()
        s.clear()
        r.clear()
        s = p.prefill.sender(4)
        r = p.decode.receiver(4, p.addr)
        r.send_metadata([1, 2, 3, 4], aux_index=0)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(4, aux_index=0)
        with pytest.raises(ConfigError, match="declared 4"):
            s.send([0, 1, 2, 3, 4])
        assert s.poll() is KVPoll.Failed
        wait_for(lambda: r.poll() is KVPoll.Failed)
        s.clear()
        r.clear()
        # decode keeps the failed room quarantined until prefill confirms (WritesDone) that no
        # write is in flight: that answer may still be on its way
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode), timeout=5)


def test_short_last_chunk_is_refused() -> None:
    with pair(config()) as p:
        r = p.decode.receiver(4, p.addr)
        r.send_metadata([5, 6, 7], aux_index=0)
        s = p.prefill.sender(4)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(3, aux_index=0)
        with pytest.raises(ConfigError, match="KV would be missing"):
            s.send([0, 1], last=True)
        wait_for(lambda: r.poll() is KVPoll.Failed)


# ----------------------------------------------------------------------------- timeouts
def test_decode_waiting_timeout_fails_both_sides() -> None:
    with pair(config(waiting_timeout_s=0.5)) as p:
        r = p.decode.receiver(6, p.addr)
        r.send_metadata([1, 2], aux_index=0)
        s = p.prefill.sender(6)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        t0 = time.monotonic()
        wait_for(lambda: r.poll() is KVPoll.Failed)
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(TransferError, match="waiting timeout"):
            r.failure_exception()
        wait_for(lambda: s.poll() is KVPoll.Failed)
        r.clear()
        s.clear()


def test_prefill_bootstrap_timeout() -> None:
    with pair(config(bootstrap_timeout_s=0.4)) as p:
        s = p.prefill.sender(7)
        s.init(2, aux_index=0)
        wait_for(lambda: s.poll() is KVPoll.Failed, timeout=5)
        with pytest.raises(TransferError, match="bootstrap timeout: 0 of"):
            s.failure_exception()
        s.clear()
        assert no_rooms(p.prefill)


def test_lookup_of_absent_bootstrap_fails() -> None:
    lay, _ = make_pool(MODEL, RankPosition(), 8)
    with KVManager(config(bootstrap_timeout_s=0.5), Role.DECODE, lay) as d:
        r = d.receiver(1, "127.0.0.1:9")
        r.init()
        wait_for(lambda: r.poll() is KVPoll.Failed)
        with pytest.raises(BootstrapError):
            r.failure_exception()


# ------------------------------------------------------------------------ late messages
def test_late_messages_for_unknown_rooms_create_no_state() -> None:
    # a 3 s bootstrap timeout: the early request below expires by it; 0.5 s could also fail
    # the transfer first on a loaded host
    with pair(config(bootstrap_timeout_s=3.0)) as p:
        p.transfer(1)
        link = next(iter(p.decode.side.sources.links.values()))  # type: ignore[union-attr]
        session = link.info.session
        # a failure for a room nobody knows, straight into both control threads' handlers
        p.prefill.side.on_failure(Failure(room=77, session=p.decode.session, reason="late"))
        p.decode.side.on_failure(Failure(room=77, session=session, reason="late"))
        note = p.decode.codec.encode(ChunkNote(room=77, sender_id=0, session=session))
        p.decode.side.on_notification(Notification("prefill", note))
        assert no_rooms(p.prefill) and no_rooms(p.decode)
        # an early request for a room whose sender never comes expires
        r = p.decode.receiver(88, p.addr)
        r.send_metadata([3], aux_index=0)
        wait_for(lambda: p.prefill.room_tables()["early_requests"] == 1)
        wait_for(lambda: p.prefill.room_tables()["early_requests"] == 0, timeout=15)
        r.abort()
        r.clear()  # quarantined until prefill confirms no write is in flight: briefly
        wait_for(lambda: no_rooms(p.decode), timeout=5)


# ------------------------------------------------------------------------------ metrics
def test_metrics_per_request_and_prometheus() -> None:
    with pair(config()) as p:
        r = p.decode.receiver(1, p.addr)
        r.send_metadata([10, 11, 12], aux_index=1)
        s = p.prefill.sender(1)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(3, aux_index=2)
        s.send([0, 1, 2], last=True)
        wait_for(lambda: s.poll() == KVPoll.Success and r.poll() == KVPoll.Success)
        mt = s.metrics
        row = MODEL.page_size * MODEL.head_dim * 4 * MODEL.total_kv_heads
        # KV (K and V); the stamp row rides in the last note (1.11: test_aux_in_note.py)
        assert mt.bytes == 3 * row * 2 * MODEL.num_layers
        assert mt.descriptors > 0 and mt.transfer_s > 0 and mt.total_s > 0
        assert r.metrics.total_s > 0
        from prometheus_client import REGISTRY

        got = REGISTRY.get_sample_value(
            "kvwire_transfer_bytes_total", {"role": "prefill", "agent": p.prefill.agent_name}
        )
        assert got is not None and got >= mt.bytes
        s.clear()
        r.clear()


def test_decode_reuses_pages_only_after_sources_confirm_writes_ended() -> None:
    with pair(config()) as p:
        r = p.decode.receiver(21, p.addr)
        r.send_metadata([4, 5], aux_index=0)
        s = p.prefill.sender(21)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(2, aux_index=0)
        s.send([0])  # a first chunk goes out; then decode aborts
        side = p.prefill.side
        answer = side._on_writes_query
        side._on_writes_query = lambda msg: None  # type: ignore[method-assign]  # prefill mute
        r.abort()
        assert r.poll() is KVPoll.Failed
        time.sleep(0.5)
        assert not r.writes_quiesced()  # nobody confirmed yet: the pages must stay unused
        r.clear()
        assert p.decode.room_tables()["quarantine"] == 1
        side._on_writes_query = answer  # type: ignore[method-assign]
        wait_for(r.writes_quiesced, timeout=5)
        wait_for(lambda: p.decode.room_tables()["quarantine"] == 0, timeout=5)
        wait_for(lambda: s.poll() is KVPoll.Failed)
        s.clear()
        assert no_rooms(p.prefill) and no_rooms(p.decode)


def test_success_is_quiesced_and_an_unasked_request_too() -> None:
    with pair(config()) as p:
        r = p.decode.receiver(22, p.addr)
        r.init()
        r.abort()  # never told anyone where to write
        assert r.writes_quiesced()
        r.clear()
        p.transfer(23)
        assert no_rooms(p.decode)


def test_received_frames_dropped_reach_the_metric() -> None:
    """Garbage at a rank's control endpoint is counted by reason in
    ``kvwire_control_dropped_total`` (exported each heartbeat), not only in ``mgr.dropped``."""
    import zmq
    from prometheus_client import REGISTRY

    lay, _ = make_pool(MODEL, RankPosition(), 8)
    with KVManager(config(), Role.DECODE, lay) as d:
        labels = {"role": "decode", "agent": d.agent_name, "reason": "malformed"}

        def exported() -> float:
            v = REGISTRY.get_sample_value("kvwire_control_dropped_total", labels)
            return v or 0.0

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        try:
            sock.connect(d.channel.endpoint)
            for _ in range(5):
                sock.send(b"\x00not a kvwire frame")
            wait_for(lambda: d.dropped.get("malformed", 0) == 5)
            wait_for(lambda: exported() == 5.0, timeout=5)  # next heartbeat (0.1 s)
        finally:
            sock.close(linger=0)
            ctx.term()
