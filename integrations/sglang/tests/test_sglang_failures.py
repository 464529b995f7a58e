"""Failure paths through kvwire-sglang's classes (in-process managers over tcp): aborts and
refused inputs surface as SGLang's ``KVPoll.Failed`` with ``failure_exception()`` saying why,
on both sides, without raising into the scheduler's call."""

from __future__ import annotations

import socket
import time
import types
from collections.abc import Iterator

import numpy as np
import pytest
from sgl_harness import KVH, LAYERS, SLOTS, Pool, real_utils_module, wait
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, BaseKVSender, KVPoll

from kvwire_sglang.conn import (
    KvwireKVBootstrapServer,
    KvwireKVManager,
    KvwireKVReceiver,
    KvwireKVSender,
)
from kvwire_sglang.facts import EngineFacts, engine_facts

DONE = (KVPoll.Success, KVPoll.Failed)


@pytest.fixture
def pair(kvwire_env: None) -> Iterator[tuple[KvwireKVManager, KvwireKVManager, str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = KvwireKVBootstrapServer("127.0.0.1", port)
    modes = real_utils_module().DisaggregationMode
    args = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=port)
    pools = [Pool(list(range(KVH))), Pool(list(range(KVH)))]
    facts = EngineFacts(num_layers=LAYERS, total_kv_heads=KVH, local_kv_heads=KVH)
    with engine_facts(facts):
        pre = KvwireKVManager(pools[0].kv_args(0, True), modes.PREFILL, args, False)
        dec = KvwireKVManager(pools[1].kv_args(0, False), modes.DECODE, args, False)
    try:
        yield pre, dec, server.server.address
    finally:
        dec.close()
        pre.close()
        server.close()


def test_poll_values_are_sglangs() -> None:
    from kvwire.session import KVPoll as Ours

    assert {p.name: int(p) for p in Ours} == {
        n: getattr(KVPoll, n)
        for n in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")
    }
    assert issubclass(KvwireKVSender, BaseKVSender)
    assert issubclass(KvwireKVReceiver, BaseKVReceiver)


def test_decode_abort_fails_both_sides(pair: tuple[KvwireKVManager, KvwireKVManager, str]) -> None:
    pre, dec, addr = pair
    rx = KvwireKVReceiver(dec, addr, 7)
    rx.init(0)
    rx.send_metadata(np.arange(3, dtype=np.int32), 1, None, decode_prefix_len=0)
    tx = KvwireKVSender(pre, addr, 7)
    assert wait(tx, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    tx.init(3, 1)
    rx.abort()
    assert wait(rx, DONE) == KVPoll.Failed
    assert wait(tx, DONE) == KVPoll.Failed
    with pytest.raises(Exception, match="abort"):
        tx.failure_exception()
    with pytest.raises(Exception, match="abort"):
        rx.failure_exception()
    wait(rx, DONE)
    deadline_ok = wait_quiesced(rx)
    assert deadline_ok and dec.is_abort_release_safe(7, 1)
    tx.clear()
    rx.clear()
    dec.clear_deferred_abort_state(7)


def wait_quiesced(rx: KvwireKVReceiver) -> bool:
    end = time.monotonic() + 10
    while not rx.is_abort_release_safe():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_prefill_abort_fails_decode(pair: tuple[KvwireKVManager, KvwireKVManager, str]) -> None:
    pre, dec, addr = pair
    rx = KvwireKVReceiver(dec, addr, 8)
    rx.init(0)
    rx.send_metadata(np.arange(2, dtype=np.int32), 2, None, decode_prefix_len=0)
    tx = KvwireKVSender(pre, addr, 8)
    wait(tx, (KVPoll.WaitingForInput,))
    tx.abort()
    assert wait(rx, DONE) == KVPoll.Failed
    with pytest.raises(Exception, match="abort"):
        rx.failure_exception()
    tx.clear()
    rx.clear()


def test_bad_decode_indices_fail_clearly(
    pair: tuple[KvwireKVManager, KvwireKVManager, str],
) -> None:
    """An out-of-range page: send_metadata returns (the scheduler keeps running), the request
    is Failed on decode and on prefill, and the error names the page and the pool size."""
    pre, dec, addr = pair
    rx = KvwireKVReceiver(dec, addr, 9)
    rx.init(0)
    tx = KvwireKVSender(pre, addr, 9)
    rx.send_metadata(np.array([1, SLOTS + 5], dtype=np.int32), 3, None, decode_prefix_len=0)
    assert wait(rx, DONE) == KVPoll.Failed
    with pytest.raises(Exception, match=str(SLOTS + 5)) as err:
        rx.failure_exception()
    assert str(SLOTS) in str(err.value)
    assert wait(tx, DONE, timeout=15) == KVPoll.Failed
    tx.clear()
    rx.clear()


def test_bad_prefill_indices_and_too_many_pages(
    pair: tuple[KvwireKVManager, KvwireKVManager, str],
) -> None:
    pre, dec, addr = pair
    cases = (  # a negative page; more pages than init() declared
        (10, [0, -1], r"out of range: values span \[-1, 0\]"),
        (11, [0, 1, 2], "add up to 3 pages but init\\(\\) declared 2"),
    )
    for room, pages, why in cases:
        rx = KvwireKVReceiver(dec, addr, room)
        rx.init(0)
        rx.send_metadata(np.array([4, 5], dtype=np.int32), 4, None, decode_prefix_len=0)
        tx = KvwireKVSender(pre, addr, room)
        wait(tx, (KVPoll.WaitingForInput,))
        tx.init(2, 4)
        tx.send(np.array(pages, dtype=np.int32), None)  # returns; the request fails
        assert wait(tx, DONE) == KVPoll.Failed
        with pytest.raises(Exception, match=why):
            tx.failure_exception()
        assert wait(rx, DONE) == KVPoll.Failed
        tx.clear()
        rx.clear()


def test_host_destination_refused(pair: tuple[KvwireKVManager, KvwireKVManager, str]) -> None:
    from sglang.srt.disaggregation.base.conn import KVTransferDestination

    _, dec, addr = pair
    rx = KvwireKVReceiver(dec, addr, 12)
    rx.init(0)
    rx.send_metadata(np.array([1]), 0, None, 0, destination=KVTransferDestination.HOST)
    assert rx.poll() == KVPoll.Failed
    with pytest.raises(Exception, match="destination"):
        rx.failure_exception()
    rx.clear()
    assert dec.supports_host_destination is False


def test_partial_failure_is_reported_in_the_abort_message(
    pair: tuple[KvwireKVManager, KvwireKVManager, str],
) -> None:
    """Prefill aborts after its first chunk landed: SGLang's decode cannot keep part of a
    load, so the failure message carries kvwire's report (what landed, what is missing)."""
    pre, dec, addr = pair
    rx = KvwireKVReceiver(dec, addr, 12)
    rx.init(0)
    rx.send_metadata(np.arange(4, dtype=np.int32) + 4, 5, None, decode_prefix_len=0)
    tx = KvwireKVSender(pre, addr, 12)
    wait(tx, (KVPoll.WaitingForInput,))
    tx.init(4, 5)
    assert rx.failure_report() is None
    tx.send(np.arange(2, dtype=np.int32), None)
    end = time.monotonic() + 10
    while sum(rx.rx._state.received.values()) < 1:  # the first chunk landed on decode
        assert time.monotonic() < end
        time.sleep(0.005)
    tx.abort()
    assert wait(rx, DONE) == KVPoll.Failed
    report = rx.failure_report()
    assert report is not None and report.cause == "prefill_aborted"
    assert report.good_pages.tolist() == [0, 1] and report.missing_slots.tolist() == [6, 7]
    with pytest.raises(Exception, match=r"abort.*kvwire failure report: prefill_aborted; 2 of 4"):
        rx.failure_exception()
    tx.clear()
    rx.clear()
