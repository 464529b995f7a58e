"""Mooncake-specific behaviour of the ``mooncake`` backend: options, registration, batch
splitting and in-flight budget, listening addresses, metadata checks, backlog on removal."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from kvwire_mooncake.backend import MooncakeBackend, MooncakeOptions
from kvwire_mooncake.engine import MooncakeEngineError, ephemeral_port_range

from kvwire.backend import XferOp, XferState
from kvwire.descriptors import make_table
from kvwire.errors import ConfigError, PeerError
from kvwire.layout import MemoryRegion
from kvwire.plugins import Kind, PluginRegistry
from kvwire.selection import validate_options
from kvwire.testing.conformance import wait_terminal
from kvwire.testing.remote import RemoteAgent

ROW, GAP = 64, 64  # rows of 64 B with 64 B gaps: nothing merges into fewer descriptors


def _agent(role: str, **options: Any) -> MooncakeBackend:
    return MooncakeBackend(f"mc-{role}-{uuid.uuid4().hex[:6]}", MooncakeOptions(**options))


def _rows_table(base: int, rows: int) -> np.ndarray:
    return make_table(base + np.arange(rows, dtype=np.uint64) * (ROW + GAP), ROW)


def _rows_view(buf: np.ndarray, rows: int) -> np.ndarray:
    return buf[: rows * (ROW + GAP)].reshape(rows, ROW + GAP)[:, :ROW]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[MooncakeBackend, MooncakeBackend, np.ndarray, np.ndarray]]:
    """Two agents in this process (two engines talking over loopback TCP)."""
    rows = 12_000
    src = np.frombuffer(bytearray(os.urandom(rows * (ROW + GAP))), dtype=np.uint8)
    dst = np.zeros(rows * (ROW + GAP), dtype=np.uint8)
    a = _agent("a", max_batch_descs=700, max_inflight_descs=1500)
    b = _agent("b")
    try:
        a.register([MemoryRegion.from_tensor(src)])
        b.register([MemoryRegion.from_tensor(dst)])
        a.add_peer(b.local_metadata())
        yield a, b, src, dst
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    "bad",
    [
        {"bogus": 1},
        {"protocol": "udp"},
        {"host": "0.0.0.0"},
        {"host": ""},
        {"rpc_port_range": (20000, 10000)},
        {"rpc_port_range": (80, 90)},
        {"max_batch_descs": 0},
        {"max_batch_descs": 70_000},
        {"max_batch_descs": 2048, "max_inflight_descs": 1024},
        {"transfer_timeout_s": 0},
        {"log_level": "TRACE"},
        {"completion_wait": "sometimes"},
    ],
)
def test_options_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        validate_options(Kind.BACKEND, "mooncake", MooncakeBackend, bad)


def test_options_accepted() -> None:
    opts = validate_options(
        Kind.BACKEND,
        "mooncake",
        MooncakeBackend,
        {
            "host": "0.0.0.0",
            "advertise_host": "10.0.0.5",
            "protocol": "rdma",
            "device_name": "mlx5_0,mlx5_1",
            "rpc_port_range": (20000, 20100),
            "max_batch_descs": 512,
        },
    )
    assert isinstance(opts, MooncakeOptions) and opts.protocol == "rdma"
    assert MooncakeOptions().max_batch_descs < 2048


def test_registration_and_hook_module_is_light() -> None:
    reg = PluginRegistry()
    entry = reg.get(Kind.BACKEND, "mooncake")
    assert entry.distribution == "kvwire-mooncake"
    assert 0 < entry.impl.priority < 20  # above tcp (0), below nixl (20)
    code = "import sys, kvwire_mooncake.plugin; assert 'mooncake' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    checks = [c for plugin, c in reg.doctor_checks() if plugin == "mooncake"]
    assert checks and all(c.ok for c in checks), checks


# ------------------------------------------------------------------- batches, budget
def test_split_batches_above_engine_queue(pair: Any) -> None:
    """5,000 descriptors in one submit (the engine alone fails above 2,048 to one peer), and
    four such transfers at once, beyond the in-flight budget (a backlog drains as batches
    complete); WRITE and READ, every byte checked."""
    a, b, src, dst = pair
    rows = 12_000
    peer = b.agent_name
    p = a.prepare(peer, _rows_table(src.ctypes.data, rows), _rows_table(dst.ctypes.data, rows))
    try:
        rng = np.random.default_rng(5)
        perm = rng.permutation(rows)
        handles = [
            a.submit(XferOp.WRITE, p, perm[i::4], perm[i::4][::-1].copy(), f"n{i}".encode())
            for i in range(4)
        ]
        for h in handles:
            assert wait_terminal(a, h, 60) is XferState.DONE, h.error
            a.release(h)
        s, d = _rows_view(src, rows), _rows_view(dst, rows)
        for i in range(4):
            np.testing.assert_array_equal(d[perm[i::4][::-1]], s[perm[i::4]])
        deadline = time.monotonic() + 5
        notes: list[Any] = []
        while len(notes) < 4 and time.monotonic() < deadline:
            notes += b.get_notifications()
            time.sleep(0.005)
        assert sorted(n.payload for n in notes) == [b"n0", b"n1", b"n2", b"n3"]
        assert all(n.peer == a.agent_name for n in notes)
        # READ back 5,000 rows into other local rows.
        src_view = s.copy()
        h = a.submit(XferOp.READ, p, np.arange(5000), np.arange(7000, 12_000))
        assert wait_terminal(a, h, 60) is XferState.DONE, h.error
        a.release(h)
        np.testing.assert_array_equal(s[:5000], d[7000:12_000])
        np.testing.assert_array_equal(s[5000:], src_view[5000:])
    finally:
        a.release_prepared(p)
    assert a.live_handles == 0


def test_threads_submit_beyond_budget_concurrently(pair: Any) -> None:
    """Four threads submit multi-batch WRITEs to one peer at once, beyond the in-flight budget
    (batches are reserved under the peer's lock and handed to the engine outside it): every
    byte lands, each notification arrives once, and the peer's accounting returns to zero."""
    a, b, src, dst = pair
    rows = 12_000
    peer = b.agent_name
    p = a.prepare(peer, _rows_table(src.ctypes.data, rows), _rows_table(dst.ctypes.data, rows))
    sets = np.array_split(np.random.default_rng(9).permutation(rows), 8)  # disjoint rows
    errors: list[BaseException] = []
    b.get_notifications()
    s, d = _rows_view(src, rows), _rows_view(dst, rows)

    def worker(k: int) -> None:
        try:
            for j in (k, k + 4):
                rows_j = sets[j]
                s[rows_j] = np.random.default_rng(j).integers(0, 256, (rows_j.size, ROW), np.uint8)
                h = a.submit(XferOp.WRITE, p, rows_j, rows_j, f"t{j}".encode())
                assert wait_terminal(a, h, 60) is XferState.DONE, h.error
                a.release(h)
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        np.testing.assert_array_equal(d, s)
        notes: list[Any] = []
        deadline = time.monotonic() + 5
        while len(notes) < 8 and time.monotonic() < deadline:
            notes += b.get_notifications()
            time.sleep(0.005)
        time.sleep(0.05)
        notes += b.get_notifications()
        assert sorted(n.payload for n in notes) == sorted(f"t{j}".encode() for j in range(8))
        state = a._peers[peer]
        deadline = time.monotonic() + 5
        while (state.inflight or state.posting) and time.monotonic() < deadline:
            time.sleep(0.01)  # the waiter pops a batch just after its transfer completed
        with state.cond:
            assert not state.inflight and not state.posting and not state.backlog
            assert state.inflight_descs == 0
    finally:
        a.release_prepared(p)
    assert a.live_handles == 0


def test_inflight_budget_follows_engine_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user-exported MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER caps the in-flight budget, so
    kvwire never overflows the engine's queue (which would fail every batch to the peer)."""
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "300")
    a, b = _agent("qa", max_batch_descs=256), _agent("qb")
    try:
        assert a.inflight_limit == 300
        rows = 3000
        src = np.frombuffer(bytearray(os.urandom(rows * (ROW + GAP))), dtype=np.uint8)
        dst = np.zeros_like(src)
        a.register([MemoryRegion.from_tensor(src)])
        b.register([MemoryRegion.from_tensor(dst)])
        peer = a.add_peer(b.local_metadata())
        p = a.prepare(peer, _rows_table(src.ctypes.data, rows), _rows_table(dst.ctypes.data, rows))
        idx = np.arange(rows)
        h = a.submit(XferOp.WRITE, p, idx, idx)
        assert wait_terminal(a, h, 60) is XferState.DONE, h.error
        a.release(h)
        np.testing.assert_array_equal(_rows_view(dst, rows), _rows_view(src, rows))
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------- addresses, ports
_PORTS_CHILD = """
import json, os, sys
from kvwire_mooncake.backend import MooncakeBackend, MooncakeOptions
from kvwire_mooncake.engine import MooncakeEngineError, ephemeral_port_range

def listening():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in open(table).readlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                addr, port = f[1].rsplit(":", 1)
                out[int(port, 16)] = addr
    return out

lo = int(sys.argv[1])
a = MooncakeBackend("ports", MooncakeOptions(rpc_port_range=(lo, lo + 60)))
print(json.dumps({"segment": a.segment, "notify": a.notify_endpoint, "ports": listening()}))
a.close()
"""


