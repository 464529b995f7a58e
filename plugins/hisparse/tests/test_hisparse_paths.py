"""Path choice of the ``hisparse`` host staging (in one process, real tcp backend and control
plane): ``auto`` maps a shared pool and copies into it, a private pool goes through the engine,
forced paths are honoured or refused with the reason, and a departed decode's pool is unmapped."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from kvwire_hisparse.paths import HostPathStrategy
from kvwire_hisparse.shm import SharedHostPool, host_identity

from kvwire.config import ControlOptions, KVWireConfig, PoolConfig
from kvwire.errors import KVWireError
from kvwire.index.base import TablePair
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.session import KVManager, KVPoll, Role
from kvwire.testing.kvfill import count_mismatches, fill_pages, make_pool
from kvwire.testing.pair import wait_for

MODEL = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype="int32", page_size=4)
HOST = MODEL.model_copy(update={"page_size": 1})
SLOTS = 16


def config(path: str = "auto") -> KVWireConfig:
    return KVWireConfig(
        transfer_backend="tcp",
        control=ControlOptions(heartbeat_interval_s=0.1, handshake_timeout_s=3.0),
        pools={"host": PoolConfig(staging_options={"path": path})},
    )


def shared_host_pool() -> tuple[SharedHostPool, KVLayout, list[Any]]:
    shape = (SLOTS * 4, 1, 2, 8)
    per = int(np.prod(shape)) * 4
    pool = SharedHostPool.create(per * 4)
    raw = pool.array()
    arrays = [raw[b * per : (b + 1) * per].view(np.int32).reshape(shape) for b in range(4)]
    return pool, KVLayout.from_tensors(HOST, arrays, RankPosition(), 0, 2), arrays


@contextmanager
def managers(path: str, shared: bool) -> Iterator[tuple[KVManager, KVManager, Any]]:
    play, parr = make_pool(MODEL, RankPosition(), SLOTS)
    dlay, _darr = make_pool(MODEL, RankPosition(), SLOTS)
    pool = None
    if shared:
        pool, hlay, harr = shared_host_pool()
    else:
        hlay, harr = make_pool(HOST, RankPosition(), SLOTS * 4)
    prefill = KVManager(config(path), Role.PREFILL, play)
    decode = KVManager(config(), Role.DECODE, dlay, pools={"host": hlay})
    try:
        yield prefill, decode, (play, parr, hlay, harr)
    finally:
        decode.close()
        prefill.close()
        if pool is not None:
            pool.close()


def transfer(
    prefill: KVManager, decode: KVManager, pools: Any, room: int = 1
) -> tuple[KVPoll, str]:
    """One HiSparse request; its status and, if it failed, why (as decode reports it)."""
    play, parr, hlay, harr = pools
    src = np.array([3, 1])
    fill_pages(play, parr, src, 0)
    dst = np.arange(7) + 20  # 2 pages of 4 tokens, the last token trimmed
    r = decode.receiver(room, prefill.bootstrap_addr or "")
    r.init()
    r.send_metadata(dst, aux_index=0, pool="host")
    s = prefill.sender(room)
    wait_for(lambda: s.poll() >= KVPoll.WaitingForInput or r.poll() is KVPoll.Failed)
    if r.poll() is not KVPoll.Failed:
        s.init(2, aux_index=0)
        s.send(src, last=True)
    wait_for(lambda: r.poll() in (KVPoll.Success, KVPoll.Failed))
    status = r.poll()
    if status is KVPoll.Success:
        assert count_mismatches(hlay, harr, dst, 0) == 0
        return status, ""
    with pytest.raises(KVWireError) as info:
        r.failure_exception()
    return status, str(info.value)


def strategy(mgr: KVManager) -> HostPathStrategy:
    strategy = mgr.staging_of("host")
    assert isinstance(strategy, HostPathStrategy)
    return strategy


def test_auto_maps_a_shared_pool_and_unmaps_it_when_decode_leaves() -> None:
    with managers("auto", shared=True) as (prefill, decode, pools):
        assert transfer(prefill, decode, pools)[0] is KVPoll.Success
        assert list(strategy(prefill).paths().values()) == ["mapped"]
        decode.close()
        wait_for(lambda: not strategy(prefill).paths(), timeout=10)
        assert prefill.room_tables()["host_links_closing"] == 0


def test_auto_uses_the_engine_for_a_private_pool() -> None:
    with managers("auto", shared=False) as (prefill, decode, pools):
        assert transfer(prefill, decode, pools)[0] is KVPoll.Success
        assert list(strategy(prefill).paths().values()) == ["engine"]


def test_forced_engine_path_on_a_shared_pool() -> None:
    with managers("engine", shared=True) as (prefill, decode, pools):
        assert transfer(prefill, decode, pools)[0] is KVPoll.Success
        assert list(strategy(prefill).paths().values()) == ["engine"]


def test_forced_mapped_path_that_cannot_work_is_refused_with_the_reason() -> None:
    with managers("mapped", shared=False) as (prefill, decode, pools):
        status, err = transfer(prefill, decode, pools)
        assert status is KVPoll.Failed
        assert "path='mapped' cannot work" in err and "not a SharedHostPool" in err


def test_another_host_or_unequal_rows_rule_out_mapping() -> None:
    s = HostPathStrategy()
    src = np.array([[0x1000, 64, 0], [0x2000, 64, 0]], dtype=np.uint64)
    tables = TablePair(src, src.copy())
    remote = {"strategy": "hisparse", "identity": host_identity(), "pools": [{"path": "x"}]}
    assert s._mapped_problem(remote, tables) is None
    other = {**remote, "identity": "another-boot:1000"}
    assert "another host" in (s._mapped_problem(other, tables) or "")
    uneven = TablePair(src, np.array([[0x1000, 32, 0], [0x2000, 32, 0]], dtype=np.uint64))
    assert "differ in length" in (s._mapped_problem(remote, uneven) or "")


def test_host_staging_selection() -> None:
    from kvwire.selection import select_pool_staging

    def pick(**kw: Any) -> str:
        return select_pool_staging(KVWireConfig(pools={"host": PoolConfig(**kw)}), "host").name

    assert select_pool_staging(KVWireConfig(), "host").name == "hisparse"  # auto, installed
    assert pick(staging="direct") == "direct"
    with pytest.raises(KVWireError, match="nope"):
        pick(staging="nope")
    with pytest.raises(KVWireError, match="path"):
        pick(staging_options={"path": "teleport"})
