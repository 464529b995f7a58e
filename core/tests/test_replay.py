"""Replay protection (issue 14): signed control frames carry a freshness stamp and a
replayed, stale or misaddressed one is dropped and counted; signed bootstrap PUT/DELETE
requests carry a nonce and a replay is refused. In every case no state changes and live
traffic still succeeds."""

from __future__ import annotations

import itertools
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from kvwire.control import freshness
from kvwire.control.bootstrap import BootstrapClient
from kvwire.control.bootstrap_protocol import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    RankInfo,
    sign_request,
)
from kvwire.control.bootstrap_server import BootstrapServer
from kvwire.control.channel import ControlChannel
from kvwire.control.freshness import FreshnessError, ReplayGuard
from kvwire.control.wire import Codec, Goodbye, Heartbeat
from kvwire.errors import ProtocolError
from kvwire.testing.pair import config, pair, wait_for

SECRET = b"replay-secret"
EP = "tcp://127.0.0.1:5555"
FIXTURES = Path(__file__).parent / "fixtures" / "wire"


# ----------------------------------------------------------------------------- codec level
def test_replayed_frame_is_refused_once_accepted() -> None:
    sender, receiver = Codec(SECRET), Codec(SECRET)
    frame = sender.encode(Heartbeat(session="s"), to=EP)
    assert receiver.decode(frame, to=EP).kind == "heartbeat"
    with pytest.raises(FreshnessError) as e:
        receiver.decode(frame, to=EP)
    assert e.value.reason == "replayed"
    # the next live frame of the same sender is still accepted
    assert receiver.decode(sender.encode(Heartbeat(session="s"), to=EP), to=EP).kind == "heartbeat"


def test_heartbeat_signed_an_hour_ago_is_stale() -> None:
    old = Codec(SECRET, clock=lambda: time.time() - 3600)
    frame = old.encode(Heartbeat(session="s", sent_at=time.time() - 3600), to=EP)
    receiver = Codec(SECRET)
    with pytest.raises(FreshnessError) as e:
        receiver.decode(frame, to=EP)
    assert e.value.reason == "stale" and "clock" in str(e.value)
    assert len(receiver.guard) == 0, "a refused frame must leave no state"


def test_frame_for_another_endpoint_is_refused() -> None:
    frame = Codec(SECRET).encode(Goodbye(session="s"), to="tcp://10.0.0.9:1")
    with pytest.raises(FreshnessError, match="addressed to"):
        Codec(SECRET).decode(frame, to=EP)


def test_unstamped_signed_frame_is_refused_on_the_channel_path() -> None:
    """A signed frame of protocol 1.2 (no stamp) still parses offline, but a receiving
    endpoint refuses it: it could be a recording."""
    frame = (FIXTURES / "v1.2" / "goodbye.signed.bin").read_bytes()
    codec = Codec(b"fixture-secret")
    assert codec.decode(frame).kind == "goodbye"
    with pytest.raises(FreshnessError, match="unstamped"):
        codec.decode(frame, to=EP)


def test_stamp_is_authenticated() -> None:
    """Changing the stamp (a new sequence number for a recorded frame) breaks the MAC."""
    frame = Codec(SECRET).encode(Goodbye(session="s"), to=EP)
    outer = msgpack.unpackb(frame)
    origin, seq, ts, to = msgpack.unpackb(outer[5])
    outer[5] = msgpack.packb([origin, seq + 1, ts, to])
    with pytest.raises(ProtocolError, match="failed authentication"):
        Codec(SECRET).decode(msgpack.packb(outer), to=EP)


def test_without_a_secret_nothing_is_stamped() -> None:
    frame = Codec().encode(Heartbeat(session="s"), to=EP)
    assert len(msgpack.unpackb(frame)) == 5
    codec = Codec()
    codec.decode(frame, to=EP)
    codec.decode(frame, to=EP)  # no secret: no authenticity, so no replay window either


def test_window_accepts_reordering_refuses_duplicates_and_old() -> None:
    g = ReplayGuard()
    now = time.time()
    for seq in (5, 3, 4, 1, 2):
        g.check(b"o", seq, now)
    for seq in (1, 5):
        with pytest.raises(FreshnessError, match="replayed"):
            g.check(b"o", seq, now)
    g.check(b"o", 5 + freshness.SEQ_WINDOW + 10, now)
    with pytest.raises(FreshnessError, match="older than the newest"):
        g.check(b"o", 6, now)


def test_guard_memory_is_bounded_and_expires() -> None:
    t = [1000.0]
    g = ReplayGuard(max_age_s=10.0, max_origins=8, clock=lambda: t[0])
    for i in range(20):
        g.check(bytes([i]), 1, t[0])
    assert len(g) == 8
    t[0] += 11 + freshness.SWEEP_PERIOD_S
    g.check(b"new", 1, t[0])
    assert len(g) == 1, "origins silent for longer than the window must be forgotten"
    # a replay of a forgotten origin's frame is still refused: by its stamp
    with pytest.raises(FreshnessError, match="stale"):
        g.check(bytes([19]), 1, 1000.0)


