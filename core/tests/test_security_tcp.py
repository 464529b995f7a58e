"""The ``tcp`` backend's data plane with a shared secret: CURVE keys derived from the secret,
every other connection refused before it reaches memory, and errors that tell a remote peer
nothing about local regions (issue 14).

Hand-crafted ZeroMQ frames (see :mod:`kvwire.backends.tcp.wire`) play the intruder; the
target's region sits between guard bytes, next to unregistered memory, and every test checks
that no byte of either changed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from kvwire.backend import XferOp, XferState
from kvwire.backends.tcp import TcpBackend, wire
from kvwire.descriptors import make_table
from kvwire.layout import MemoryRegion
from kvwire.security import curve_keys, reset_exposure_warnings
from kvwire.testing.conformance import wait_terminal

SECRET = "data-plane-secret"
GUARD = 4096
MakeBackend = Callable[..., TcpBackend]


def addr_of(arr: np.ndarray) -> int:
    return int(arr.ctypes.data)


class Target:
    """A tcp agent with one registered region between guard bytes, plus unregistered memory,
    and a READ-able secret pattern in the region."""

    def __init__(self, backend: TcpBackend) -> None:
        self.backend = backend
        self.buf = np.full(3 * GUARD, 0x77, dtype=np.uint8)
        self.buf[GUARD : 2 * GUARD] = np.arange(GUARD, dtype=np.uint8)  # "KV page" to steal
        self.before = self.buf.copy()
        self.region = MemoryRegion.from_pointer(addr_of(self.buf) + GUARD, GUARD, 1)
        self.foreign = np.full(GUARD, 0x33, dtype=np.uint8)
        backend.register([self.region])

    def untouched(self) -> bool:
        return bool((self.buf == self.before).all() and (self.foreign == 0x33).all())


def rows(*pairs: tuple[int, int]) -> bytes:
    a = np.array([p[0] for p in pairs], dtype=np.uint64)
    n = np.array([p[1] for p in pairs], dtype=np.uint64)
    return wire.rows_to_bytes(a, n)


def request(xid: int, d: bytes, note: bytes | None = None) -> bytes:
    return wire.pack(
        {"v": wire.VERSION, "x": xid, "f": "intruder", "d": d, "p": 0, "np": 1, "n": note}
    )


def intruder(ctx: zmq.Context[Any], endpoint: str, keys_from: str | None) -> zmq.Socket[Any]:
    """A DEALER to ``endpoint``: plain (``keys_from`` None) or a CURVE client whose keys derive
    from ``keys_from`` (it knows the server key of that secret too)."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys_from is not None:
        k = curve_keys(keys_from.encode())
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve_keys(SECRET.encode()).server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, k.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, k.client_secret)
    sock.connect(endpoint)
    return sock


def attack(sock: zmq.Socket[Any], t: Target) -> list[list[bytes]]:
    """Every request an intruder would try: READ the page, WRITE into it, WRITE over the
    guard and into unregistered memory; returns the replies received within 1 s."""
    r = t.region
    sock.send_multipart([wire.READ, request(1, rows((r.addr, GUARD)))])
    sock.send_multipart([wire.WRITE, request(2, rows((r.addr, 64)), b"n"), b"\xee" * 64])
    sock.send_multipart([wire.WRITE, request(3, rows((addr_of(t.buf), 64)), b"n"), b"\xee" * 64])
    sock.send_multipart(
        [wire.WRITE, request(4, rows((addr_of(t.foreign), 64)), b"n"), b"\xee" * 64]
    )
    replies = []
    deadline = time.monotonic() + 1.0
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000), zmq.POLLIN):
            replies.append(list(sock.recv_multipart()))
    return replies


@pytest.mark.parametrize("keys_from", [None, "another-secret"], ids=["plain", "wrong-key"])
def test_unauthenticated_client_gets_nothing_and_changes_nothing(
    make_backend: MakeBackend, zctx: zmq.Context[Any], keys_from: str | None
) -> None:
    """A plain DEALER, or a CURVE client with keys of another secret (even knowing the
    server's public key), reads no byte, writes no byte, delivers no notification and gets
    no answer at all."""
    t = Target(make_backend("target", secret=SECRET))
    assert attack(intruder(zctx, t.backend.endpoint, keys_from), t) == []
    assert t.untouched(), "an unauthenticated request changed memory"
    assert t.backend.get_notifications() == []
    assert t.backend.refused_messages == 0, "the request must not even reach the I/O loop"
    if keys_from is not None:
        assert t.backend.auth is not None and t.backend.auth.refused >= 1


