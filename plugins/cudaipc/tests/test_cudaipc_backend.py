"""What of the ``cudaipc`` backend runs without a GPU: metadata validation, the host
identity check and the refusals that need no device.

Only on a GPU machine (``scripts/gpu_cudaipc_bench.py``): exporting and opening IPC handles,
enabling peer access, the fused mover writing into a peer GPU, and the refusal of a peer GPU
this process cannot see or reach peer to peer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from kvwire.backend import PeerFacts, TransferBackend
from kvwire.config import KVWireConfig
from kvwire.descriptors import make_table
from kvwire.errors import ConfigError, DescriptorError, PeerError
from kvwire.layout import MemKind, MemoryRegion
from kvwire.link_choice import host_identity
from kvwire.selection import create_backend
from kvwire_cudaipc import _cuda, host_stand_ins
from kvwire_cudaipc.meta import IpcExport, parse_peer


@pytest.fixture
def agents() -> Iterator[tuple[TransferBackend, TransferBackend, np.ndarray]]:
    cfg = KVWireConfig(transfer_backend="cudaipc")
    a = create_backend(cfg, "prefill-a", need=())
    b = create_backend(cfg, "decode-b", need=())
    buf = np.zeros(1 << 16, dtype=np.uint8)
    b.register([MemoryRegion.from_tensor(buf, item_len=4096)])
    yield a, b, buf
    a.close()
    b.close()


def _edit(meta: bytes, **changes: object) -> bytes:
    d = msgpack.unpackb(meta, raw=False)
    d.update(changes)
    out: bytes = msgpack.packb(d, use_bin_type=True)
    return out


def test_metadata_carries_host_identity_and_parses(agents: tuple) -> None:
    a, b, buf = agents
    info = parse_peer(b.local_metadata(), "cudaipc", 1)
    assert info.name == "decode-b"
    assert info.host == _cuda.host_identity()
    assert info.host["boot_id"] and info.host["hostname"]
    assert [r.addr for r in info.regions] == [buf.ctypes.data]
    assert info.exports == ()
    assert a.add_peer(b.local_metadata()) == "decode-b"


def test_peer_on_another_host_is_refused(agents: tuple) -> None:
    a, b, _ = agents
    host = {**_cuda.host_identity(), "boot_id": "00000000-0000-0000-0000-000000000000"}
    with pytest.raises(ConfigError, match=r"another host.*nixl or mooncake"):
        a.add_peer(_edit(b.local_metadata(), host=host))
    host = {**_cuda.host_identity(), "hostname": "elsewhere"}
    with pytest.raises(ConfigError, match="another host"):
        a.add_peer(_edit(b.local_metadata(), host=host))
    assert a.peers() == []


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"host": "x"}, "host must be"),
        ({"pid": 0}, "pid"),
        ({"scratch": "x"}, "scratch"),
        ({"exports": [[1 << 40, b"x" * 63, 0, "GPU-1"]]}, "64 bytes"),
        ({"exports": [[1 << 40, b"x" * 64, -1, "GPU-1"]]}, "offset"),
        ({"exports": [[1 << 40, b"x" * 64, 0, ""]]}, "UUID"),
        ({"exports": [[1 << 40, b"x" * 64, 0, "GPU-1"]]}, "each VRAM region once"),
        ({"endpoint": "ipc://x"}, "tcp://"),
        ({"backend": "tcp"}, "not produced by a cudaipc"),
        ({"v": 99}, "version"),
    ],
)
def test_malformed_metadata_is_refused(agents: tuple, changes: dict, match: str) -> None:
    a, b, _ = agents
    with pytest.raises(PeerError, match=match):
        a.add_peer(_edit(b.local_metadata(), **changes))
    assert a.peers() == []


def test_export_rows_round_trip() -> None:
    e = IpcExport(addr=1 << 40, handle=bytes(range(64)), offset=4096, uuid="GPU-abc")
    assert IpcExport.from_row(e.to_row()) == e
    meta = msgpack.unpackb(msgpack.packb(e.to_row(), use_bin_type=True), raw=False)
    assert IpcExport.from_row(meta) == e


def test_remote_vram_rows_need_local_vram(agents: tuple) -> None:
    """A peer that published a VRAM region (here: fabricated, no GPU needed to parse it): a
    rank without VRAM of its own opens nothing and refuses VRAM rows at prepare, naming why."""
    a, b, _ = agents
    local = np.zeros(1 << 14, dtype=np.uint8)
    a.register([MemoryRegion.from_tensor(local, item_len=4096)])
    vaddr = 1 << 44
    meta = msgpack.unpackb(b.local_metadata(), raw=False)
    meta["regions"].append([vaddr, 1 << 20, 0, int(MemKind.VRAM)])
    meta["exports"] = [[vaddr, b"h" * 64, 0, "GPU-00000000"]]
    peer = a.add_peer(msgpack.packb(meta, use_bin_type=True))
    with pytest.raises(DescriptorError, match="registered no VRAM"):
        a.prepare(peer, make_table([local.ctypes.data], 4096), make_table([vaddr], 4096))


def test_vram_registration_without_a_gpu_is_a_config_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    a = create_backend(KVWireConfig(transfer_backend="cudaipc"), "x", need=())
    try:
        with pytest.raises(ConfigError, match="no CUDA device"):
            a.register([MemoryRegion.from_pointer(1 << 44, 1 << 20, 4096, kind=MemKind.VRAM)])
        assert a.registered_regions == []
    finally:
        a.close()


#: Events whose kernels end when the test opens ``_HostEvent.gate``.
_HostEvent = host_stand_ins.GatedEvent


def _host_stand_ins(monkeypatch: pytest.MonkeyPatch) -> host_stand_ins.HostPages:
    """Replace a cudaipc backend's GPU calls with host stand-ins (IPC export, GPU UUIDs, the
    movers, CUDA events: :mod:`kvwire_cudaipc.host_stand_ins`, with the gated
    :class:`_HostEvent`; everything else is the backend's own VRAM path) for every backend
    created from now on in the test; returns the stand-in mover they use (its ``move``
    copies runs with memmove). The events' ``gate`` is the caller's to set."""
    pytest.importorskip("torch")
    copier = host_stand_ins.HostPages()
    host_stand_ins.install(monkeypatch.setattr, copier, runs=copier, event=_HostEvent)
    return copier


def test_vram_path_control_flow_with_host_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The VRAM path without a GPU: CUDA calls (export, UUIDs, event, the kernel) replaced
    by host stand-ins, regions flagged VRAM over host memory, two agents in one process (no
    IPC open: same process). A WRITE of VRAM rows with a notification is ONE copier call,
    the notification travels alone (a note to a peer that takes them, else a write of its
    scratch word) and arrives after the data; a WRITE mixing VRAM and host rows moves each
    kind its way; pairing a VRAM row with a host row is refused."""
    import time

    from kvwire.backend import XferOp, XferState

    copier = _host_stand_ins(monkeypatch)
    _HostEvent.gate.set()

    rng = np.random.default_rng(4)
    cfg = KVWireConfig(transfer_backend="cudaipc")
    a = create_backend(cfg, "prefill", need=())
    b = create_backend(cfg, "decode", need=())
    try:
        av = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
        bv = np.zeros(1 << 16, np.uint8)
        aa = rng.integers(0, 256, 256, dtype=np.uint8)
        ba = np.zeros(256, np.uint8)

        def vram(x: np.ndarray) -> MemoryRegion:
            return MemoryRegion.from_pointer(x.ctypes.data, x.nbytes, 4096, MemKind.VRAM, 0)

        ah = np.zeros(4096, np.uint8)  # a host row as long as a VRAM row
        a.register([vram(av), MemoryRegion.from_tensor(aa, item_len=64)])
        a.register([MemoryRegion.from_tensor(ah, item_len=4096)])
        b.register([vram(bv), MemoryRegion.from_tensor(ba, item_len=64)])
        peer = a.add_peer(b.local_metadata())
        local = np.concatenate(
            [
                make_table(av.ctypes.data + np.arange(16) * 4096, 4096),
                make_table(aa.ctypes.data + np.arange(4) * 64, 64),
                make_table([ah.ctypes.data], 4096),
            ]
        )
        remote = np.concatenate(
            [
                make_table(bv.ctypes.data + np.arange(16) * 4096, 4096),
                make_table(ba.ctypes.data + np.arange(4) * 64, 64),
            ]
        )
        pair = a.prepare(peer, local, remote)

        def finish(h: object) -> None:
            for _ in range(2000):
                state = a.poll(h)  # type: ignore[arg-type]
                if state is not XferState.PENDING:
                    break
                time.sleep(0.005)
            assert state is XferState.DONE, h
            a.release(h)  # type: ignore[arg-type]

        def notes() -> list:
            for _ in range(2000):
                got = b.get_notifications()
                if got:
                    return got
                time.sleep(0.005)
            return []

        perm = rng.permutation(16)
        finish(a.submit(XferOp.WRITE, pair, np.arange(16), perm, notification=b"kv"))
        assert copier.launches == 1
        assert np.array_equal(bv.reshape(16, 4096)[perm], av.reshape(16, 4096))
        assert [n.payload for n in notes()] == [b"kv"]

        bv[:] = 0
        mixed_l, mixed_r = np.array([3, 17, 5, 16]), np.array([9, 19, 2, 18])
        finish(a.submit(XferOp.WRITE, pair, mixed_l, mixed_r, notification=b"mixed"))
        assert copier.launches == 2
        assert np.array_equal(bv[9 * 4096 : 10 * 4096], av[3 * 4096 : 4 * 4096])
        assert np.array_equal(bv[2 * 4096 : 3 * 4096], av[5 * 4096 : 6 * 4096])
        assert np.array_equal(ba[192:256], aa[64:128]) and np.array_equal(ba[128:192], aa[0:64])
        assert [n.payload for n in notes()] == [b"mixed"]

        with pytest.raises(DescriptorError, match="pairs local row 20 \\(DRAM\\)"):
            a.submit(XferOp.WRITE, pair, np.array([20]), np.array([0]))
    finally:
        a.close()
        b.close()


