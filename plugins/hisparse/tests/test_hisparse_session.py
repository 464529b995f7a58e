"""HiSparse requests refused with a clear reason when the host pool cannot be used; regular
requests on the same decode keep working."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.errors import ConfigError, TransferError
from kvwire.layout import ModelSpec, RankPosition
from kvwire.session import KVManager, KVPoll, Role
from kvwire.testing.kvfill import make_pool

MODEL = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype="int32", page_size=4)
CONFIG = KVWireConfig(transfer_backend="tcp", control=ControlOptions(heartbeat_interval_s=0.2))


def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def run(host_model: ModelSpec | None, hisparse: bool) -> tuple[KVPoll, str]:
    play, _parr = make_pool(MODEL, RankPosition(), 16)
    dlay, _darr = make_pool(MODEL, RankPosition(), 16)  # kept alive while registered
    host = make_pool(host_model, RankPosition(), 64) if host_model else None
    prefill = KVManager(CONFIG, Role.PREFILL, play)
    decode = KVManager(CONFIG, Role.DECODE, dlay, pools={"host": host[0]} if host else None)
    try:
        r = decode.receiver(1, prefill.bootstrap_addr or "")
        r.init()
        r.send_metadata(
            np.arange(8 if hisparse else 2), aux_index=0, pool="host" if hisparse else "kv"
        )
        s = prefill.sender(1)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput or r.poll() is KVPoll.Failed)
        if r.poll() is not KVPoll.Failed:
            s.init(2, aux_index=0)
            s.send([0, 1], last=True)
        wait_for(lambda: r.poll() in (KVPoll.Success, KVPoll.Failed))
        err = ""
        try:
            r.failure_exception()
        except TransferError as exc:
            err = str(exc)
        return r.poll(), err
    finally:
        decode.close()
        prefill.close()


def test_host_page_size_must_divide_prefills() -> None:
    status, err = run(MODEL.model_copy(update={"page_size": 3}), hisparse=True)
    assert status is KVPoll.Failed and "must divide" in err


def test_incompatible_host_pool_names_the_field() -> None:
    bad = MODEL.model_copy(update={"page_size": 1, "head_dim": 4})
    status, err = run(bad, hisparse=True)
    assert status is KVPoll.Failed and "head_dim: prefill=8 decode=4" in err


def test_regular_requests_work_beside_a_refused_host_pool() -> None:
    status, _ = run(MODEL.model_copy(update={"page_size": 3}), hisparse=False)
    assert status is KVPoll.Success


def test_hisparse_without_a_host_pool_is_refused_at_once() -> None:
    dlay, _ = make_pool(MODEL, RankPosition(), 8)
    with KVManager(CONFIG, Role.DECODE, dlay) as decode:
        r = decode.receiver(1, "127.0.0.1:9")
        with pytest.raises(ConfigError, match="no pool 'host'"):
            r.send_metadata([0], aux_index=0, pool="host")