def test_authenticated_client_is_served(make_backend: MakeBackend, zctx: zmq.Context[Any]) -> None:
    """Control for the test above: the same frames from a client holding the secret are
    served (the READ returns the page, the in-region WRITE lands, the others are refused),
    so the silence above is the authentication and not the frames."""
    t = Target(make_backend("target", secret=SECRET))
    replies = attack(intruder(zctx, t.backend.endpoint, SECRET), t)
    by_xid = {wire.unpack(r[1])["x"]: r for r in replies}
    assert sorted(by_xid) == [1, 2, 3, 4]
    assert by_xid[1][2] == bytes(np.arange(GUARD, dtype=np.uint8))
    assert [wire.unpack(by_xid[x][1])["ok"] for x in (2, 3, 4)] == [True, False, False]
    assert (t.buf[GUARD : GUARD + 64] == 0xEE).all()
    assert (t.buf[:GUARD] == 0x77).all() and (t.foreign == 0x33).all()


def test_refusal_names_no_address_or_count(
    make_backend: MakeBackend, zctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A refused request's answer gives the category only: no address, no number of rows that
    missed; the details are in the target's log."""
    t = Target(make_backend("target"))
    sock = intruder(zctx, t.backend.endpoint, None)
    bad = [(addr_of(t.foreign), 64), (addr_of(t.foreign) + 128, 64), (t.region.addr, 64)]
    with caplog.at_level(logging.WARNING, logger="kvwire.backends.tcp.backend"):
        sock.send_multipart([wire.WRITE, request(9, rows(*bad)), b"\xee" * 192])
        assert sock.poll(5000, zmq.POLLIN)
        h = wire.unpack(sock.recv_multipart()[1])
    assert h["ok"] is False
    assert "registered regions" in h["e"]
    assert f"{addr_of(t.foreign):#x}" not in h["e"] and not any(c.isdigit() for c in h["e"])
    assert f"{addr_of(t.foreign):#x}" in caplog.text and "2 of 3 rows" in caplog.text
    assert t.untouched()


def test_backends_with_the_secret_transfer(make_backend: MakeBackend) -> None:
    """Two agents with the same secret move bytes as usual (through the public API)."""
    t = Target(make_backend("target", secret=SECRET))
    src = np.full(256, 0xAB, dtype=np.uint8)
    ini = make_backend("initiator", secret=SECRET)
    ini.register([MemoryRegion.from_tensor(src)])
    pair = ini.prepare(
        ini.add_peer(t.backend.local_metadata()),
        make_table([addr_of(src)], 256),
        make_table([t.region.addr + 256], 256),
    )
    h = ini.submit(XferOp.WRITE, pair, [0], [0], b"done")
    assert wait_terminal(ini, h, 10) is XferState.DONE
    assert (t.buf[GUARD + 256 : GUARD + 512] == 0xAB).all()
    assert (t.buf[:GUARD] == 0x77).all() and (t.buf[2 * GUARD :] == 0x77).all()


@pytest.mark.parametrize("initiator_secret", [None, "another-secret"], ids=["none", "other"])
def test_initiator_without_the_secret_fails_and_writes_nothing(
    make_backend: MakeBackend, initiator_secret: str | None
) -> None:
    """An agent without the target's secret (or with another one) cannot write: its transfer
    fails at its deadline and the target's memory is unchanged."""
    t = Target(make_backend("target", secret=SECRET))
    src = np.full(256, 0xAB, dtype=np.uint8)
    ini = make_backend("initiator", secret=initiator_secret, transfer_timeout_s=1.0)
    ini.register([MemoryRegion.from_tensor(src)])
    pair = ini.prepare(
        ini.add_peer(t.backend.local_metadata()),
        make_table([addr_of(src)], 256),
        make_table([t.region.addr], 256),
    )
    h = ini.submit(XferOp.WRITE, pair, [0], [0], b"done")
    assert wait_terminal(ini, h, 10) is XferState.FAILED
    assert t.untouched()
    assert t.backend.get_notifications() == []


def test_keys_derive_from_the_secret() -> None:
    """Same secret, same keys (every rank derives them alone); another secret, other keys;
    server and client pairs differ."""
    a, b, c = curve_keys(b"s1"), curve_keys(b"s1"), curve_keys(b"s2")
    assert a == b and a.server_public != c.server_public and a.client_public != c.client_public
    assert a.server_public != a.client_public


def test_open_data_endpoint_warns_once(
    make_backend: MakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """A data endpoint on a non-loopback address without a secret logs one WARNING per
    process; with a secret, or on loopback, none."""
    reset_exposure_warnings()
    with caplog.at_level(logging.WARNING, logger="kvwire.security"):
        make_backend(host="127.0.0.1")
        make_backend(host="0.0.0.0", secret=SECRET)
        assert "tcp data endpoint" not in caplog.text
        make_backend(host="0.0.0.0")
        make_backend(host="0.0.0.0")
    warnings = [r for r in caplog.records if "tcp data endpoint" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "KVWIRE_SECRET" in warnings[0].getMessage()
