"""Refusals and failures: out-of-region rows, malformed requests, peer removal, close with transfers
in flight, a peer killed mid-transfer."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import pytest

from kvwire.backend import (
    TransferHandle,
    XferOp,
    XferState,
)
from kvwire.descriptors import make_table
from kvwire.errors import DescriptorError, HandleError, KVWireError, PeerError
from kvwire.layout import MemoryRegion
from kvwire.testing.conformance.common import (
    SINK_BYTES,
    SuiteBase,
    _addr,
    _assert_bytes_equal,
    _check_state,
    _Env,
    _new_backend,
    _table,
    wait_terminal,
)
from kvwire.testing.remote import (
    RemoteAgent,
    RemoteAgentError,
)


class FailureConformance(SuiteBase):
    """Refusals and failures: out-of-region rows, malformed requests, peer removal, close with
    transfers in flight, a peer killed mid-transfer. Part of
    :class:`~kvwire.testing.conformance.BackendConformance`."""

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