def test_ports_and_notification_address() -> None:
    """rpc_port_range confines every listener an agent opens (in a fresh process: Mooncake
    reads the range once, at import); the notification socket binds to ``host`` only. (The
    engine's own listeners take all interfaces: Mooncake 0.3.13 has no setting for that.)"""
    lo = random.randrange(20_000, 28_000, 100)
    out = subprocess.run(
        [sys.executable, "-c", _PORTS_CHILD, str(lo)], check=True, capture_output=True, text=True
    ).stdout
    info = json.loads(out.strip().splitlines()[-1])
    ports = {int(p): addr for p, addr in info["ports"].items()}
    assert len(ports) == 3, ports  # engine handshake + data listeners, notification socket
    assert all(lo <= p <= lo + 60 for p in ports), (lo, ports)
    host, port = info["segment"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) in ports
    notify_port = int(info["notify"].rsplit(":", 1)[1])
    assert info["notify"] == f"tcp://127.0.0.1:{notify_port}"
    assert ports[notify_port] == "0100007F"  # bound to 127.0.0.1, not a wildcard


def test_port_range_overlapping_ephemeral_ports_refused() -> None:
    eph = ephemeral_port_range()
    if eph is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range")
    with pytest.raises(MooncakeEngineError, match="ephemeral"):
        _agent("eph", rpc_port_range=(eph[0], min(eph[0] + 50, 65535)))


