"""Conformance suite for transfer backends (and the core index mappers), for pytest.

A backend plugin runs the suite against itself with a test file of a few lines::

    from kvwire.testing.conformance import BackendConformance, MapperConformance

    class TestMyConformance(BackendConformance):
        backend_name = "my-backend"          # the name the plugin registers
        backend_options = {}                 # options for its options model
        # optional: options that make a dead peer fail fast (default: derived, see below)
        fast_failure_options = {"transfer_timeout_s": 2.0}

    class TestMyMappers(MapperConformance):  # optional: core mappers' tables through it
        backend_name = "my-backend"
        backend_options = {}

Transfers cross a real process boundary: the test process holds a *local* agent (created
with :func:`kvwire.selection.create_backend`), and a :class:`~kvwire.testing.remote.RemoteAgent`
runs the *target* agent in a spawned child. Both are class-scoped, so a class spawns one
target (plus one short-lived victim for the peer-death test). ``backend_options`` must let
several agents run on one host (e.g. no fixed port). Tests that need a capability the
backend does not declare (``read``, ``notifications``) are skipped and say why.

Optional class attributes: ``fast_failure_options`` (extra options for the peer-death test;
``None`` derives ``{"transfer_timeout_s": 2.0}`` when the options model has that field),
``peer_failure_timeout_s`` (how long a transfer to a killed peer may stay PENDING),
``one_sided_writes`` (True if a WRITE can complete without the target's CPU, as with RDMA:
then a transfer that finished before the peer was killed skips that test instead of failing
it), ``large_transfer_bytes``, ``many_rows``/``many_row_bytes``, ``transfer_timeout_s``
(bound for an ordinary transfer) and ``close_timeout_s`` (bound for ``close()``).

What each test of :class:`BackendConformance` proves:

* ``test_capabilities_and_options``: the class declares a name, ``BackendCapabilities`` and an
  options model that accepts ``backend_options``.
* ``test_register_deregister``: regions can be registered and deregistered; overlapping
  regions (with a registered one, or within one call) are refused with ``LayoutError`` and
  leave the registry unchanged; a deregistered region can no longer be prepared.
* ``test_handle_lifecycle``: prepare/submit/poll/release: ``poll`` returns ``XferState``
  members (never strings or ints), DONE is sticky, a second ``release`` and a ``poll`` after
  release raise ``HandleError``, a released pair cannot be submitted or released again, and
  ``live_handles``/``live_prepared`` return to their baseline.
* ``test_write_random_index_sets``: WRITE of identity, reversed, random permutations,
  random subsets, repeated source rows, single rows and contiguous runs, with fresh random
  data each round: every byte of the target buffer equals a local model, including the gaps
  between rows that must stay untouched.
* ``test_write_mixed_row_lengths``: rows of 1 B to 40 KB, matched within length classes, and
  a round whose rows are contiguous on both sides (mergeable): byte-exact target.
* ``test_read_random_index_sets``: the same for READ into local memory; the remote source is
  not modified.
* ``test_notification_after_data_exactly_once``: each notification arrives once, from the
  initiator, and the target's buffer digest taken when it was drained equals the expected
  final content (the data landed first); nothing more arrives afterwards.
* ``test_concurrent_notifications_exactly_once``: several transfers in flight at once each
  deliver their notification exactly once, and all their data is in place.
* ``test_concurrent_submitters``: four worker threads each submit and poll their own WRITEs
  (disjoint local and remote rows, one shared prepared pair, a notification each) to the same
  peer while a progress thread calls ``progress``/``get_notifications`` and a handshake
  thread prepares and releases a second pair for that peer: every round's bytes are verified
  as soon as it is DONE and the whole span at the end, each notification arrives exactly
  once, and ``live_handles``/``live_prepared`` return to their baseline.
* ``test_notification_after_large_transfer``: the notification of a large (multi-part, for
  engines that split) WRITE is delivered only once all of its bytes are in place.
* ``test_large_single_descriptor``: one ``large_transfer_bytes`` row (64 MiB) WRITE (and
  READ) arrives intact and the guard bytes around it are untouched.
* ``test_many_descriptors``: 8192 non-contiguous 512 B rows, permuted, WRITE (and READ):
  byte-exact over the whole span, gaps included.
* ``test_out_of_region_refused``: remote rows reaching into unregistered guard bytes are
  refused (``DescriptorError`` at prepare, or the transfer ends FAILED with an error); the
  target buffer, guards included, is unchanged. Local rows outside local registrations are
  refused at prepare.
* ``test_malformed_requests_refused``: tables of the wrong type, dtype or shape, empty
  tables, zero-length rows, and index arrays out of range, of different lengths, of the
  wrong dtype or rank, empty, or pairing rows of different lengths raise
  ``DescriptorError``; nothing is written and no handle leaks.
* ``test_peer_removal``: a transfer pending at ``remove_peer`` ends promptly, the old pair
  can no longer be submitted, the removed peer cannot be prepared, and adding it again makes
  transfers work.
* ``test_initiator_in_child``: the child initiates WRITE (and READ) to the test process's
  agent: the other direction works, and the local agent's notification arrives after data.
* ``test_close_with_transfers_in_flight``: ``close()`` with several large transfers in
  flight returns within ``close_timeout_s``; handles then poll DONE or FAILED and release
  cleanly; submitting after close raises; the target is still healthy.
* ``test_peer_killed_mid_transfer``: a transfer to a peer SIGKILLed (after SIGSTOP, so the
  transfer is surely pending) ends FAILED with an error within ``peer_failure_timeout_s``;
  the dead peer can be removed and the agent closed promptly.

:class:`MapperConformance` (``test_tables_and_chunks``) checks, for EqualTPMapper, MLAMapper
and HeadSliceMapper on several layout pairs (equal TP, gather, scatter, GQA replication, MLA
dummy senders): tables are ``N x 3`` ``uint64`` inside the layouts' buffers; chunk index
arrays are ``int64``, in range and of equal length; paired rows have equal lengths, join the
same layer and K/V and pair ``src_pages[i]`` with ``dst_pages[i]``; destination rows do not
overlap; the byte count is right; malformed page lists raise ``DescriptorError``. Then
(``test_chunk_transfer``) chunks mapped by each kind of mapper go through the backend across
the two processes and every destination byte is checked
against a model built from head ranges, not from the tables.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pytest
from numpy.typing import NDArray

from kvwire.backend import (
    BackendCapabilities,
    PreparedPair,
    TransferBackend,
    TransferHandle,
    XferOp,
    XferState,
)
from kvwire.config import KVWireConfig
from kvwire.descriptors import ADDR, LEN, DescTable, check_table, make_table, outside_regions
from kvwire.errors import DescriptorError, HandleError, KVWireError, LayoutError, PeerError
from kvwire.index import EqualTPMapper, HeadSliceMapper, IndexMapper, MLAMapper
from kvwire.layout import DTYPE_SIZES, KVLayout, MemoryRegion, ModelSpec, RankPosition
from kvwire.selection import create_backend, select_backend
from kvwire.testing.remote import (
    RemoteAgent,
    RemoteAgentError,
    RemoteBuffer,
    digest,
    fill_bytes,
    sampled_digest,
)

__all__ = ["BackendConformance", "MapperCase", "MapperConformance", "wait_terminal"]

KiB, MiB = 1 << 10, 1 << 20
GUARD = 4 * KiB
SMALL = 256 * KiB
NOTIFY_BYTES = 64 * KiB
SINK_BYTES = 16 * MiB
MIXED_SPAN = 8 * MiB


# ------------------------------------------------------------------------------ helpers
def _check_state(state: object, where: str = "poll()") -> XferState:
    assert type(state) is XferState, (
        f"{where} returned {state!r} of type {type(state).__name__}; it must return an "
        "XferState member (PENDING, DONE or FAILED)"
    )
    return state


def wait_terminal(backend: TransferBackend, handle: TransferHandle, timeout: float) -> XferState:
    """Poll ``handle`` (driving ``progress()``) until DONE or FAILED; fail the test after
    ``timeout`` seconds of PENDING."""
    deadline = time.monotonic() + timeout
    while True:
        backend.progress()
        state = _check_state(backend.poll(handle))
        if state is not XferState.PENDING:
            return state
        if time.monotonic() >= deadline:
            pytest.fail(
                f"{handle.op.name} of {handle.num_descs} rows ({handle.num_bytes} B) to "
                f"{handle.peer!r} still PENDING after {timeout:g}s"
            )
        time.sleep(0.0005)


def _assert_bytes_equal(actual: NDArray[np.uint8], expected: NDArray[np.uint8], what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: {actual.size} bytes, expected {expected.size}"
    bad = np.flatnonzero(actual != expected)
    assert bad.size == 0, (
        f"{what}: {bad.size} of {expected.size} bytes differ from the model "
        f"(first at offsets {bad[:8].tolist()})"
    )


def _apply_rows(
    model: NDArray[np.uint8],
    model_off: NDArray[np.int64],
    source: NDArray[np.uint8],
    source_off: NDArray[np.int64],
    lens: NDArray[np.int64],
) -> None:
    """Apply row copies ``source[source_off] -> model[model_off]`` in order (a local model)."""
    for d, s, n in zip(model_off.tolist(), source_off.tolist(), lens.tolist(), strict=True):
        model[d : d + n] = source[s : s + n]


def _addr(arr: NDArray[Any]) -> int:
    return int(arr.ctypes.data)


def _table(base: int, offsets: Any, lens: Any) -> DescTable:
    return make_table(np.asarray(offsets, dtype=np.uint64) + np.uint64(base), lens)


def _randomize(arr: NDArray[np.uint8], rng: np.random.Generator) -> None:
    arr[:] = np.frombuffer(rng.bytes(arr.size), dtype=np.uint8)


def _index_rounds(rng: np.random.Generator, rows: int) -> list[tuple[str, Any, Any]]:
    """Index-array pairs (local, remote) covering the shapes a control plane submits."""
    k = rows // 3
    start = int(rng.integers(0, rows - k))
    other = int(rng.integers(0, rows - k))
    rounds: list[tuple[str, Any, Any]] = [
        ("identity", np.arange(rows), np.arange(rows)),
        ("reversed", np.arange(rows), np.arange(rows)[::-1].copy()),
        ("single row", [int(rng.integers(rows))], [int(rng.integers(rows))]),
        ("contiguous runs", np.arange(start, start + k), np.arange(other, other + k)),
        ("python lists", list(range(5)), [rows - 1, 0, 7, 3, 9]),
    ]
    for i in range(3):
        rounds.append((f"permutation {i}", rng.permutation(rows), rng.permutation(rows)))
    for i in range(3):
        n = int(rng.integers(1, rows))
        rounds.append(
            (
                f"subset {i}",
                rng.choice(rows, n, replace=False),
                rng.choice(rows, n, replace=False),
            )
        )
    n = int(rng.integers(2, rows))
    rounds.append(
        ("repeated source rows", rng.integers(0, 4, n), rng.choice(rows, n, replace=False))
    )
    rounds.append(
        (
            "int32 indices",
            np.arange(rows, dtype=np.int32)[::2],
            np.arange(rows // 2, dtype=np.int32),
        )
    )
    return rounds


@dataclass
class _Env:
    """Class-scoped state of :class:`BackendConformance`."""

    backend_name: str
    options: dict[str, Any]
    cls: type[TransferBackend]
    local: TransferBackend
    remote: RemoteAgent
    peer: str
    lbuf: dict[str, NDArray[np.uint8]]
    rbuf: dict[str, RemoteBuffer]
    timeout: float
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(20240611))

    @property
    def caps(self) -> BackendCapabilities:
        return self.cls.capabilities

    def need(self, capability: str) -> None:
        if not getattr(self.caps, capability):
            pytest.skip(f"{self.backend_name} does not declare {capability.upper()} capability")

    @contextlib.contextmanager
    def prepared(self, local_table: DescTable, remote_table: DescTable) -> Iterator[PreparedPair]:
        pair = self.local.prepare(self.peer, local_table, remote_table)
        try:
            yield pair
        finally:
            if not pair.released:
                self.local.release_prepared(pair)

    def run(
        self,
        op: XferOp,
        pair: PreparedPair,
        local_idx: Any,
        remote_idx: Any,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Submit, wait for DONE (asserted), release."""
        handle = self.local.submit(op, pair, local_idx, remote_idx, notification)
        state = wait_terminal(self.local, handle, self.timeout)
        assert state is XferState.DONE, (
            f"{op.name} of {handle.num_descs} rows ({handle.num_bytes} B) ended {state.name}: "
            f"{handle.error}"
        )
        self.local.release(handle)
        return handle

    def remote_region(self, name: str) -> MemoryRegion:
        region = self.rbuf[name].region
        assert region is not None
        return region

    def roundtrip_check(self) -> None:
        """A small verified WRITE to the target: the agents still work."""
        self.need("write")
        probe = self.lbuf["probe"]
        _randomize(probe, self.rng)
        check = self.rbuf["check"]
        rows = probe.size // 64
        with self.prepared(
            _table(_addr(probe), np.arange(rows) * 64, 64),
            _table(check.addr, np.arange(rows) * 64, 64),
        ) as pair:
            perm = self.rng.permutation(rows)
            self.run(XferOp.WRITE, pair, np.arange(rows), perm)
        expected = np.empty_like(probe)
        for i, r in enumerate(perm.tolist()):
            expected[r * 64 : r * 64 + 64] = probe[i * 64 : i * 64 + 64]
        _assert_bytes_equal(self.remote.read_array("check"), expected, "round-trip check")


