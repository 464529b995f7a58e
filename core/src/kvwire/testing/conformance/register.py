"""Capabilities, options, memory registration and handle lifecycle."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.backend import (
    BackendCapabilities,
    PreparedPair,
    TransferHandle,
    XferOp,
    XferState,
)
from kvwire.errors import DescriptorError, HandleError, LayoutError
from kvwire.layout import MemoryRegion
from kvwire.testing.conformance.common import (
    KiB,
    SuiteBase,
    _addr,
    _check_state,
    _Env,
    _randomize,
    _table,
    wait_terminal,
)


class RegisterConformance(SuiteBase):
    """Capabilities, options, memory registration and handle lifecycle. Part of
    :class:`~kvwire.testing.conformance.BackendConformance`."""

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