def test_kernel_end_wakes_the_submitter_and_sends_the_note_without_a_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cudaipc pushes events (its owners sleep until woken, up to 5 ms on prefill's workers):
    when a launch's kernel ends, its own watcher thread posts the notification and calls the
    submitter's ``wake``, with no ``poll`` in between. Before the kernel ends, neither
    happens; a transfer with host rows wakes its submitter once the side channel's write of
    them ends. Same host stand-ins as above; the stand-in event stays in flight until its
    gate opens."""

    from kvwire.backend import XferOp, XferState

    _host_stand_ins(monkeypatch)
    _HostEvent.gate.clear()
    cfg = KVWireConfig(transfer_backend="cudaipc")
    a = create_backend(cfg, "prefill", need=())
    b = create_backend(cfg, "decode", need=())
    try:
        assert a.pushes_events
        av = np.arange(1 << 15, dtype=np.uint8)
        bv = np.zeros(1 << 15, np.uint8)
        ah, bh = np.full(64, 7, np.uint8), np.zeros(64, np.uint8)

        def vram(x: np.ndarray) -> MemoryRegion:
            return MemoryRegion.from_pointer(x.ctypes.data, x.nbytes, 4096, MemKind.VRAM, 0)

        a.register([vram(av), MemoryRegion.from_tensor(ah, item_len=64)])
        b.register([vram(bv), MemoryRegion.from_tensor(bh, item_len=64)])
        peer = a.add_peer(b.local_metadata())
        local = np.concatenate(
            [
                make_table(av.ctypes.data + np.arange(8) * 4096, 4096),
                make_table([ah.ctypes.data], 64),
            ]
        )
        remote = np.concatenate(
            [
                make_table(bv.ctypes.data + np.arange(8) * 4096, 4096),
                make_table([bh.ctypes.data], 64),
            ]
        )
        pair = a.prepare(peer, local, remote)
        woken = threading.Event()
        h = a.submit(
            XferOp.WRITE, pair, np.arange(8), np.arange(8), notification=b"kv", wake=woken.set
        )
        assert not woken.wait(0.3), "woken while the kernel was still running"
        assert b.get_notifications() == []  # the note waits for the kernel
        _HostEvent.gate.set()  # the kernel ends; nobody polls
        assert woken.wait(30), "the kernel's end did not wake the submitter"
        assert _first_notes(b) == [b"kv"]
        assert a.poll(h) is XferState.DONE
        assert np.array_equal(bv, av[: bv.size])
        a.release(h)

        woken.clear()
        h = a.submit(XferOp.WRITE, pair, np.array([8, 0]), np.array([8, 1]), wake=woken.set)
        assert woken.wait(30), "the side channel's write of the host row did not wake"
        assert a.poll(h) is XferState.DONE
        assert np.array_equal(bh, ah) and np.array_equal(bv[4096:8192], av[:4096])
        a.release(h)
    finally:
        _HostEvent.gate.set()
        a.close()
        b.close()


def _vram_pair() -> tuple[Any, Any, np.ndarray, np.ndarray, Any]:
    """Two cudaipc agents (host stand-ins installed by the caller) with 32 KiB of host
    memory each, flagged VRAM, and prefill's prepared pair of 8 rows of 4 KiB: (prefill,
    decode, prefill's bytes, decode's zeroed bytes, the pair). The caller closes both."""
    cfg = KVWireConfig(transfer_backend="cudaipc")
    a = create_backend(cfg, "prefill", need=())
    b = create_backend(cfg, "decode", need=())
    av = np.arange(1 << 15, dtype=np.uint8)
    bv = np.zeros(1 << 15, np.uint8)

    def vram(x: np.ndarray) -> MemoryRegion:
        return MemoryRegion.from_pointer(x.ctypes.data, x.nbytes, 4096, MemKind.VRAM, 0)

    try:
        a.register([vram(av)])
        b.register([vram(bv)])
        peer = a.add_peer(b.local_metadata())
        pair = a.prepare(
            peer,
            make_table(av.ctypes.data + np.arange(8) * 4096, 4096),
            make_table(bv.ctypes.data + np.arange(8) * 4096, 4096),
        )
    except BaseException:
        a.close()
        b.close()
        raise
    return a, b, av, bv, pair


def _first_notes(b: Any) -> list[bytes]:
    """The payloads of the first notifications ``b`` receives (30 s at most)."""
    import time

    for _ in range(3000):
        got = b.get_notifications()
        if got:
            return [n.payload for n in got]
        time.sleep(0.01)
    return []


def test_a_poll_sends_the_note_when_the_watchers_handling_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel watcher saw a launch end, but posting its note failed on the watcher's
    thread (an unexpected error, logged): the submitter's next poll posts the note itself, so
    decode still hears of the chunk. The transfer is marked ``ended`` by then (its event may
    already be recorded again for another launch), so the poll must not need the event.
    Same host stand-ins as above."""
    import time

    import kvwire_cudaipc.backend as backend_mod
    from kvwire.backend import XferOp, XferState

    _host_stand_ins(monkeypatch)
    _HostEvent.gate.clear()
    real = backend_mod.CudaIpcBackend._post_follow
    calls: list[str] = []

    def flaky(self: object, x: object) -> bool:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise RuntimeError("stand-in failure on the watcher's thread")
        return real(self, x)  # type: ignore[arg-type]

    monkeypatch.setattr(backend_mod.CudaIpcBackend, "_post_follow", flaky)
    a, b, av, bv, pair = _vram_pair()
    try:
        h = a.submit(XferOp.WRITE, pair, np.arange(8), np.arange(8), notification=b"kv")
        _HostEvent.gate.set()  # the kernel ends; the watcher's note post fails
        for _ in range(3000):
            if h.state.ended:
                break
            time.sleep(0.01)
        assert h.state.ended and calls and calls[0].endswith("-kernels"), calls
        assert a.poll(h) is XferState.DONE
        assert _first_notes(b) == [b"kv"]
        assert np.array_equal(bv, av[: bv.size])
        a.release(h)
    finally:
        _HostEvent.gate.set()
        a.close()
        b.close()


