"""A third pool needs no core edit (issue 25, item 3): a test plugin declares a mapper for an
"ssd" pool, a decode engine declares that pool (a file-backed memory map standing in for an
SSD tier), and KV moves into it over the real TCP backend, checked byte for byte. Unknown
pools are refused with a clear error on both sides; the KV pool keeps working beside them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from kvwire import plugins
from kvwire.config import ControlOptions, KVWireConfig, PoolConfig, config_from_args
from kvwire.errors import ConfigError, TransferError
from kvwire.hookspecs import Implementation, hookimpl
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.session import KVManager, KVPoll, Role
from kvwire.testing.kvfill import count_mismatches, fill_pages, make_pool, pool_shape

MODEL = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype="int32", page_size=4)
CONFIG = KVWireConfig(transfer_backend="tcp", control=ControlOptions(heartbeat_interval_s=0.2))


class SsdTierPlugin:
    """The whole plugin: one hook naming a mapper for the "ssd" pool. Core's equal-TP mapper
    serves it (same page size); a real tier would bring its own mapper and strategy."""

    KVWIRE_PLUGIN_API = "2.0"
    __name__ = "ssd_tier_plugin"

    @staticmethod
    @hookimpl
    def kvwire_index_mappers() -> list[Implementation]:
        return [
            Implementation(
                "ssd_tier",
                "kvwire.index.equal_tp:EqualTPMapper",
                "prefill KV pages into a decode SSD tier of equal pages",
                priority=5,
                pools=("ssd",),
            )
        ]


@pytest.fixture
def with_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    reg = plugins.PluginRegistry(load_entry_points=False, extra=[("ssd-tier", SsdTierPlugin)])
    assert "ssd_tier" in reg.entries[plugins.Kind.MAPPER], [b.error for b in reg.broken]
    monkeypatch.setattr(plugins, "_registry", reg)
    yield


@pytest.fixture
def without_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(plugins, "_registry", plugins.PluginRegistry(load_entry_points=False))
    yield


def ssd_pool(path: Path, slots: int) -> tuple[KVLayout, list[np.memmap]]:
    """A pool whose buffers are memory maps of one file (the stand-in SSD tier)."""
    shape = pool_shape(MODEL, slots, MODEL.total_kv_heads, False, False, False)
    per = int(np.prod(shape)) * 4
    nbuf = MODEL.num_layers * 2
    path.write_bytes(b"\0" * per * nbuf)
    arrays = [
        np.memmap(path, dtype=np.int32, mode="r+", offset=b * per, shape=shape) for b in range(nbuf)
    ]
    return KVLayout.from_tensors(MODEL, arrays, RankPosition(), 0, MODEL.num_layers), arrays


def wait_for(pred: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def transfer(
    prefill: KVManager, decode: KVManager, room: int, dst: NDArray[np.int64], pool: str
) -> tuple[KVPoll, str]:
    """One request of ``len(dst)`` pages from prefill pages 0.. into ``dst`` of ``pool``."""
    r = decode.receiver(room, prefill.bootstrap_addr or "")
    r.init()
    r.send_metadata(dst, aux_index=0, pool=pool)
    s = prefill.sender(room)
    wait_for(lambda: s.poll() >= KVPoll.WaitingForInput or r.poll() is KVPoll.Failed)
    if r.poll() is not KVPoll.Failed:
        s.init(len(dst), aux_index=0)
        s.send(np.arange(len(dst)), last=True)
    wait_for(lambda: r.poll() in (KVPoll.Success, KVPoll.Failed))
    err = ""
    try:
        r.failure_exception()
    except TransferError as exc:
        err = str(exc)
    return r.poll(), err


def test_kv_moves_into_a_plugin_declared_third_pool(with_plugin: None, tmp_path: Path) -> None:
    play, parr = make_pool(MODEL, RankPosition(), 8)
    fill_pages(play, parr, np.arange(4), 0)
    dlay, darr = make_pool(MODEL, RankPosition(), 8)
    slay, sarr = ssd_pool(tmp_path / "tier.bin", 32)
    prefill = KVManager(CONFIG, Role.PREFILL, play)
    decode = KVManager(CONFIG, Role.DECODE, dlay, pools={"ssd": slay})
    try:
        assert sorted(decode.pools) == ["kv", "ssd"]
        strategy = decode.staging_of("ssd")
        assert strategy is not None and strategy.name == "direct"  # no plugin strategy: direct
        dst = np.array([30, 3, 17, 9], dtype=np.int64)
        status, err = transfer(prefill, decode, 1, dst, "ssd")
        assert status is KVPoll.Success, err
        assert count_mismatches(slay, list(sarr), dst, 0) == 0
        assert not any(a.any() for a in darr)  # nothing went to the KV pool
        # the KV pool keeps working beside it, on the same link
        status, err = transfer(prefill, decode, 2, np.array([5, 6]), "kv")
        assert status is KVPoll.Success, err
        assert count_mismatches(dlay, darr, np.array([5, 6]), 0) == 0
        # prefill built the ssd pool's strategy when decode announced the pool
        assert prefill.staging_of("ssd") is not None
    finally:
        decode.close()
        prefill.close()


def test_a_pool_without_a_mapper_fails_its_requests_naming_why(without_plugin: None) -> None:
    """Prefill has no mapper for the announced pool: a request into it fails on decode with
    prefill's reason; the KV pool works on the same link."""
    play, parr = make_pool(MODEL, RankPosition(), 8)
    fill_pages(play, parr, np.arange(2), 0)
    dlay, darr = make_pool(MODEL, RankPosition(), 8)
    slay, _ = make_pool(MODEL, RankPosition(), 8)
    prefill = KVManager(CONFIG, Role.PREFILL, play)
    decode = KVManager(CONFIG, Role.DECODE, dlay, pools={"ssd": slay})
    try:
        status, err = transfer(prefill, decode, 1, np.array([0, 1]), "ssd")
        assert status is KVPoll.Failed
        assert "no usable ssd pool mapper" in err and "pools.ssd.mapper" in err
        status, err = transfer(prefill, decode, 2, np.array([2, 3]), "kv")
        assert status is KVPoll.Success, err
        assert count_mismatches(dlay, darr, np.array([2, 3]), 0) == 0
    finally:
        decode.close()
        prefill.close()


