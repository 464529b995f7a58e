"""Helpers, the class-scoped environment and the base class of the backend conformance mixins."""

from __future__ import annotations

import contextlib
import time
import uuid
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
from kvwire.descriptors import DescTable, make_table
from kvwire.layout import MemoryRegion
from kvwire.selection import create_backend, select_backend
from kvwire.testing.remote import (
    RemoteAgent,
    RemoteBuffer,
    fill_bytes,
)

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


class SuiteBase:
    """What every capability mixin shares: the class options a plugin sets and the
    class-scoped :class:`_Env` fixture (a local agent here, a target agent in a spawned child)."""

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