@pytest.mark.parametrize("broken", [False, True])
def test_a_later_note_is_made_after_the_kernel_on_the_watchers_thread(
    monkeypatch: pytest.MonkeyPatch, broken: bool
) -> None:
    """A transfer whose notification is a :class:`~kvwire.transfers.LaterNote` (prefill's
    first note of a checksummed chunk, its sums computed beside the write): the submit does
    not make it; once the kernel ended, the kernel watcher (or a poll that saw the end first)
    makes it, once, and posts it, and decode gets those bytes after the data. A note that
    cannot be made fails the transfer, naming why, and nothing reaches decode. Host
    stand-ins as above."""
    import time

    from kvwire.backend import LaterNote, XferOp, XferState

    _host_stand_ins(monkeypatch)
    _HostEvent.gate.clear()
    made: list[bool] = []  # whether the kernel had ended

    def make() -> bytes:
        made.append(_HostEvent.gate.is_set())
        if broken:
            raise RuntimeError("the sums' kernel failed")
        return b"summed"

    a, b, av, bv, pair = _vram_pair()
    try:
        note = LaterNote(make)
        h = a.submit(XferOp.WRITE, pair, np.arange(8), np.arange(8), notification=note)
        assert not made and a.poll(h) is XferState.PENDING  # the kernel has not ended
        _HostEvent.gate.set()
        for _ in range(3000):
            state = a.poll(h)
            if state is not XferState.PENDING:
                break
            time.sleep(0.01)
        assert made == [True], made
        if broken:
            assert state is XferState.FAILED
            assert "notification could not be made" in (h.error or ""), h.error
            assert "the sums' kernel failed" in (h.error or "")
            time.sleep(0.2)
            assert b.get_notifications() == []
        else:
            assert state is XferState.DONE
            assert _first_notes(b) == [b"summed"]
            assert np.array_equal(bv, av[: bv.size])
        a.release(h)
    finally:
        _HostEvent.gate.set()
        a.close()
        b.close()