# --------------------------------------------------------------------------- channel level
def test_channel_drops_and_counts_replays() -> None:
    """The same signed frame pushed twice to a live channel: one message, one "replayed" drop;
    a stale frame: one "stale" drop; a fresh frame afterwards is delivered."""
    ch = ControlChannel(Codec(SECRET))
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(ch.endpoint)
        sender = Codec(SECRET)
        frame = sender.encode(Heartbeat(session="peer"), to=ch.endpoint)
        old = Codec(SECRET, clock=lambda: time.time() - 3600).encode(
            Goodbye(session="peer"), to=ch.endpoint
        )
        for f in (frame, frame, old, sender.encode(Goodbye(session="peer"), to=ch.endpoint)):
            push.send(f)
        got: list[Any] = []
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            got += ch.receive(0.1)
        assert [m.kind for m in got] == ["heartbeat", "goodbye"]
        assert ch.dropped["replayed"] == 1 and ch.dropped["stale"] == 1
    finally:
        ctx.destroy(linger=0)
        ch.close()


# --------------------------------------------------------------------------- manager level
def test_replayed_goodbye_evicts_nobody_and_requests_still_succeed() -> None:
    """Prefill and decode with a secret. A Goodbye with a sequence number prefill already
    accepted from decode (what a recorded frame is, after the MAC), and one stamped an hour
    ago, are dropped and counted; decode stays a peer and a request succeeds."""
    with pair(config(secret="s3cret")) as p:
        p.transfer(1)
        prefill, decode = p.prefill, p.decode
        assert len(prefill.peers.snapshot()) == 1
        to = prefill.channel.endpoint

        # decode's first frame to prefill (its hello) had sequence number 1
        replay = Codec(b"s3cret")
        replay.origin, replay._seq = decode.codec.origin, itertools.count(1)
        stale = Codec(b"s3cret", clock=lambda: time.time() - 3600)
        stale.origin = decode.codec.origin
        bye = Goodbye(session=decode.session)
        push_raw(to, [replay.encode(bye, to=to), stale.encode(bye, to=to)])
        wait_for(lambda: prefill.dropped.get("replayed", 0) >= 1, 5)
        wait_for(lambda: prefill.dropped.get("stale", 0) >= 1, 5)
        time.sleep(0.2)
        assert [x.session for x in prefill.peers.snapshot()] == [decode.session]
        p.transfer(2)


def test_replay_flood_is_counted_and_harmless() -> None:
    """2,000 copies of two recorded frames of decode (a goodbye and a heartbeat carrying
    sequence numbers prefill already accepted) plus 500 stale ones, pushed at a prefill rank:
    all dropped and counted by reason, nobody evicted, requests before and after succeed."""
    with pair(config(secret="s3cret")) as p:
        p.transfer(1)
        to = p.prefill.channel.endpoint
        rec = Codec(b"s3cret")
        rec.origin, rec._seq = p.decode.codec.origin, itertools.count(1)
        old = Codec(b"s3cret", clock=lambda: time.time() - 1000)
        old.origin = p.decode.codec.origin
        msgs = [Goodbye(session=p.decode.session), Heartbeat(session=p.decode.session)]
        recorded = [rec.encode(m, to=to) for m in msgs]  # sequence numbers 1, 2: already seen
        frames = [recorded[i % 2] for i in range(2000)]
        frames += [old.encode(msgs[0], to=to) for _ in range(500)]
        push_raw(to, frames)
        p.transfer(2)
        wait_for(lambda: p.prefill.dropped.get("replayed", 0) == 2000, 10)
        wait_for(lambda: p.prefill.dropped.get("stale", 0) == 500, 10)
        assert [x.session for x in p.prefill.peers.snapshot()] == [p.decode.session]
        p.transfer(3)


def push_raw(endpoint: str, frames: list[bytes]) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(endpoint)
        for f in frames:
            sock.send(f)
        sock.close(linger=2000)
    finally:
        ctx.term()


# -------------------------------------------------------------------------- bootstrap level
def rank(session: str) -> RankInfo:
    return RankInfo(
        tp_rank=0, tp_size=1, endpoint=f"tcp://127.0.0.1:1/{session}", agent="a", session=session
    )


def put(address: str, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(
        f"http://{address}/v1/ranks", data=body, method="PUT", headers=headers
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        with e:
            assert "replayed" in json.loads(e.read())["error"]
            return int(e.code)


def test_replayed_bootstrap_put_is_refused() -> None:
    """A recorded signed PUT (rank 0, old session) replayed after the rank re-registered
    with a new session is refused (401, counted) and the registration keeps the new session;
    the live client still works."""
    with BootstrapServer(secret=SECRET) as server:
        body = rank("old").model_dump_json().encode()
        ts, nonce = f"{time.time():.3f}", "n" * 32
        headers = {
            TIMESTAMP_HEADER: ts,
            NONCE_HEADER: nonce,
            SIGNATURE_HEADER: sign_request(SECRET, "PUT", "/v1/ranks", ts, body, nonce),
        }
        assert put(server.address, body, headers) == 200
        client = BootstrapClient(server.address, SECRET)
        client.register(rank("new"))
        assert put(server.address, body, headers) == 401
        assert server.stats["replayed"] == 1
        assert [r.session for r in client.lookup(0, timeout_s=10)] == ["new"]
        client.register(rank("newer"))  # live requests still succeed
        assert [r.session for r in client.lookup(0, timeout_s=10)] == ["newer"]


def test_bootstrap_nonces_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server remembers at most MAX_NONCES nonces; beyond that it refuses (503) rather
    than forget one inside the window."""
    from kvwire.control import bootstrap_server

    monkeypatch.setattr(bootstrap_server, "MAX_NONCES", 3)
    with BootstrapServer(secret=SECRET) as server:
        client = BootstrapClient(server.address, SECRET)
        for i in range(3):
            client.register(rank(f"s{i}"))
        with pytest.raises(Exception, match="503"):
            client.register(rank("s4"))
        assert server.stats["registered"] == 3