def _config(name: str, options: dict[str, Any]) -> KVWireConfig:
    return KVWireConfig(transfer_backend=name, transfer_backend_options=options)


def _backend_class(name: str, options: dict[str, Any]) -> type[TransferBackend]:
    cls: type[TransferBackend] = select_backend(_config(name, options), need=()).cls
    return cls


def _new_backend(name: str, options: dict[str, Any], role: str) -> TransferBackend:
    agent = f"conf-{role}-{uuid.uuid4().hex[:8]}"
    return create_backend(_config(name, options), agent, need=())


# -------------------------------------------------------------------- backend suite
class BackendConformance:
    """Conformance tests every transfer backend must pass; subclass as ``Test...``."""

    backend_name: ClassVar[str] = ""
    backend_options: ClassVar[dict[str, Any]] = {}
    fast_failure_options: ClassVar[dict[str, Any] | None] = None
    peer_failure_timeout_s: ClassVar[float] = 30.0
    one_sided_writes: ClassVar[bool] = False
    large_transfer_bytes: ClassVar[int] = 64 * MiB
    many_rows: ClassVar[int] = 8192
    many_row_bytes: ClassVar[int] = 512
    transfer_timeout_s: ClassVar[float] = 60.0
    close_timeout_s: ClassVar[float] = 5.0

    # -------------------------------------------------------------------- fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def env(cls) -> Iterator[_Env]:
        cfg = cls
        name, options = cfg.backend_name, dict(cfg.backend_options)
        if not name:
            pytest.fail(f"{cfg.__name__} must set backend_name")
        backend_cls = _backend_class(name, options)
        if not backend_cls.capabilities.dram:
            pytest.skip(f"{name} does not declare DRAM capability (the suite uses host buffers)")
        remote = RemoteAgent(name, options, f"conf-target-{uuid.uuid4().hex[:8]}").start()
        local: TransferBackend | None = None
        try:
            local = _new_backend(name, options, "local")
            big = max(cfg.large_transfer_bytes, 2 * cfg.many_rows * cfg.many_row_bytes, MIXED_SPAN)
            rng = np.random.default_rng(7)
            lbuf = {
                "src": fill_bytes(SMALL, 1),
                "rdst": fill_bytes(SMALL, 2),
                "inbox": fill_bytes(SMALL, 3),
                "probe": fill_bytes(4 * KiB, 4),
                "big_src": np.frombuffer(bytearray(rng.bytes(big + 2 * GUARD)), dtype=np.uint8),
                "big_dst": fill_bytes(big + 2 * GUARD, b"\xa5\x5a"),
            }
            local.register([MemoryRegion.from_tensor(a) for a in lbuf.values()])
            rbuf = {
                "dst": remote.allocate("dst", SMALL, fill=11, watch=False),
                "rsrc": remote.allocate("rsrc", SMALL, fill=12, watch=False),
                "notify": remote.allocate("notify", NOTIFY_BYTES, fill=13, watch=True),
                "check": remote.allocate("check", 4 * KiB, fill=14, watch=False),
                "guarded": remote.allocate(
                    "guarded",
                    3 * GUARD,
                    fill=b"guard!",
                    region_offset=GUARD,
                    region_length=GUARD,
                    watch=False,
                ),
                "big": remote.allocate("big", big + 2 * GUARD, fill=15, watch=False),
                "sink": remote.allocate("sink", SINK_BYTES, watch=False),
            }
            peer = local.add_peer(remote.metadata())
            yield _Env(
                name, options, backend_cls, local, remote, peer, lbuf, rbuf, cfg.transfer_timeout_s
            )
        finally:
            if local is not None:
                local.close()
            remote.close()

    # ----------------------------------------------------------------------- tests
    def test_capabilities_and_options(self, env: _Env) -> None:
        assert isinstance(env.cls.name, str) and env.cls.name, "backend must set a name"
        assert isinstance(env.cls.capabilities, BackendCapabilities)
        assert env.caps.write or env.caps.read, "a backend must support WRITE or READ"
        opts = env.cls.options_model.model_validate(env.options)
        assert isinstance(env.local.options, env.cls.options_model)
        assert env.local.options == opts
        assert env.remote.info["capabilities"] == env.caps.model_dump()

    def test_register_deregister(self, env: _Env) -> None:
        b = env.local
        arr = np.zeros(64 * KiB, dtype=np.uint8)
        region = MemoryRegion.from_tensor(arr)
        before = b.registered_regions
        b.register([region])
        try:
            assert b.registered_regions == [*before, region]
            overlapping = [
                MemoryRegion.from_pointer(region.addr + 4096, 4096, 1),  # inside
                MemoryRegion.from_pointer(region.addr, region.length, 1),  # identical
                MemoryRegion.from_pointer(region.end - 16, 32, 1),  # straddles the end
            ]
            for r in overlapping:
                with pytest.raises(LayoutError):
                    b.register([r])
                assert b.registered_regions == [*before, region], "refused register changed state"
            # A row inside the new region can be prepared.
            with env.prepared(_table(region.addr, [0], 64), _table(env.rbuf["dst"].addr, [0], 64)):
                pass
        finally:
            b.deregister([region])
        assert b.registered_regions == before
        with pytest.raises(DescriptorError):
            b.prepare(env.peer, _table(region.addr, [0], 64), _table(env.rbuf["dst"].addr, [0], 64))
        with pytest.raises(ValueError):
            b.deregister([region])
        # Two overlapping regions in one call are refused atomically.
        arr2 = np.zeros(8 * KiB, dtype=np.uint8)
        r2 = MemoryRegion.from_tensor(arr2)
        with pytest.raises(LayoutError):
            b.register([r2, MemoryRegion.from_pointer(r2.addr + 1024, 1024, 1)])
        assert b.registered_regions == before
        b.register([r2])  # and the same memory registers fine alone, and again after release
        b.deregister([r2])
        b.register([r2])
        b.deregister([r2])
        assert b.registered_regions == before

    def test_handle_lifecycle(self, env: _Env) -> None:
        env.need("write")
        b = env.local
        base_handles, base_prepared = b.live_handles, b.live_prepared
        src, dst = env.lbuf["src"], env.rbuf["dst"]
        _randomize(src[:4096], env.rng)
        pair = b.prepare(
            env.peer, _table(_addr(src), [0, 1024], 1024), _table(dst.addr, [2048, 0], 1024)
        )
        assert isinstance(pair, PreparedPair)
        assert b.live_prepared == base_prepared + 1
        handle = b.submit(XferOp.WRITE, pair, [1], [0])
        assert isinstance(handle, TransferHandle)
        assert (handle.num_descs, handle.num_bytes, handle.op) == (1, 1024, XferOp.WRITE)
        assert b.live_handles == base_handles + 1
        _check_state(b.poll(handle))
        state = wait_terminal(b, handle, env.timeout)
        assert state is XferState.DONE, f"transfer ended {state.name}: {handle.error}"
        assert _check_state(b.poll(handle)) is XferState.DONE, "DONE must be sticky"
        assert env.remote.read("dst", 2048, 1024) == src[1024:2048].tobytes()
        b.release(handle)
        assert b.live_handles == base_handles
        with pytest.raises(HandleError):
            b.release(handle)
        with pytest.raises(HandleError):
            b.poll(handle)
        b.release_prepared(pair)
        assert b.live_prepared == base_prepared
        with pytest.raises(HandleError):
            b.release_prepared(pair)
        with pytest.raises(HandleError):
            b.submit(XferOp.WRITE, pair, [0], [0])
        assert b.live_handles == base_handles

    def test_write_random_index_sets(self, env: _Env) -> None:
        env.need("write")
        src, dst = env.lbuf["src"], env.rbuf["dst"]
        rows, row, stride = 512, 256, 512
        # Local rows back to back, remote rows with gaps: rows adjacent on one side only
        # must not be merged, and the gaps must stay untouched.
        loff = np.arange(rows, dtype=np.int64) * row
        roff = np.arange(rows, dtype=np.int64) * stride + 96
        model = env.remote.read_array("dst")
        with env.prepared(_table(_addr(src), loff, row), _table(dst.addr, roff, row)) as pair:
            for what, li, ri in _index_rounds(env.rng, rows):
                _randomize(src, env.rng)
                la, ra = np.asarray(li, dtype=np.int64), np.asarray(ri, dtype=np.int64)
                _apply_rows(model, roff[ra], src, loff[la], np.full(la.size, row))
                handle = env.run(XferOp.WRITE, pair, li, ri)
                assert handle.num_descs == la.size and handle.num_bytes == la.size * row
                _assert_bytes_equal(env.remote.read_array("dst"), model, f"WRITE {what}")

    def test_write_mixed_row_lengths(self, env: _Env) -> None:
        env.need("write")
        src, dst = env.lbuf["big_src"], env.rbuf["big"]
        rng = env.rng
        lens = rng.choice(np.array([1, 3, 64, 500, 4096, 40_000]), 300)

        def pack(order: NDArray[np.int64]) -> NDArray[np.int64]:
            gaps = rng.choice(np.array([0, 0, 8, 100]), lens.size)
            off = np.empty(lens.size, dtype=np.int64)
            off[order] = np.cumsum(lens[order] + gaps) - lens[order]
            return off

        loff = pack(np.arange(lens.size))
        roff = pack(rng.permutation(lens.size))
        assert max(loff.max(), roff.max()) + lens.max() <= MIXED_SPAN
        model = env.remote.read_array("big", 0, MIXED_SPAN)
        with env.prepared(_table(_addr(src), loff, lens), _table(dst.addr, roff, lens)) as pair:
            # Random matching of rows within each length class, in random order.
            li, ri = [], []
            for n in np.unique(lens):
                rows = np.flatnonzero(lens == n)
                li.append(rng.permutation(rows))
                ri.append(rng.permutation(rows))
            perm = rng.permutation(lens.size)
            la, ra = np.concatenate(li)[perm], np.concatenate(ri)[perm]
            _randomize(src[:MIXED_SPAN], rng)
            _apply_rows(model, roff[ra], src, loff[la], lens[la])
            env.run(XferOp.WRITE, pair, la, ra)
            _assert_bytes_equal(
                env.remote.read_array("big", 0, MIXED_SPAN), model, "WRITE of mixed row lengths"
            )
        # Rows contiguous on both sides (a backend may merge them): same offsets both sides.
        with env.prepared(_table(_addr(src), loff, lens), _table(dst.addr, loff, lens)) as pair:
            _randomize(src[:MIXED_SPAN], rng)
            idx = np.arange(lens.size)
            _apply_rows(model, loff, src, loff, lens)
            env.run(XferOp.WRITE, pair, idx, idx)
            _assert_bytes_equal(
                env.remote.read_array("big", 0, MIXED_SPAN), model, "WRITE of contiguous rows"
            )

    def test_read_random_index_sets(self, env: _Env) -> None:
        env.need("read")
        rdst, rsrc = env.lbuf["rdst"], env.rbuf["rsrc"]
        rows, row, stride = 512, 256, 512
        loff = np.arange(rows, dtype=np.int64) * stride + 32  # gaps locally,
        roff = np.arange(rows, dtype=np.int64) * row + 200  # back to back remotely
        source = env.remote.read_array("rsrc")
        source_digest = digest(source)
        model = rdst.copy()
        with env.prepared(_table(_addr(rdst), loff, row), _table(rsrc.addr, roff, row)) as pair:
            for what, li, ri in _index_rounds(env.rng, rows):
                la, ra = np.asarray(li, dtype=np.int64), np.asarray(ri, dtype=np.int64)
                _apply_rows(model, loff[la], source, roff[ra], np.full(la.size, row))
                env.run(XferOp.READ, pair, li, ri)
                _assert_bytes_equal(rdst, model, f"READ {what}")
        assert env.remote.digest("rsrc") == source_digest, "READ modified the remote source"

    def test_notification_after_data_exactly_once(self, env: _Env) -> None:
        env.need("write")
        env.need("notifications")
        src, note_buf = env.lbuf["src"], env.rbuf["notify"]
        rows, row = NOTIFY_BYTES // 128, 128
        offs = np.arange(rows, dtype=np.int64) * row
        env.remote.notifications(timeout=0)  # drop anything unrelated
        model = env.remote.read_array("notify")
        with env.prepared(_table(_addr(src), offs, row), _table(note_buf.addr, offs, row)) as pair:
            for rnd in range(5):
                _randomize(src, env.rng)
                n = int(env.rng.integers(1, rows))
                li = env.rng.choice(rows, n, replace=False)
                ri = env.rng.choice(rows, n, replace=False)
                _apply_rows(model, offs[ri], src, offs[li], np.full(n, row))
                payload = f"conformance-{rnd}-{uuid.uuid4().hex}".encode()
                env.run(XferOp.WRITE, pair, li, ri, notification=payload)
                notes = env.remote.notifications(
                    timeout=env.timeout, expect=1, progress=env.local.progress
                )
                assert [n.payload for n in notes] == [payload], (
                    f"round {rnd}: expected exactly this notification, got {notes!r}"
                )
                assert notes[0].peer == env.local.agent_name, (
                    f"notification names peer {notes[0].peer!r}, expected the initiator "
                    f"{env.local.agent_name!r}"
                )
                assert notes[0].digests["notify"] == digest(model), (
                    f"round {rnd}: the notification was delivered before all its data landed"
                )
        extra = env.remote.notifications(timeout=0.3, progress=env.local.progress)
        assert extra == [], f"notifications delivered more than once: {extra!r}"
        _assert_bytes_equal(env.remote.read_array("notify"), model, "notify buffer")

    def test_concurrent_notifications_exactly_once(self, env: _Env) -> None:
        env.need("write")
        env.need("notifications")
        src, note_buf = env.lbuf["src"], env.rbuf["notify"]
        rows, row, count = NOTIFY_BYTES // 128, 128, 8
        offs = np.arange(rows, dtype=np.int64) * row
        env.remote.notifications(timeout=0)
        model = env.remote.read_array("notify")
        _randomize(src, env.rng)
        targets = np.array_split(env.rng.permutation(rows), count)  # disjoint row sets
        payloads = [f"concurrent-{i}-{uuid.uuid4().hex}".encode() for i in range(count)]
        with env.prepared(_table(_addr(src), offs, row), _table(note_buf.addr, offs, row)) as pair:
            handles = []
            for ri, payload in zip(targets, payloads, strict=True):
                li = env.rng.choice(rows, ri.size, replace=False)
                _apply_rows(model, offs[ri], src, offs[li], np.full(ri.size, row))
                handles.append(env.local.submit(XferOp.WRITE, pair, li, ri, payload))
            for h in handles:
                state = wait_terminal(env.local, h, env.timeout)
                assert state is XferState.DONE, f"ended {state.name}: {h.error}"
                env.local.release(h)
        notes = env.remote.notifications(
            timeout=env.timeout, expect=count, progress=env.local.progress
        )
        notes += env.remote.notifications(timeout=0.3, progress=env.local.progress)
        counts = collections.Counter(n.payload for n in notes)
        assert counts == collections.Counter(payloads), (
            f"each notification must arrive exactly once; got {dict(counts)}"
        )
        assert notes[-1].digests["notify"] == digest(model), (
            "the last notification was delivered before all data landed"
        )

    def test_concurrent_submitters(self, env: _Env) -> None:
        env.need("write")
        b = env.local
        threads_n, rounds, rows, row = 4, 6, 128, 2048
        block = rows * row
        span = threads_n * rounds * block
        src, big = env.lbuf["big_src"], env.rbuf["big"]
        assert span <= big.nbytes and threads_n * block <= src.size
        base_handles, base_prepared = b.live_handles, b.live_prepared
        rng = env.rng
        # Remote rows: one block per (thread, round), rows shuffled within the block.
        order = [rng.permutation(rows) for _ in range(threads_n * rounds)]
        roff = np.concatenate([i * block + o * row for i, o in enumerate(order)])
        loff = np.arange(threads_n * rows, dtype=np.int64) * row
        local_rows = src[: threads_n * block].reshape(-1, row)  # a view: row i of the pair
        model = env.remote.read_array("big", 0, span)
        env.remote.notifications(timeout=0)
        stop = threading.Event()
        errors: list[BaseException] = []
        payloads: list[bytes] = []
        prepared_again = [0]
        lock = threading.Lock()

        def worker(k: int, pair: PreparedPair) -> None:
            wrng = np.random.default_rng(1000 + k)
            mine = src[k * block : (k + 1) * block]
            try:
                for j in range(rounds):
                    blk = k * rounds + j
                    _randomize(mine, wrng)
                    li = k * rows + wrng.permutation(rows)
                    ri = blk * rows + np.arange(rows)
                    expected = np.empty(block, dtype=np.uint8)
                    expected.reshape(rows, row)[order[blk]] = local_rows[li]
                    payload = f"mt-{k}-{j}-{uuid.uuid4().hex}".encode()
                    handle = b.submit(XferOp.WRITE, pair, li, ri, payload)
                    deadline = time.monotonic() + env.timeout
                    while (state := _check_state(b.poll(handle))) is XferState.PENDING:
                        assert time.monotonic() < deadline, f"thread {k} round {j} stuck"
                        time.sleep(0.0002)
                    assert state is XferState.DONE, f"thread {k} round {j}: {handle.error}"
                    b.release(handle)
                    with lock:
                        payloads.append(payload)
                        model[blk * block : (blk + 1) * block] = expected
                    got = env.remote.digest("big", blk * block, block)
                    assert got == digest(expected), f"thread {k} round {j}: bytes differ"
            except BaseException as exc:
                errors.append(exc)

        def owner() -> None:  # the session manager's progress thread
            try:
                while not stop.is_set():
                    b.progress()
                    b.get_notifications()
                    time.sleep(0.0005)
            except BaseException as exc:
                errors.append(exc)

        def handshake() -> None:  # another peer's handshake preparing its tables meanwhile
            other_l = _table(_addr(env.lbuf["src"]), np.arange(256) * 512, 512)
            other_r = _table(env.rbuf["dst"].addr, np.arange(256)[::-1] * 512, 512)
            try:
                while not stop.is_set():
                    pair = b.prepare(env.peer, other_l, other_r)
                    assert env.peer in b.peers()
                    b.release_prepared(pair)
                    prepared_again[0] += 1
                    time.sleep(0.002)
            except BaseException as exc:
                errors.append(exc)

        t0 = time.monotonic()
        with env.prepared(_table(_addr(src), loff, row), _table(big.addr, roff, row)) as pair:
            workers = [
                threading.Thread(target=worker, args=(k, pair), name=f"conformance-worker-{k}")
                for k in range(threads_n)
            ]
            helpers = [threading.Thread(target=owner), threading.Thread(target=handshake)]
            for t in helpers + workers:
                t.start()
            try:
                for t in workers:
                    t.join(max(0.1, t0 + env.timeout - time.monotonic()))
            finally:
                stop.set()
                for t in helpers:
                    t.join(env.timeout)
            alive = [t.name for t in workers + helpers if t.is_alive()]
            assert not alive, f"threads still running after {env.timeout:g}s: {alive}"
        if errors:
            raise errors[0]
        assert prepared_again[0] > 0, "the handshake thread never prepared a pair"
        assert len(payloads) == threads_n * rounds
        notes = env.remote.notifications(
            timeout=env.timeout, expect=len(payloads), progress=b.progress
        )
        notes += env.remote.notifications(timeout=0.3, progress=b.progress)
        counts = collections.Counter(n.payload for n in notes)
        assert counts == collections.Counter(payloads), (
            f"each notification must arrive exactly once; got {sum(counts.values())} for "
            f"{len(payloads)} transfers, duplicated: {[p for p, c in counts.items() if c > 1]}"
        )
        _assert_bytes_equal(env.remote.read_array("big", 0, span), model, "concurrent WRITEs")
        assert b.live_handles == base_handles, "concurrent submitters leaked handles"
        assert b.live_prepared == base_prepared, "concurrent prepares leaked pairs"

    def test_large_single_descriptor(self, env: _Env) -> None:
        env.need("write")
        n = type(self).large_transfer_bytes
        src, big = env.lbuf["big_src"], env.rbuf["big"]
        _randomize(src[GUARD : GUARD + n], env.rng)
        head, tail = env.remote.digest("big", 0, GUARD), env.remote.digest("big", GUARD + n)
        with env.prepared(_table(_addr(src), [GUARD], n), _table(big.addr, [GUARD], n)) as pair:
            handle = env.run(XferOp.WRITE, pair, [0], [0])
        assert handle.num_bytes == n
        assert env.remote.digest("big", GUARD, n) == digest(src[GUARD : GUARD + n]), (
            f"a {n} B WRITE did not arrive intact"
        )
        assert env.remote.digest("big", 0, GUARD) == head, "bytes before the row changed"
        assert env.remote.digest("big", GUARD + n) == tail, "bytes after the row changed"
        if not env.caps.read:
            return
        dst = env.lbuf["big_dst"]
        expected = env.remote.digest("big", GUARD, n)
        guards = digest(dst[:GUARD]), digest(dst[GUARD + n :])
        with env.prepared(_table(_addr(dst), [GUARD], n), _table(big.addr, [GUARD], n)) as pair:
            env.run(XferOp.READ, pair, [0], [0])
        assert digest(dst[GUARD : GUARD + n]) == expected, f"a {n} B READ did not arrive intact"
        assert (digest(dst[:GUARD]), digest(dst[GUARD + n :])) == guards, "READ touched guards"

    def test_notification_after_large_transfer(self, env: _Env) -> None:
        env.need("write")
        env.need("notifications")
        n = type(self).large_transfer_bytes
        src, big = env.lbuf["big_src"], env.rbuf["big"]
        _randomize(src[GUARD : GUARD + n], env.rng)
        env.remote.notifications(timeout=0)
        stride = 4096  # sample every page: a copy that takes microseconds, not a full hash
        env.remote.watch("big", True, GUARD, n, stride=stride)
        payload = f"large-{uuid.uuid4().hex}".encode()
        try:
            with env.prepared(_table(_addr(src), [GUARD], n), _table(big.addr, [GUARD], n)) as p:
                env.run(XferOp.WRITE, p, [0], [0], notification=payload)
            notes = env.remote.notifications(
                timeout=env.timeout, expect=1, progress=env.local.progress
            )
        finally:
            env.remote.watch("big", False)
        assert [n.payload for n in notes] == [payload]
        assert notes[0].digests["big"] == sampled_digest(src[GUARD : GUARD + n], stride), (
            f"the notification of a {n} B WRITE was delivered before all of its data landed"
        )

    def test_many_descriptors(self, env: _Env) -> None:
        env.need("write")
        rows, row = type(self).many_rows, type(self).many_row_bytes
        stride, span = 2 * row, 2 * row * rows
        src, big = env.lbuf["big_src"], env.rbuf["big"]
        loff = np.arange(rows, dtype=np.int64) * stride
        roff = np.arange(rows, dtype=np.int64) * stride + row // 2
        perm = env.rng.permutation(rows)
        _randomize(src[:span], env.rng)
        model = env.remote.read_array("big", 0, span + row)
        _apply_rows(model, roff[perm], src, loff, np.full(rows, row))
        with env.prepared(_table(_addr(src), loff, row), _table(big.addr, roff, row)) as pair:
            handle = env.run(XferOp.WRITE, pair, np.arange(rows), perm)
        assert handle.num_descs == rows
        _assert_bytes_equal(
            env.remote.read_array("big", 0, span + row), model, f"WRITE of {rows} rows"
        )
        if not env.caps.read:
            return
        dst = env.lbuf["big_dst"]
        source = model
        lmodel = dst[: span + row].copy()
        perm = env.rng.permutation(rows)
        _apply_rows(lmodel, loff + row // 4, source, roff[perm], np.full(rows, row))
        with env.prepared(
            _table(_addr(dst), loff + row // 4, row), _table(big.addr, roff, row)
        ) as pair:
            env.run(XferOp.READ, pair, np.arange(rows), perm)
        _assert_bytes_equal(dst[: span + row], lmodel, f"READ of {rows} rows")

    def test_out_of_region_refused(self, env: _Env) -> None:
        env.need("write")
        src = env.lbuf["src"]
        guarded = env.rbuf["guarded"]
        region = env.remote_region("guarded")
        before = env.remote.read_array("guarded")
        cases = {
            "straddles the start": (region.addr - 64, 128),
            "straddles the end": (region.end - 64, 128),
            "inside the guard before": (guarded.addr, 512),
            "inside the guard after": (region.end + 100, 256),
            "covers region and guards": (guarded.addr, guarded.nbytes),
            "far outside": (region.addr + (1 << 40), 64),
        }
        for what, (addr, n) in cases.items():
            remote_table = make_table([addr], n)
            local_table = (
                _table(_addr(src), [0], n)
                if n <= src.size
                else make_table([_addr(env.lbuf["big_src"])], n)
            )
            try:
                pair = env.local.prepare(env.peer, local_table, remote_table)
            except DescriptorError:
                continue  # refused up front: the preferred outcome
            try:
                handle = env.local.submit(XferOp.WRITE, pair, [0], [0])
                state = wait_terminal(env.local, handle, env.timeout)
                assert state is XferState.FAILED, f"out-of-region WRITE ({what}) ended {state.name}"
                assert handle.error, f"FAILED handle ({what}) carries no error"
                env.local.release(handle)
            finally:
                env.local.release_prepared(pair)
        _assert_bytes_equal(env.remote.read_array("guarded"), before, "guarded target buffer")
        # Local rows outside this agent's registrations are always refused at prepare.
        stray = np.zeros(4096, dtype=np.uint8)
        with pytest.raises(DescriptorError):
            env.local.prepare(env.peer, _table(_addr(stray), [0], 64), _table(region.addr, [0], 64))

    def test_malformed_requests_refused(self, env: _Env) -> None:
        env.need("write")
        b = env.local
        src, dst = env.lbuf["src"], env.rbuf["dst"]
        good_l = _table(_addr(src), [0, 256, 512, 768], [256, 256, 256, 128])
        good_r = _table(dst.addr, [0, 256, 512, 768], 256)
        base_handles, base_prepared = b.live_handles, b.live_prepared
        before = env.remote.digest("dst")
        bad_tables: dict[str, Any] = {
            "int64 dtype": good_l.astype(np.int64),
            "float dtype": good_l.astype(np.float64),
            "shape (N, 2)": good_l[:, :2].copy(),
            "1-D": good_l[:, 0].copy(),
            "empty": np.empty((0, 3), dtype=np.uint64),
            "zero-length row": _table(_addr(src), [0, 256], [256, 0]),
            "python list": good_l.tolist(),
        }
        for table in bad_tables.values():
            with pytest.raises(DescriptorError):
                b.prepare(env.peer, table, good_r)
            with pytest.raises(DescriptorError):
                b.prepare(env.peer, good_l, table)
        bad_indices: dict[str, tuple[Any, Any]] = {
            "index past the end": ([4], [0]),
            "negative index": ([0], [-1]),
            "remote index past the end": ([0], [4]),
            "mismatched lengths": ([0, 1], [0]),
            "2-D indices": ([[0, 1]], [[0, 1]]),
            "float indices": (np.array([0.0]), np.array([1.0])),
            "empty indices": ([], []),
            "row lengths differ": ([3], [0]),
        }
        with env.prepared(good_l, good_r) as pair:
            for what, (li, ri) in bad_indices.items():
                with pytest.raises(DescriptorError):
                    b.submit(XferOp.WRITE, pair, li, ri)
                assert b.live_handles == base_handles, f"{what}: a refused submit leaked a handle"
        assert b.live_prepared == base_prepared
        assert env.remote.digest("dst") == before, "a refused request wrote to the target"

    def test_peer_removal(self, env: _Env) -> None:
        env.need("write")
        b = env.local
        src, sink = env.lbuf["big_src"], env.rbuf["sink"]
        pair = b.prepare(
            env.peer, _table(_addr(src), [0], SINK_BYTES), _table(sink.addr, [0], SINK_BYTES)
        )
        try:
            pending = b.submit(XferOp.WRITE, pair, [0], [0])
            t0 = time.monotonic()
            b.remove_peer(env.peer)
            assert env.peer not in b.peers()
            state = wait_terminal(b, pending, type(self).close_timeout_s)
            assert time.monotonic() - t0 < type(self).close_timeout_s
            if state is XferState.FAILED:
                assert pending.error, "a transfer failed by remove_peer carries no error"
            b.release(pending)
            assert pair.released, "remove_peer must invalidate the peer's prepared pairs"
            with pytest.raises((HandleError, PeerError)):
                b.submit(XferOp.WRITE, pair, [0], [0])
            with pytest.raises(PeerError):
                b.prepare(env.peer, _table(_addr(src), [0], 64), _table(sink.addr, [0], 64))
            with pytest.raises(PeerError):
                b.remove_peer(env.peer)
        finally:
            if env.peer not in b.peers():
                assert b.add_peer(env.remote.metadata()) == env.peer
        assert env.peer in b.peers()
        env.roundtrip_check()

    def test_initiator_in_child(self, env: _Env) -> None:
        remote, local = env.remote, env.local
        inbox, src = env.lbuf["inbox"], env.lbuf["src"]
        me = remote.add_peer(local.local_metadata())
        assert me == local.agent_name
        rows, row = SMALL // 512, 256
        offs = np.arange(rows, dtype=np.int64) * 512
        local.get_notifications()  # nothing expected; start clean
        if env.caps.write:
            rsrc = env.remote.read_array("rsrc")
            model = inbox.copy()
            perm = env.rng.permutation(rows)
            _apply_rows(model, offs[perm] + 128, rsrc, offs, np.full(rows, row))
            pair = remote.prepare(
                me, _table(env.rbuf["rsrc"].addr, offs, row), _table(_addr(inbox), offs + 128, row)
            )
            payload = f"from-child-{uuid.uuid4().hex}".encode()
            notify = payload if env.caps.notifications else None
            hid = remote.submit(XferOp.WRITE, pair, np.arange(rows), perm, notify)
            state, error = remote.wait(hid, env.timeout, progress=local.progress)
            assert state is XferState.DONE, f"child-initiated WRITE ended {state!r}: {error}"
            remote.release(hid)
            if notify is not None:
                got: list[Any] = []
                deadline = time.monotonic() + env.timeout
                while not got and time.monotonic() < deadline:
                    local.progress()
                    got = local.get_notifications()
                    if got:  # snapshot the data at delivery time
                        at_delivery = inbox.copy()
                    else:
                        time.sleep(0.001)
                assert [(n.peer, n.payload) for n in got] == [(remote.agent_name, payload)]
                _assert_bytes_equal(at_delivery, model, "local buffer when the notification came")
            _assert_bytes_equal(inbox, model, "child-initiated WRITE")
            remote.release_prepared(pair)
        if env.caps.read:
            _randomize(src, env.rng)
            crdst = env.rbuf["dst"]
            model_r = env.remote.read_array("dst")
            perm = env.rng.permutation(rows)
            _apply_rows(model_r, offs[perm] + 64, src, offs, np.full(rows, row))
            pair = remote.prepare(
                me, _table(crdst.addr, offs + 64, row), _table(_addr(src), offs, row)
            )
            hid = remote.submit(XferOp.READ, pair, perm, np.arange(rows))
            state, error = remote.wait(hid, env.timeout, progress=local.progress)
            assert state is XferState.DONE, f"child-initiated READ ended {state!r}: {error}"
            remote.release(hid)
            remote.release_prepared(pair)
            _assert_bytes_equal(env.remote.read_array("dst"), model_r, "child-initiated READ")
        assert remote.attribute("live_handles") == 0
        remote.remove_peer(me)

    def test_close_with_transfers_in_flight(self, env: _Env) -> None:
        env.need("write")
        cfg = type(self)
        other = _new_backend(env.backend_name, env.options, "closing")
        src, sink = env.lbuf["big_src"], env.rbuf["sink"]
        handles: list[TransferHandle] = []
        try:
            other.register([MemoryRegion.from_tensor(src)])
            peer = other.add_peer(env.remote.metadata())
            pair = other.prepare(
                peer, _table(_addr(src), [0], SINK_BYTES), _table(sink.addr, [0], SINK_BYTES)
            )
            handles = [other.submit(XferOp.WRITE, pair, [0], [0]) for _ in range(4)]
        finally:
            t0 = time.monotonic()
            other.close()
            elapsed = time.monotonic() - t0
        assert elapsed < cfg.close_timeout_s, (
            f"close() took {elapsed:.1f}s with transfers in flight"
        )
        assert other.closed
        other.close()  # idempotent
        for h in handles:
            assert _check_state(other.poll(h)) in (XferState.DONE, XferState.FAILED)
            other.release(h)
        assert other.live_handles == 0
        with pytest.raises(KVWireError):
            other.submit(XferOp.WRITE, pair, [0], [0])
        env.remote.ping()
        env.roundtrip_check()

    def test_peer_killed_mid_transfer(self, env: _Env) -> None:
        env.need("write")
        cfg = type(self)
        n = cfg.large_transfer_bytes
        fast = cfg.fast_failure_options
        if fast is None:
            fast = (
                {"transfer_timeout_s": 2.0}
                if "transfer_timeout_s" in env.cls.options_model.model_fields
                else {}
            )
        options = {**env.options, **fast}
        victim = RemoteAgent(env.backend_name, env.options, f"conf-victim-{uuid.uuid4().hex[:8]}")
        victim.start()
        b = _new_backend(env.backend_name, options, "bereaved")
        src = env.lbuf["big_src"]
        try:
            b.register([MemoryRegion.from_tensor(src)])
            sink = victim.allocate("sink", n, watch=False)
            peer = b.add_peer(victim.metadata())
            pair = b.prepare(peer, _table(_addr(src), [0], n), _table(sink.addr, [0], n))
            victim.suspend()  # the target cannot take part any more: the transfer stays pending
            handle = b.submit(XferOp.WRITE, pair, [0], [0])
            before = _check_state(b.poll(handle))
            victim.kill()
            t0 = time.monotonic()
            if before is XferState.DONE and cfg.one_sided_writes:
                pytest.skip("the WRITE completed before the peer could be killed")
            state = wait_terminal(b, handle, cfg.peer_failure_timeout_s)
            elapsed = time.monotonic() - t0
            if state is XferState.DONE and cfg.one_sided_writes:
                pytest.skip("the WRITE completed (one-sided) before the peer died")
            assert state is XferState.FAILED, "a transfer to a killed peer must end FAILED"
            assert isinstance(handle.error, str) and handle.error, "FAILED handle has no error"
            assert elapsed <= cfg.peer_failure_timeout_s
            b.release(handle)
            b.remove_peer(peer)
            assert b.live_handles == 0
            with pytest.raises(RemoteAgentError):
                victim.ping()  # a dead child is reported, not waited for
        finally:
            victim.kill()
            t0 = time.monotonic()
            b.close()
            assert time.monotonic() - t0 < cfg.close_timeout_s, "close() hung after a peer died"
            victim.close()
        env.roundtrip_check()


# --------------------------------------------------------------------- mapper suite
@dataclass(frozen=True)
class MapperCase:
    """A layout pair for a mapper: model, source (TP size, rank) and destination."""

    id: str
    mapper: type[IndexMapper]
    heads: int
    src_tp: int
    src_rank: int
    dst_tp: int
    dst_rank: int
    is_mla: bool = False
    page_size: int = 2
    #: Also move a chunk through the backend (needs heads >= both TP sizes, or MLA).
    transfer: bool = False


MAPPER_CASES = [
    MapperCase("equal_tp-1to1", EqualTPMapper, 4, 1, 0, 1, 0, transfer=True),
    MapperCase("equal_tp-2to2-r1", EqualTPMapper, 4, 2, 1, 2, 1, page_size=4, transfer=True),
    MapperCase("equal_tp-gqa-4to4-r3", EqualTPMapper, 2, 4, 3, 4, 3),
    MapperCase("mla-1to1", MLAMapper, 1, 1, 0, 1, 0, is_mla=True),
    MapperCase("mla-2to1-r0", MLAMapper, 1, 2, 0, 1, 0, is_mla=True, transfer=True),
    MapperCase("mla-2to1-r1-dummy", MLAMapper, 1, 2, 1, 1, 0, is_mla=True),
    MapperCase("mla-1to2-r1", MLAMapper, 1, 1, 0, 2, 1, is_mla=True),
    MapperCase("head_slice-scatter-1to2-r1", HeadSliceMapper, 4, 1, 0, 2, 1, transfer=True),
    MapperCase("head_slice-scatter-2to4-r3", HeadSliceMapper, 4, 2, 1, 4, 3, transfer=True),
    MapperCase("head_slice-gather-2to1-r1", HeadSliceMapper, 4, 2, 1, 1, 0, transfer=True),
    MapperCase("head_slice-gather-4to2-r2", HeadSliceMapper, 8, 4, 2, 2, 1, page_size=1),
    MapperCase("head_slice-gqa-scatter-1to4-r3", HeadSliceMapper, 2, 1, 0, 4, 3),
    MapperCase("head_slice-gqa-gather-4to2-r1", HeadSliceMapper, 2, 4, 1, 2, 0),
    MapperCase("head_slice-gqa-gather-4to2-r2", HeadSliceMapper, 2, 4, 2, 2, 1),
]
TRANSFER_CASES = [c for c in MAPPER_CASES if c.transfer]
NUM_LAYERS, HEAD_DIM, DTYPE, NUM_SLOTS = 2, 8, "bfloat16", 16


def _model(case: MapperCase) -> ModelSpec:
    return ModelSpec(
        num_layers=NUM_LAYERS,
        total_kv_heads=case.heads,
        head_dim=HEAD_DIM,
        dtype=DTYPE,
        page_size=case.page_size,
        is_mla=case.is_mla,
    )


def _item_len(case: MapperCase, tp: int) -> int:
    heads = 1 if case.is_mla else max(1, case.heads // tp)
    return case.page_size * heads * HEAD_DIM * DTYPE_SIZES[DTYPE]


def _num_buffers(case: MapperCase) -> int:
    return NUM_LAYERS if case.is_mla else 2 * NUM_LAYERS


def _layout(case: MapperCase, side: str, bases: list[int]) -> KVLayout:
    tp, rank = (case.src_tp, case.src_rank) if side == "src" else (case.dst_tp, case.dst_rank)
    item = _item_len(case, tp)
    buffers = tuple(MemoryRegion.from_pointer(a, NUM_SLOTS * item, item) for a in bases)
    return KVLayout(
        model=_model(case), rank=RankPosition(tp_size=tp, tp_rank=rank), buffers=buffers
    )


def _fake_layout(case: MapperCase, side: str) -> KVLayout:
    tp = case.src_tp if side == "src" else case.dst_tp
    stride = NUM_SLOTS * _item_len(case, tp) + 4096
    first = 0x10_0000_0000 if side == "src" else 0x20_0000_0000
    return _layout(case, side, [first + i * stride for i in range(_num_buffers(case))])


def _slot_of(
    table: DescTable, rows: NDArray[np.int64], layout: KVLayout
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(buffer index, page slot) of each row."""
    addr = table[rows, ADDR]
    buf = np.searchsorted(layout.bases, addr, side="right").astype(np.int64) - 1
    item = np.uint64(layout.buffers[0].item_len)
    slot = ((addr - layout.bases[buf]) // item).astype(np.int64)
    return buf, slot


class MapperConformance:
    """Core mappers' tables and chunks: properties, then real transfers through the backend."""

    backend_name: ClassVar[str] = ""
    backend_options: ClassVar[dict[str, Any]] = {}
    transfer_timeout_s: ClassVar[float] = 60.0

    @pytest.mark.parametrize("case", MAPPER_CASES, ids=lambda c: c.id)
    def test_tables_and_chunks(self, case: MapperCase) -> None:
        src, dst = _fake_layout(case, "src"), _fake_layout(case, "dst")
        mapper = case.mapper(src, dst)
        tables = mapper.build_tables()
        for table, layout, what in ((tables.src, src, "source"), (tables.dst, dst, "destination")):
            assert isinstance(table, np.ndarray), f"{what} table is a {type(table).__name__}"
            assert table.dtype == np.uint64 and table.ndim == 2 and table.shape[1] == 3, (
                f"{what} table has dtype {table.dtype} and shape {table.shape}; want (N, 3) uint64"
            )
            check_table(table, f"{what} table")
            assert not outside_regions(table, layout.buffers).any(), (
                f"{what} table rows lie outside the layout's buffers"
            )
        src_row, dst_row = src.token_row_bytes, dst.token_row_bytes
        rng = np.random.default_rng(zlib.crc32(case.id.encode()))
        for k in (1, 3, NUM_SLOTS):
            sp = rng.choice(NUM_SLOTS, k, replace=False)
            dp = rng.choice(NUM_SLOTS, k, replace=False)
            si, di = mapper.map_chunk(sp, dp)
            for idx, what in ((si, "source"), (di, "destination")):
                assert isinstance(idx, np.ndarray) and idx.dtype == np.int64 and idx.ndim == 1, (
                    f"{what} index array must be 1-D int64"
                )
            assert si.shape == di.shape, "index arrays differ in length"
            if mapper.is_dummy:
                assert si.size == 0, "a dummy sender must move nothing"
                continue
            assert si.size > 0
            assert si.min() >= 0 and si.max() < tables.src.shape[0], "source index out of range"
            assert di.min() >= 0 and di.max() < tables.dst.shape[0], (
                "destination index out of range"
            )
            lens_s, lens_d = tables.src[si, LEN], tables.dst[di, LEN]
            assert np.array_equal(lens_s, lens_d), "paired rows differ in length"
            d_addr = tables.dst[di, ADDR]
            order = np.argsort(d_addr, kind="stable")
            ends = d_addr[order] + lens_d[order]
            assert (ends[:-1] <= d_addr[order][1:]).all(), "destination rows of a chunk overlap"
            expected = mapper.num_pairs * k * case.page_size * min(src_row, dst_row)
            assert int(lens_d.sum()) == expected, (
                f"chunk moves {int(lens_d.sum())} B, want {expected}"
            )
            s_buf, s_slot = _slot_of(tables.src, si, src)
            d_buf, d_slot = _slot_of(tables.dst, di, dst)
            pos_s = np.searchsorted(np.sort(sp), s_slot)
            pos_d = np.searchsorted(np.sort(dp), d_slot)
            assert np.isin(s_slot, sp).all(), "a source row lies outside the chunk's pages"
            assert np.isin(d_slot, dp).all(), "a destination row lies outside the chunk's pages"
            chunk_of_s = np.argsort(sp)[pos_s]
            chunk_of_d = np.argsort(dp)[pos_d]
            assert np.array_equal(chunk_of_s, chunk_of_d), (
                "rows do not pair src_pages[i] with dst_pages[i]"
            )
            assert np.array_equal(src.buffer_keys[s_buf], dst.buffer_keys[d_buf]), (
                "paired rows belong to different layers or K/V"
            )
        sp = rng.choice(NUM_SLOTS, 3, replace=False)
        with pytest.raises(DescriptorError):
            mapper.map_chunk(sp, sp[:2])
        with pytest.raises(DescriptorError):
            mapper.map_chunk([NUM_SLOTS], [0])
        with pytest.raises(DescriptorError):
            mapper.map_chunk([0], [-1])

    @pytest.fixture(scope="class")
    @classmethod
    def mapper_env(cls) -> Iterator[dict[str, Any]]:
        cfg = cls
        name, options = cfg.backend_name, dict(cfg.backend_options)
        if not name:
            pytest.fail(f"{cfg.__name__} must set backend_name")
        backend_cls = _backend_class(name, options)
        if not (backend_cls.capabilities.dram and backend_cls.capabilities.write):
            pytest.skip(f"{name} does not declare WRITE and DRAM capability")
        remote = RemoteAgent(name, options, f"conf-mapper-target-{uuid.uuid4().hex[:8]}").start()
        local: TransferBackend | None = None
        try:
            local = _new_backend(name, options, "mapper-local")
            src_arrays: dict[str, list[NDArray[np.uint8]]] = {}
            dst_bufs: dict[str, list[RemoteBuffer]] = {}
            for ci, case in enumerate(TRANSFER_CASES):
                n_src = NUM_SLOTS * _item_len(case, case.src_tp)
                n_dst = NUM_SLOTS * _item_len(case, case.dst_tp)
                src_arrays[case.id] = [
                    fill_bytes(n_src, 1000 * ci + i) for i in range(_num_buffers(case))
                ]
                dst_bufs[case.id] = [
                    remote.allocate(f"{case.id}/{i}", n_dst, fill=2000 * ci + i, watch=False)
                    for i in range(_num_buffers(case))
                ]
            local.register(
                [MemoryRegion.from_tensor(a) for arrs in src_arrays.values() for a in arrs]
            )
            peer = local.add_peer(remote.metadata())
            yield {
                "local": local,
                "remote": remote,
                "peer": peer,
                "src": src_arrays,
                "dst": dst_bufs,
            }
        finally:
            if local is not None:
                local.close()
            remote.close()

    @pytest.mark.parametrize("case", TRANSFER_CASES, ids=lambda c: c.id)
    def test_chunk_transfer(self, mapper_env: dict[str, Any], case: MapperCase) -> None:
        local: TransferBackend = mapper_env["local"]
        remote: RemoteAgent = mapper_env["remote"]
        arrays: list[NDArray[np.uint8]] = mapper_env["src"][case.id]
        bufs: list[RemoteBuffer] = mapper_env["dst"][case.id]
        src = _layout(case, "src", [_addr(a) for a in arrays])
        dst = _layout(case, "dst", [b.addr for b in bufs])
        mapper = case.mapper(src, dst)
        assert not mapper.is_dummy
        tables = mapper.build_tables()
        rng = np.random.default_rng(zlib.crc32(case.id.encode()))
        k = 5
        sp = rng.choice(NUM_SLOTS, k, replace=False)
        dp = rng.choice(NUM_SLOTS, k, replace=False)
        before = [remote.read_array(b.name) for b in bufs]
        # The model: head ranges each side holds, independent of the mapper's tables.
        ps, hb = case.page_size, HEAD_DIM * DTYPE_SIZES[DTYPE]
        if case.is_mla:
            sh = dh = 1
            s_lo = d_lo = 0
        else:
            sh, dh = case.heads // case.src_tp, case.heads // case.dst_tp
            s_lo, d_lo = case.src_rank * sh, case.dst_rank * dh
        lo, hi = max(s_lo, d_lo), min(s_lo + sh, d_lo + dh)
        assert lo < hi, "case has no heads in common"
        expected = []
        for arr, old in zip(arrays, before, strict=True):
            s4 = arr.reshape(NUM_SLOTS, ps, sh, hb)
            d4 = old.copy().reshape(NUM_SLOTS, ps, dh, hb)
            d4[dp, :, lo - d_lo : hi - d_lo] = s4[sp, :, lo - s_lo : hi - s_lo]
            expected.append(d4.reshape(-1))
        si, di = mapper.map_chunk(sp, dp)
        pair = local.prepare(mapper_env["peer"], tables.src, tables.dst)
        try:
            handle = local.submit(XferOp.WRITE, pair, si, di)
            state = wait_terminal(local, handle, type(self).transfer_timeout_s)
            assert state is XferState.DONE, f"mapped chunk WRITE ended {state.name}: {handle.error}"
            local.release(handle)
        finally:
            local.release_prepared(pair)
        for b, want in zip(bufs, expected, strict=True):
            _assert_bytes_equal(remote.read_array(b.name), want, f"{case.id}: buffer {b.name}")
