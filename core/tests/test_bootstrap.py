"""Bootstrap service: a real aiohttp server on loopback, the urllib client, and the CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

from kvwire.control.bootstrap import BootstrapClient
from kvwire.control.bootstrap_protocol import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    RankInfo,
    sign_request,
)
from kvwire.control.bootstrap_server import BootstrapServer
from kvwire.errors import BootstrapError
from kvwire.testing.cluster import free_bootstrap_port

SECRET = b"s3cret-for-tests"


def rank(tp: int, pp: int = 0, dp: int = 0, *, tp_size: int = 2, pp_size: int = 1,
         dp_size: int = 1, session: str = "s1") -> RankInfo:  # fmt: skip
    return RankInfo(
        tp_rank=tp,
        pp_rank=pp,
        dp_rank=dp,
        tp_size=tp_size,
        pp_size=pp_size,
        dp_size=dp_size,
        endpoint=f"tcp://127.0.0.1:{5000 + 10 * pp + tp}",
        agent=f"agent-{dp}-{pp}-{tp}",
        session=session,
    )


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    with BootstrapServer() as srv:
        yield srv


@pytest.fixture
def secure_server() -> Iterator[BootstrapServer]:
    with BootstrapServer(secret=SECRET) as srv:
        yield srv


def raw_request(
    address: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, object]]:
    """Send a request without the client, answering (status, JSON body)."""
    req = urllib.request.Request(
        f"http://{address}{path}", data=body or None, method=method, headers=headers or {}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def signed_headers(method: str, path: str, body: bytes, ts: float | None = None) -> dict[str, str]:
    timestamp = f"{time.time() if ts is None else ts:.3f}"
    nonce = uuid.uuid4().hex
    return {
        TIMESTAMP_HEADER: timestamp,
        NONCE_HEADER: nonce,
        SIGNATURE_HEADER: sign_request(SECRET, method, path, timestamp, body, nonce),
    }


def free_port() -> int:
    return free_bootstrap_port("127.0.0.1")


def test_register_lookup_round_trip_tp2_pp2(server: BootstrapServer) -> None:
    client = BootstrapClient(server.address)
    infos = [rank(tp, pp, tp_size=2, pp_size=2) for pp in (1, 0) for tp in (1, 0)]
    for info in infos:
        client.register(info)
    got = client.lookup(0, timeout_s=10.0)
    assert [(r.pp_rank, r.tp_rank) for r in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r.endpoint for r in got} == {i.endpoint for i in infos}
    assert got[3] == rank(1, 1, tp_size=2, pp_size=2)
    assert server.stats["registered"] == 4
    assert server.stats["lookups"] >= 1
    assert client.health() == {"status": "ok", "registered": 4}


def test_lookup_waits_for_late_rank(server: BootstrapServer) -> None:
    client = BootstrapClient(server.address)
    client.register(rank(0))
    timer = threading.Timer(0.3, client.register, args=(rank(1),))
    timer.start()
    try:
        t0 = time.monotonic()
        got = client.lookup(0, timeout_s=3.0, retry_interval_s=0.02)
        elapsed = time.monotonic() - t0
    finally:
        timer.join()
    assert [r.tp_rank for r in got] == [0, 1]
    assert 0.2 < elapsed < 2.5
    assert server.stats["lookups"] > 2  # it did poll repeatedly


def test_lookup_fails_at_once_where_nothing_listens() -> None:
    """Connection refused is an answer (a wrong address, or a prefill instance that is
    gone): the lookup fails at once naming the address, not after its timeout. Retrying is
    for a service that answers while ranks are still registering (the tests above)."""
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match="unreachable at " + re.escape(address)) as ei:
        BootstrapClient(address).lookup(0, timeout_s=30.0)
    assert time.monotonic() - t0 < 5.0  # not the 30 s timeout (room for a loaded host)
    assert "refused" in str(ei.value)


def test_lookup_fails_at_once_for_a_name_that_does_not_resolve() -> None:
    address = "no-such-prefill.invalid:8998"
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match="unreachable at " + re.escape(address)):
        BootstrapClient(address).lookup(0, timeout_s=30.0)
    assert time.monotonic() - t0 < 10.0  # the resolver's own answer; no retries on top


def test_lookup_timeout_names_missing_ranks(server: BootstrapServer) -> None:
    # requests may take 10 s: a lookup that outlived its own 0.3 s deadline would show
    client = BootstrapClient(server.address, request_timeout_s=10.0)
    client.register(rank(0, 0, tp_size=2, pp_size=2))
    client.register(rank(1, 1, tp_size=2, pp_size=2))
    t0 = time.monotonic()
    with pytest.raises(BootstrapError) as ei:
        client.lookup(0, timeout_s=0.3)
    assert time.monotonic() - t0 < 5.0
    msg = str(ei.value)
    assert "2 of 4" in msg
    assert "(tp=1, pp=0)" in msg and "(tp=0, pp=1)" in msg
    assert "(tp=0, pp=0)" not in msg


def test_lookup_timeout_when_nothing_registered(server: BootstrapServer) -> None:
    with pytest.raises(BootstrapError, match="no prefill rank of dp_rank=0"):
        BootstrapClient(server.address).lookup(0, timeout_s=0.2)


def test_unreachable_address_reported_within_timeout() -> None:
    address = f"127.0.0.1:{free_port()}"
    client = BootstrapClient(address, request_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match="unreachable at " + re.escape(address)):
        client.lookup(0, timeout_s=0.5)
    assert time.monotonic() - t0 < 4.0  # its 0.5 s deadlines, plus room for a loaded host
    with pytest.raises(BootstrapError, match=re.escape(address)):
        client.register(rank(0))


def test_restarted_rank_replaces_old_session(server: BootstrapServer) -> None:
    client = BootstrapClient(server.address)
    old = rank(0, tp_size=1, session="old")
    client.register(old)
    new = old.model_copy(update={"session": "new", "endpoint": "tcp://127.0.0.1:6000"})
    client.register(new)
    got = client.lookup(0, timeout_s=10.0)
    assert got == [new]
    assert server.stats["replaced"] == 1
    # The old incarnation shutting down late must not remove the new one.
    client.deregister(old)
    assert client.lookup(0, timeout_s=10.0) == [new]
    client.deregister(new)
    assert client.health()["registered"] == 0


def test_inconsistent_sizes_refused_with_409(server: BootstrapServer) -> None:
    client = BootstrapClient(server.address)
    client.register(rank(0, tp_size=2))
    with pytest.raises(BootstrapError, match="HTTP 409") as ei:
        client.register(rank(1, tp_size=4))
    assert "tp_size=4" in str(ei.value) and "tp_size=2" in str(ei.value)
    status, body = raw_request(
        server.address, "PUT", "/v1/ranks", rank(1, tp_size=2, pp_size=2).model_dump_json().encode()
    )
    assert status == 409 and "pp_size=2" in str(body["error"])
    assert BootstrapClient(server.address).health()["registered"] == 1


def test_malformed_body_refused_with_400(server: BootstrapServer) -> None:
    status, body = raw_request(server.address, "PUT", "/v1/ranks", b"{not json")
    assert status == 400 and "invalid" in str(body["error"]).lower()
    bad = rank(0).model_dump()
    bad["tp_rank"] = 5  # out of range for tp_size=2
    status, body = raw_request(server.address, "PUT", "/v1/ranks", json.dumps(bad).encode())
    assert status == 400 and "tp_rank=5 is out of range" in str(body["error"])
    del bad["endpoint"]
    status, body = raw_request(server.address, "PUT", "/v1/ranks", json.dumps(bad).encode())
    assert status == 400 and "endpoint" in str(body["error"])
    assert server.stats["registered"] == 0


def test_newer_peer_fields_are_ignored(server: BootstrapServer) -> None:
    doc = rank(0, tp_size=1).model_dump()
    doc["future_field"] = {"x": 1}
    status, _ = raw_request(server.address, "PUT", "/v1/ranks", json.dumps(doc).encode())
    assert status == 200
    assert BootstrapClient(server.address).lookup(0, timeout_s=10.0)[0].agent == "agent-0-0-0"


def test_oversized_body_refused(server: BootstrapServer) -> None:
    req = urllib.request.Request(
        f"http://{server.address}/v1/ranks", data=b"x" * (128 * 1024), method="PUT"
    )
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=2)
    assert ei.value.code == 413
    ei.value.close()


def test_secret_right_secret_works(secure_server: BootstrapServer) -> None:
    client = BootstrapClient(secure_server.address, secret=SECRET)
    client.register(rank(0, tp_size=1))
    assert [r.tp_rank for r in client.lookup(0, timeout_s=10.0)] == [0]
    assert secure_server.stats["unauthenticated"] == 0


@pytest.mark.parametrize("secret", [b"wrong", None])
def test_secret_wrong_or_missing_refused(
    secure_server: BootstrapServer, secret: bytes | None
) -> None:
    client = BootstrapClient(secure_server.address, secret=secret)
    with pytest.raises(BootstrapError, match=r"refused the shared secret .*KVWIRE_SECRET"):
        client.register(rank(0, tp_size=1))
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match="refused the shared secret"):
        client.lookup(0, timeout_s=5.0)  # refusal is not retried
    assert time.monotonic() - t0 < 1.0
    assert secure_server.stats["unauthenticated"] == 2
    assert secure_server.stats["registered"] == 0


def test_secret_tampered_body_refused(secure_server: BootstrapServer) -> None:
    body = rank(0, tp_size=1).model_dump_json().encode()
    headers = signed_headers("PUT", "/v1/ranks", body)
    tampered = body.replace(b"tcp://127.0.0.1", b"tcp://10.6.6.6")
    status, reply = raw_request(secure_server.address, "PUT", "/v1/ranks", tampered, headers)
    assert status == 401 and "wrong signature" in str(reply["error"])
    # The same headers with the untampered body are accepted: the signature scheme matches.
    status, _ = raw_request(secure_server.address, "PUT", "/v1/ranks", body, headers)
    assert status == 200
    # Signed for another path/query: refused.
    path_headers = signed_headers("GET", "/v1/ranks?dp_rank=1", b"")
    status, _ = raw_request(secure_server.address, "GET", "/v1/ranks?dp_rank=0", b"", path_headers)
    assert status == 401
    assert secure_server.stats["unauthenticated"] == 2


def test_secret_old_timestamp_refused(secure_server: BootstrapServer) -> None:
    body = rank(0, tp_size=1).model_dump_json().encode()
    headers = signed_headers("PUT", "/v1/ranks", body, ts=time.time() - 301)
    status, reply = raw_request(secure_server.address, "PUT", "/v1/ranks", body, headers)
    assert status == 401 and "timestamp" in str(reply["error"])
    headers = signed_headers("PUT", "/v1/ranks", body, ts=time.time() - 200)
    status, _ = raw_request(secure_server.address, "PUT", "/v1/ranks", body, headers)
    assert status == 200
    assert secure_server.stats["unauthenticated"] == 1


def test_health_needs_no_auth_and_hides_addresses(secure_server: BootstrapServer) -> None:
    BootstrapClient(secure_server.address, secret=SECRET).register(rank(0, tp_size=1))
    status, body = raw_request(secure_server.address, "GET", "/health")
    assert status == 200 and body == {"status": "ok", "registered": 1}
    assert "tcp://" not in json.dumps(body)
    assert BootstrapClient(secure_server.address).health()["status"] == "ok"
    assert secure_server.stats["unauthenticated"] == 0


def test_stop_is_idempotent_and_frees_port() -> None:
    srv = BootstrapServer().start()
    address = srv.address
    port = int(address.rsplit(":", 1)[1])
    assert port > 0
    t0 = time.monotonic()
    srv.stop()
    srv.stop()
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(BootstrapError, match="unreachable"):
        BootstrapClient(address, request_timeout_s=0.5).health()
    with BootstrapServer(port=port) as again:
        assert again.address == address
        assert BootstrapClient(address).health()["status"] == "ok"


def test_start_on_busy_port_raises() -> None:
    with BootstrapServer() as srv:
        port = int(srv.address.rsplit(":", 1)[1])
        with pytest.raises(BootstrapError, match="could not listen"):
            BootstrapServer(port=port).start()


@pytest.mark.timeout(30)
def test_cli_bootstrap_runs_and_stops_on_sigterm() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVWIRE_SECRET"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwire.cli", "bootstrap", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the process prints its address once listening
        match = re.search(r"listening on (\S+:\d+)", line)
        assert match, f"unexpected first line {line!r}"
        health = BootstrapClient(match.group(1)).health()
        assert health == {"status": "ok", "registered": 0}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