def test_unknown_pool_is_refused_on_decode_at_once() -> None:
    dlay, _ = make_pool(MODEL, RankPosition(), 8)
    with KVManager(CONFIG, Role.DECODE, dlay) as decode:
        r = decode.receiver(1, "127.0.0.1:9")
        with pytest.raises(ConfigError, match=r"no pool 'cxl'.*\['kv'\]"):
            r.send_metadata([0], aux_index=0, pool="cxl")


def test_bad_pool_declarations_are_refused() -> None:
    lay, _ = make_pool(MODEL, RankPosition(), 8)
    with pytest.raises(ConfigError, match="'kv' is the KV pool"):
        KVManager(CONFIG, Role.DECODE, lay, pools={"kv": lay})
    with pytest.raises(ConfigError, match="for decode managers"):
        KVManager(CONFIG, Role.PREFILL, lay, pools={"ssd": lay})
    with pytest.raises(ConfigError, match="not a valid pool name"):
        KVManager(CONFIG, Role.DECODE, lay, pools={"a b": lay})


def test_pools_config_from_cli_env_and_dicts(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_from_args(
        {"pool_option": ["ssd.staging=direct", 'ssd.mapper_options={"x": 1}']}, use_env=False
    )
    assert cfg.pools == {"ssd": PoolConfig(staging="direct", mapper_options={"x": 1})}
    monkeypatch.setenv("KVWIRE_POOLS", '{"cxl": {"mapper": "equal_tp"}}')
    assert KVWireConfig().pools["cxl"].mapper == "equal_tp"
    with pytest.raises(ConfigError, match=r"POOL\.KEY=VALUE"):
        config_from_args({"pool_option": ["staging=direct"]}, use_env=False)
    with pytest.raises(ConfigError, match="invalid kvwire configuration"):
        config_from_args({"pool_option": ["ssd.stagin=direct"]}, use_env=False)
    with pytest.raises(ConfigError, match=r"KV pool \('kv'\) is set by staging"):
        config_from_args({"pool_option": ["kv.staging=bulk"]}, use_env=False)


class HostPoolPlugin(SsdTierPlugin):
    """The same test plugin for a pool named "host" (as 1.9 peers knew it)."""

    __name__ = "host_pool_test_plugin"

    @staticmethod
    @hookimpl
    def kvwire_index_mappers() -> list[Implementation]:
        return [
            Implementation(
                "host_test",
                "kvwire.index.equal_tp:EqualTPMapper",
                "test mapper into a pool named host",
                priority=5,
                pools=("host",),
            )
        ]


def test_a_1_9_hello_host_pool_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode rank that announces its pool the 1.9 way (``host_layout`` only, no
    ``pools``) still gets KV moved into it; a 1.10 decode fills the 1.9 fields too."""
    from kvwire.control.wire import Hello
    from kvwire.session.decode import links

    reg = plugins.PluginRegistry(load_entry_points=False, extra=[("host-test", HostPoolPlugin)])
    monkeypatch.setattr(plugins, "_registry", reg)
    sent: list[Hello] = []

    class Hello19(Hello):
        """What a 1.9 decode rank sends: the pool under the 1.9 fields only."""

        def __init__(self, **kw: object) -> None:
            sent.append(Hello(**kw))  # type: ignore[arg-type]
            kw.pop("pools", None)
            kw.pop("pool_staging", None)
            super().__init__(**kw)  # type: ignore[arg-type]

    monkeypatch.setattr(links, "Hello", Hello19)
    play, parr = make_pool(MODEL, RankPosition(), 8)
    fill_pages(play, parr, np.arange(3), 0)
    dlay, _ = make_pool(MODEL, RankPosition(), 8)
    hlay, harr = make_pool(MODEL, RankPosition(), 8)
    prefill = KVManager(CONFIG, Role.PREFILL, play)
    decode = KVManager(CONFIG, Role.DECODE, dlay, pools={"host": hlay})
    try:
        dst = np.array([7, 0, 4], dtype=np.int64)
        status, err = transfer(prefill, decode, 1, dst, "host")
        assert status is KVPoll.Success, err
        assert count_mismatches(hlay, harr, dst, 0) == 0
        assert sent and sent[0].host_layout == hlay and sorted(sent[0].pools) == ["host"]
    finally:
        decode.close()
        prefill.close()


def test_a_staging_message_for_an_unknown_pool_is_dropped_and_counted() -> None:
    """A handshaken peer's staging message naming a pool this rank lacks is dropped, counted
    as ``staging_unknown_pool``; the rank keeps serving (a later request succeeds)."""
    from kvwire.control.wire import StagingMessage

    play, parr = make_pool(MODEL, RankPosition(), 8)
    fill_pages(play, parr, np.arange(2), 0)
    dlay, darr = make_pool(MODEL, RankPosition(), 8)
    prefill = KVManager(CONFIG, Role.PREFILL, play)
    decode = KVManager(CONFIG, Role.DECODE, dlay)
    try:
        assert transfer(prefill, decode, 1, np.array([0, 1]), "kv")[0] is KVPoll.Success
        peer = prefill.peers.get(decode.session)
        assert peer is not None
        for pool in ("cxl", "kv"):  # the second: known pool, other strategy (the control)
            msg = StagingMessage(session=prefill.session, pool=pool, strategy="bulk", type="x")
            assert prefill.ctx.tell(peer.endpoint, msg)
        wait_for(lambda: decode.dropped.get("staging_other_strategy", 0) == 1)
        assert decode.dropped.get("staging_unknown_pool", 0) == 1
        status, err = transfer(prefill, decode, 2, np.array([2, 3]), "kv")
        assert status is KVPoll.Success, err
        assert count_mismatches(dlay, darr, np.array([2, 3]), 0) == 0
    finally:
        decode.close()
        prefill.close()


def test_a_pool_whose_strategy_cannot_be_built_fails_only_its_requests(
    with_plugin: None,
) -> None:
    """Prefill's configured strategy for the pool is unknown: requests into that pool fail
    naming it; the KV pool works on the same link."""
    play, parr = make_pool(MODEL, RankPosition(), 8)
    fill_pages(play, parr, np.arange(2), 0)
    dlay, darr = make_pool(MODEL, RankPosition(), 8)
    slay, _ = make_pool(MODEL, RankPosition(), 8)
    bad = CONFIG.model_copy(update={"pools": {"ssd": PoolConfig(staging="teleport")}})
    prefill = KVManager(bad, Role.PREFILL, play)
    decode = KVManager(CONFIG, Role.DECODE, dlay, pools={"ssd": slay})
    try:
        status, err = transfer(prefill, decode, 1, np.array([0, 1]), "ssd")
        assert status is KVPoll.Failed and "ssd pool staging strategy" in err
        assert "teleport" in err
        status, err = transfer(prefill, decode, 2, np.array([2, 3]), "kv")
        assert status is KVPoll.Success, err
        assert count_mismatches(dlay, darr, np.array([2, 3]), 0) == 0
    finally:
        decode.close()
        prefill.close()