def test_unreachable_notification_host_refused() -> None:
    with pytest.raises(MooncakeEngineError, match="notification socket"):
        _agent("badhost", host="192.0.2.123")


# -------------------------------------------------------------------------- metadata
def test_metadata_checked(pair: Any) -> None:
    a, b, _, _ = pair
    with pytest.raises(PeerError, match="msgpack"):
        a.add_peer(b"\xc1not msgpack")
    meta = msgpack.unpackb(b.local_metadata(), raw=False)
    with pytest.raises(PeerError, match="protocol"):
        a.add_peer(msgpack.packb({**meta, "name": "other", "protocol": "rdma"}))
    with pytest.raises(PeerError, match="mooncake backend"):
        a.add_peer(msgpack.packb({**meta, "backend": "tcp"}))
    with pytest.raises(PeerError, match="version"):
        a.add_peer(msgpack.packb({**meta, "v": 99}))
    with pytest.raises(PeerError, match="cannot reach"):
        a.add_peer(msgpack.packb({**meta, "name": "ghost", "segment": "127.0.0.1:1"}))
    assert "ghost" not in a.peers() and "other" not in a.peers()


# ---------------------------------------------------------------- removal with backlog
def test_remove_peer_fails_backlog_promptly() -> None:
    """Transfers beyond the in-flight budget wait in a backlog; removing the (stopped) peer
    fails all of them at once; adding it again while it is stopped fails after
    connect_timeout_s without freezing the process; after it restarts, adding it works;
    close() does not wait for the engine."""
    victim = RemoteAgent("mooncake", {}, f"mc-victim-{uuid.uuid4().hex[:6]}").start()
    a = _agent(
        "rm",
        max_batch_descs=500,
        max_inflight_descs=1000,
        transfer_timeout_s=5,
        # 5 s: a GIL held through the connect would freeze the ticker that long, twice the
        # gap allowed below, which leaves room for a loaded host's starvation (1.2-1.4 s)
        connect_timeout_s=5.0,
    )
    try:
        rows = 3000
        src = np.zeros(rows * (ROW + GAP), dtype=np.uint8)
        a.register([MemoryRegion.from_tensor(src)])
        sink = victim.allocate("sink", rows * (ROW + GAP), watch=False)
        meta = victim.metadata()
        peer = a.add_peer(meta)
        p = a.prepare(peer, _rows_table(src.ctypes.data, rows), _rows_table(sink.addr, rows))
        victim.suspend()
        idx = np.arange(rows)
        handles = [a.submit(XferOp.WRITE, p, idx, idx) for _ in range(3)]
        assert all(a.poll(h) is XferState.PENDING for h in handles)
        t0 = time.monotonic()
        a.remove_peer(peer)
        assert all(a.poll(h) is XferState.FAILED for h in handles)
        assert all("removed" in (h.error or "") for h in handles)
        assert time.monotonic() - t0 < 3.0  # at once, not by their 5 s timeout
        for h in handles:
            a.release(h)
        ticks: list[float] = []
        done = threading.Event()

        def tick() -> None:
            while not done.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.01)

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        t0 = time.monotonic()
        with pytest.raises(PeerError, match="did not answer"):
            a.add_peer(meta)
        done.set()
        ticker.join()
        assert time.monotonic() - t0 < 9.0
        assert max(np.diff(ticks)) < 2.5, "add_peer froze the interpreter (GIL held)"
        # The peer restarts (same agent name, new process and ports): adding it works again.
        victim.kill()
        victim.close()
        victim = RemoteAgent("mooncake", {}, victim.agent_name).start()
        sink = victim.allocate("sink", rows * (ROW + GAP), watch=False)
        assert a.add_peer(victim.metadata()) == peer
        p = a.prepare(peer, _rows_table(src.ctypes.data, rows), _rows_table(sink.addr, rows))
        src[:] = np.frombuffer(os.urandom(src.size), dtype=np.uint8)
        h = a.submit(XferOp.WRITE, p, idx, idx)
        assert wait_terminal(a, h, 30) is XferState.DONE, h.error
        a.release(h)
        got = np.frombuffer(victim.read("sink"), dtype=np.uint8)
        np.testing.assert_array_equal(_rows_view(got, rows), _rows_view(src, rows))
    finally:
        victim.kill()
        t0 = time.monotonic()
        a.close()
        assert time.monotonic() - t0 < 5.0
        victim.close()