def test_a_failed_kernel_seen_by_a_poll_fails_the_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel that failed (a sticky CUDA error: the event's ``query`` raises) fails its
    transfer at the poll that sees it, naming the error, rather than raising out of
    ``poll`` into the worker's loop; no notification goes out. Host stand-ins as above."""
    from kvwire.backend import XferOp, XferState

    _host_stand_ins(monkeypatch)
    _HostEvent.gate.clear()

    def broken(self: _HostEvent) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(_HostEvent, "query", broken)
    cfg = KVWireConfig(transfer_backend="cudaipc")
    a = create_backend(cfg, "prefill-bad", need=())
    b = create_backend(cfg, "decode-bad", need=())
    try:
        av = np.arange(1 << 14, dtype=np.uint8)
        bv = np.zeros(1 << 14, np.uint8)

        def vram(x: np.ndarray) -> MemoryRegion:
            return MemoryRegion.from_pointer(x.ctypes.data, x.nbytes, 4096, MemKind.VRAM, 0)

        a.register([vram(av)])
        b.register([vram(bv)])
        peer = a.add_peer(b.local_metadata())
        local = make_table(av.ctypes.data + np.arange(4) * 4096, 4096)
        remote = make_table(bv.ctypes.data + np.arange(4) * 4096, 4096)
        pair = a.prepare(peer, local, remote)
        h = a.submit(XferOp.WRITE, pair, np.arange(4), np.arange(4), notification=b"never")
        assert a.poll(h) is XferState.FAILED
        assert h.error is not None and "illegal memory access" in h.error
        assert a.poll(h) is XferState.FAILED  # and stays failed
        a.release(h)
        assert b.get_notifications() == []
    finally:
        _HostEvent.gate.set()
        a.close()
        b.close()


def test_all_vram_pair_submits_one_launch_of_exactly_its_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pair whose tables are VRAM in every row (a KV pool's) takes the submit's fast path:
    one copier call whose runs are exactly the rows' addresses (the peer's side translated into
    this process's mapping) and lengths, in the order given; the bytes land, the notification
    follows. Host stand-ins as above."""
    import time

    from kvwire.backend import XferOp, XferState

    calls: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    copier = _host_stand_ins(monkeypatch)
    real_move = copier.move

    def move(src: np.ndarray, dst: np.ndarray, n: np.ndarray, stream: object = None) -> None:
        calls.append((src.copy(), dst.copy(), n.copy()))
        real_move(src, dst, n)

    monkeypatch.setattr(copier, "move", move)
    _HostEvent.gate.set()
    cfg = KVWireConfig(transfer_backend="cudaipc")
    a = create_backend(cfg, "prefill", need=())
    b = create_backend(cfg, "decode", need=())
    try:
        rng = np.random.default_rng(8)
        av = rng.integers(0, 256, 1 << 14, dtype=np.uint8)
        bv = np.zeros(1 << 15, np.uint8)

        def vram(x: np.ndarray) -> MemoryRegion:
            return MemoryRegion.from_pointer(x.ctypes.data, x.nbytes, 1024, MemKind.VRAM, 0)

        a.register([vram(av)])
        b.register([vram(bv)])
        peer = a.add_peer(b.local_metadata())
        # rows of 1 KiB on both sides; the peer's pool has twice as many
        local = make_table(av.ctypes.data + np.arange(16) * 1024, 1024)
        remote = make_table(bv.ctypes.data + np.arange(32) * 1024, 1024)
        pair = a.prepare(peer, local, remote)
        assert pair.state.all_vram  # the fast path is the one under test
        li, ri = rng.permutation(16), rng.permutation(32)[:16]
        h = a.submit(XferOp.WRITE, pair, li, ri, notification=b"fast")
        for _ in range(3000):
            if a.poll(h) is not XferState.PENDING:
                break
            time.sleep(0.005)
        assert a.poll(h) is XferState.DONE
        a.release(h)
        assert len(calls) == 1
        src, dst, n = calls[0]
        assert np.array_equal(src, av.ctypes.data + li * 1024)
        assert np.array_equal(dst, bv.ctypes.data + ri * 1024)  # same process: no delta
        assert np.array_equal(n, np.full(16, 1024))
        for i, r in zip(li.tolist(), ri.tolist(), strict=True):
            assert np.array_equal(bv[r * 1024 : (r + 1) * 1024], av[i * 1024 : (i + 1) * 1024])
        got: list = []
        for _ in range(3000):
            got += b.get_notifications()
            if got:
                break
            time.sleep(0.005)
        assert [x.payload for x in got] == [b"fast"]
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------ the per-link check (link_problem)
def test_link_problem_names_another_host(agents: tuple) -> None:
    """Prefill asks each backend whether it can serve a link before adding the peer: cudaipc
    refuses a peer whose handshake names another host (and one whose metadata does)."""
    a, b, _ = agents
    elsewhere = {"boot_id": "00000000-0000-0000-0000-000000000000", "hostname": "elsewhere"}
    why = a.link_problem(PeerFacts(elsewhere, b.local_metadata()))
    assert why is not None and why.startswith("different hosts") and "'elsewhere'" in why
    why = a.link_problem(PeerFacts({}, _edit(b.local_metadata(), host=elsewhere)))
    assert why is not None and why.startswith("different hosts")
    assert "unreadable cudaipc metadata" in (a.link_problem(PeerFacts({}, b"junk")) or "")


def test_link_problem_on_one_host_without_cuda(agents: tuple) -> None:
    """Same host: on a machine without a GPU the reason is "no CUDA"; with one (and no VRAM
    registered here) it is the missing VRAM."""
    a, b, _ = agents
    why = a.link_problem(PeerFacts(host_identity(), b.local_metadata()))
    assert why is not None
    if _cuda.cuda_problem() is None:
        assert "registered no VRAM" in why
    else:
        assert "no CUDA" in why
        cls = type(a)
        assert "no CUDA" in (cls.rank_problem(frozenset({MemKind.VRAM})) or "")
    assert "no VRAM pool" in (type(a).rank_problem(frozenset({MemKind.DRAM})) or "")


def test_add_link_falls_back_past_cudaipc_with_its_reason() -> None:
    """A rank with ``cudaipc,tcp`` adds a peer that announces both over tcp when cudaipc
    cannot serve the link, and names why (no CUDA here, or another host)."""
    from kvwire.backends.multi import MultiBackend

    def multi(agent: str) -> MultiBackend:
        cfg = KVWireConfig(transfer_backend="cudaipc")
        members = [
            create_backend(cfg, agent, need=()),
            create_backend(KVWireConfig(transfer_backend="tcp"), agent),
        ]
        return MultiBackend(agent, members)

    a, b = multi("prefill-m"), multi("decode-m")
    try:
        buf = np.zeros(1 << 12, dtype=np.uint8)
        b.register([MemoryRegion.from_tensor(buf, item_len=4096)])
        choice = a.add_link(b.offers(), host_identity())
        assert choice.backend == "tcp" and choice.fallbacks == ()
        assert set(choice.skipped) == {"cudaipc"}
        far = a.add_link(b.offers(), {"boot_id": "x", "hostname": "far"})
        assert far.skipped["cudaipc"].startswith("different hosts")
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("peer_takes_notes", [True, False])
def test_a_notification_alone_goes_as_a_note_to_a_peer_that_takes_them(
    monkeypatch: pytest.MonkeyPatch, peer_takes_notes: bool
) -> None:
    """A transfer of VRAM rows only sends its notification after the kernel: as a note
    (``tcp`` kind ``N``: the notification alone, not answered) to a peer whose metadata says
    ``notes``, and as the acknowledged write of its scratch word to an older peer (metadata
    without the key). The notification arrives exactly once either way, after the data.
    Host stand-ins as above."""
    import time

    from kvwire.backend import XferOp, XferState

    _host_stand_ins(monkeypatch)
    _HostEvent.gate.set()
    cfg = KVWireConfig(transfer_backend="cudaipc")
    a = create_backend(cfg, "prefill", need=())
    b = create_backend(cfg, "decode", need=())
    try:
        av = np.arange(1 << 15, dtype=np.uint8)
        bv = np.zeros(1 << 15, np.uint8)

        def vram(x: np.ndarray) -> MemoryRegion:
            return MemoryRegion.from_pointer(x.ctypes.data, x.nbytes, 4096, MemKind.VRAM, 0)

        a.register([vram(av)])
        b.register([vram(bv)])
        meta = msgpack.unpackb(b.local_metadata(), raw=False)
        assert meta["notes"] is True
        if not peer_takes_notes:  # what an older cudaipc publishes
            del meta["notes"]
        peer = a.add_peer(msgpack.packb(meta, use_bin_type=True))
        table = make_table(av.ctypes.data + np.arange(8) * 4096, 4096)
        pair = a.prepare(peer, table, make_table(bv.ctypes.data + np.arange(8) * 4096, 4096))
        woken = threading.Event()
        h = a.submit(XferOp.WRITE, pair, np.arange(8), np.arange(8), b"kv", wake=woken.set)
        assert woken.wait(30)
        got: list = []
        for _ in range(3000):
            got += b.get_notifications()
            if got:
                break
            time.sleep(0.01)
        time.sleep(0.05)
        got += b.get_notifications()
        assert [n.payload for n in got] == [b"kv"]
        assert np.array_equal(bv, av[: bv.size])
        assert a.poll(h) is XferState.DONE
        assert h.state.tcp.note_only is peer_takes_notes
        assert b.refused_messages == 0
        a.release(h)
    finally:
        a.close()
        b.close()


def _done(a: TransferBackend, h: object) -> None:
    """Poll ``h`` (a stand-in kernel: the event's gate is set) to DONE and release it."""
    import time

    from kvwire.backend import XferState

    for _ in range(3000):
        if a.poll(h) is not XferState.PENDING:  # type: ignore[arg-type]
            break
        time.sleep(0.005)
    assert a.poll(h) is XferState.DONE  # type: ignore[arg-type]
    a.release(h)  # type: ignore[arg-type]


def test_a_few_large_runs_go_to_the_copy_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bulk staging's blocks (at most ``copy_engine_max_runs`` runs of at least
    ``copy_engine_min_bytes``, once runs that continue each other are merged: adjacent rows
    are one copy) are enqueued as copy-engine copies on the backend's stream, not as an SM
    mover launch; a list with short runs, or the rule turned off, goes to the mover. The
    copies themselves are stood in for by memmove (no GPU here); on a GPU, ``kvwire
    bench-layerwise --backends cudaipc`` and ``scripts/gpu_staged_bench.py --backend cudaipc``
    check every byte of such runs."""
    import ctypes
    import types

    import kvwire_cudaipc.backend as backend_mod
    from kvwire.backend import XferOp
    from kvwire_cudaipc.copies import takes_copy_engine

    mib = 1 << 20
    assert takes_copy_engine(np.full(4, mib), mib, 32)
    assert takes_copy_engine(np.full(32, mib), mib, 32)
    assert not takes_copy_engine(np.array([mib, mib - 1]), mib, 32)  # one short run
    assert not takes_copy_engine(np.full(33, mib), mib, 32)  # too many runs
    assert not takes_copy_engine(np.full(4, mib), 0, 32)  # turned off
    assert not takes_copy_engine(np.zeros(0, np.int64), mib, 32)

    copier = _host_stand_ins(monkeypatch)
    moved: list[int] = []
    engine: list[tuple[list[int], int]] = []
    real_move = copier.move

    def move(src: np.ndarray, dst: np.ndarray, n: np.ndarray, stream: object = None) -> None:
        moved.append(len(n))
        real_move(src, dst, n)

    def copy_runs(src: np.ndarray, dst: np.ndarray, n: np.ndarray, stream: int) -> None:
        engine.append((n.tolist(), stream))
        for s, d, k in zip(src.tolist(), dst.tolist(), n.tolist(), strict=True):
            ctypes.memmove(d, s, k)

    monkeypatch.setattr(copier, "move", move)
    monkeypatch.setattr(backend_mod, "copy_runs", copy_runs)

    def ensure_gpu(self: backend_mod.CudaIpcBackend) -> None:
        self._copier = copier
        self._stream = types.SimpleNamespace(cuda_stream=77)

    monkeypatch.setattr(backend_mod.CudaIpcBackend, "_ensure_gpu", ensure_gpu)
    _HostEvent.gate.set()
    rng = np.random.default_rng(11)
    for opts, want_engine in (
        ({"copy_engine_min_bytes": mib}, True),
        ({"copy_engine_min_bytes": 0}, False),
    ):
        cfg = KVWireConfig(transfer_backend="cudaipc", transfer_backend_options=opts)
        a = create_backend(cfg, "prefill", need=())
        b = create_backend(cfg, "decode", need=())
        try:
            av = rng.integers(0, 256, 4 * mib, dtype=np.uint8)
            bv = np.zeros(4 * mib, np.uint8)

            def vram(x: np.ndarray) -> MemoryRegion:
                return MemoryRegion.from_pointer(x.ctypes.data, x.nbytes, mib, MemKind.VRAM, 0)

            a.register([vram(av)])
            b.register([vram(bv)])
            peer = a.add_peer(b.local_metadata())
            # four 1 MiB rows, adjacent on both sides (one 4 MiB run once merged), then four
            # 1 MiB blocks out of order (four runs), then 1 KiB rows
            rows = make_table(av.ctypes.data + np.arange(4) * mib, mib)
            drows = make_table(bv.ctypes.data + np.arange(4) * mib, mib)
            big = a.prepare(peer, rows, drows)
            small = a.prepare(
                peer,
                make_table(av.ctypes.data + np.arange(64) * 1024, 1024),
                make_table(bv.ctypes.data + np.arange(64) * 1024, 1024),
            )
            engine.clear()
            moved.clear()
            blocks = av.reshape(4, mib)
            _done(a, a.submit(XferOp.WRITE, big, np.arange(4), np.arange(4)))
            assert np.array_equal(bv, av)
            bv[:] = 0
            _done(a, a.submit(XferOp.WRITE, big, np.arange(4), np.arange(4)[::-1].copy()))
            assert np.array_equal(bv.reshape(4, mib), blocks[::-1])  # every block landed
            bv[:] = 0
            shuffled = np.random.default_rng(1).permutation(64)
            _done(a, a.submit(XferOp.WRITE, small, np.arange(64), shuffled))
            got = bv[: 64 * 1024].reshape(64, 1024)
            assert np.array_equal(got[shuffled], av[: 64 * 1024].reshape(64, 1024))
            assert not bv[64 * 1024 :].any()
            if want_engine:
                assert engine == [([4 * mib], 77), ([mib] * 4, 77)] and moved == [64]
            else:
                assert engine == [] and moved == [4, 4, 64]
        finally:
            a.close()
            b.close()
