"""No ``kv_transfer_params`` can crash an instance: they are validated, and a bad one fails
only its request, with a message naming the field.

* ``kvwire_vllm.params`` on a table of malformed params (types, ranges, ``host:port``,
  unknown ``kvwire_*`` keys, non-dicts);
* the scheduler half built by vLLM's ``KVConnectorFactory`` over vLLM's ``KVCacheManager``
  and ``Request`` (``vllm_sched_rig``): a bad request takes the load-failure path; a
  hypothesis fuzz of random and hostile params on both roles proves no exception leaves
  ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta`` or
  ``request_finished`` and that every block is freed afterwards;
* the two-process harness (``vllm_pd_harness``, real workers and kvwire over tcp): bad params
  fail the decode request, release prefill's blocks, and the next request is served.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing as mp
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_pd_client import N_DECODE, Instance, idle, pd, prompt_of, wait_report
from vllm_pd_model import reference

from kvwire.testing.cluster import free_bootstrap_port
from kvwire_vllm.params import (
    Refusal,
    RemotePrefill,
    check_host_port,
    prompt_hash,
    read_decode_params,
    read_prefill_request,
)

pytestmark = pytest.mark.timeout(300)

GOOD: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "kvwire_room": 12345,
    "kvwire_bootstrap_addr": "127.0.0.1:8998",
    "remote_num_tokens": 10,
    "kvwire_block_size": 4,
    "kvwire_prompt_hash": prompt_hash(list(range(10))),
}


def _with(**changes: Any) -> dict[str, Any]:
    out = dict(GOOD)
    for k, v in changes.items():
        if v is _DROP:
            out.pop(k)
        else:
            out[k] = v
    return out


_DROP = object()


# ----------------------------------------------------------------------- the params alone
@pytest.mark.parametrize(
    "addr",
    ["127.0.0.1:8998", "[::1]:8998", "prefill-0.pd.svc.cluster.local:1", "host_1:65535"],
)
def test_good_bootstrap_addresses(addr: str) -> None:
    assert check_host_port(addr) == addr
    assert isinstance(read_decode_params(_with(kvwire_bootstrap_addr=addr)), RemotePrefill)


@pytest.mark.parametrize(
    ("addr", "why"),
    [
        ("127.0.0.1", "no port"),
        ("[::1]", "no port"),
        ("::1:8998", "brackets"),
        ("[::1:8998", "without ']'"),
        ("[1.2.3.4]:80", "not an IPv6"),
        ("host:0", "1..65535"),
        ("host:65536", "1..65535"),
        ("host:http", "1..65535"),
        ("host:+80", "1..65535"),
        ("host:\uff18\uff10", "1..65535"),
        (":80", "no host"),
        ("bad host:80", "not a hostname"),
    ],
)
def test_bad_bootstrap_addresses_are_named(addr: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
        check_host_port(addr)
    got = read_decode_params(_with(kvwire_bootstrap_addr=addr))
    assert isinstance(got, Refusal)
    assert "kvwire_bootstrap_addr" in got.reason and why in got.reason, got.reason


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (_with(kvwire_room="not-an-int"), "kvwire_room"),
        (_with(kvwire_room=-1), "kvwire_room"),
        (_with(kvwire_room=2**63), "kvwire_room"),
        (_with(kvwire_room=1.0), "kvwire_room"),
        (_with(kvwire_room=True), "kvwire_room"),
        (_with(kvwire_room=_DROP), "kvwire_room"),
        (_with(kvwire_bootstrap_addr=_DROP), "kvwire_bootstrap_addr"),
        (_with(kvwire_bootstrap_addr=8998), "kvwire_bootstrap_addr"),
        (_with(remote_num_tokens="10"), "remote_num_tokens"),
        (_with(remote_num_tokens=0), "remote_num_tokens"),
        (_with(remote_num_tokens=10**12), "remote_num_tokens"),
        (_with(remote_num_tokens=_DROP), "remote_num_tokens"),
        (_with(do_remote_prefill="yes"), "do_remote_prefill"),
        (_with(do_remote_prefill=1), "do_remote_prefill"),
        (_with(do_remote_decode=None), "do_remote_decode"),
        (_with(kvwire_block_size=0), "kvwire_block_size"),
        (_with(kvwire_from_the_future=1), "kvwire_from_the_future"),
        (_with(kvwire_prompt_hash="xyz"), "kvwire_prompt_hash"),
        (_with(kvwire_prompt_hash=12), "kvwire_prompt_hash"),
        (_with(kvwire_prompt_hash=_DROP), "kvwire_prompt_hash"),
    ],
)
def test_malformed_decode_params_are_refused_naming_the_field(
    params: dict[str, Any], field: str
) -> None:
    got = read_decode_params(params)
    assert isinstance(got, Refusal), got
    assert field in got.reason, got.reason
    # the room and address, when they are valid on their own, still name prefill's blocks
    if field not in ("kvwire_room", "kvwire_bootstrap_addr"):
        assert got.target == (12345, "127.0.0.1:8998")
    else:
        assert got.target is None


@pytest.mark.parametrize(
    "params",
    [
        None,
        {},
        [],
        "kvwire_room",
        42,
        _with(do_remote_prefill=False),  # registered already (vLLM re-entry after preemption)
        {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1]},  # NIXL's
    ],
)
def test_params_that_are_not_a_kvwire_load_are_left_alone(params: Any) -> None:
    assert read_decode_params(params) is None


def test_prefill_request_params() -> None:
    ok = read_prefill_request({"do_remote_decode": True})
    assert ok is not None and not isinstance(ok, Refusal) and ok.do_remote_decode
    assert read_prefill_request(None) is None and read_prefill_request({"x": 1}) is None
    bad = read_prefill_request({"do_remote_decode": "true"})
    assert isinstance(bad, Refusal) and "do_remote_decode" in bad.reason
    bad = read_prefill_request({"do_remote_decode": True, "kvwire_nope": 3})
    assert isinstance(bad, Refusal) and "kvwire_nope" in bad.reason


# --------------------------------------------------- the scheduler half on vLLM's classes
@pytest.fixture(scope="module")
def rigs() -> dict[str, Any]:
    from vllm_sched_rig import Rig

    return {"prefill": Rig("prefill"), "decode": Rig("decode")}


def _finished_status(name: str) -> Any:
    from vllm.v1.request import RequestStatus

    return getattr(RequestStatus, name)


def test_bad_params_take_the_load_failure_path(
    rigs: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """``"kvwire_room": "not-an-int"`` (the issue's crash): decode answers "load
    asynchronously", then queues a failure for the workers naming the field, and a release
    of prefill's blocks is impossible (no valid room) — nothing raises."""
    rig = rigs["decode"]
    prompt = list(range(10))
    with caplog.at_level(logging.ERROR, logger="kvwire_vllm"):
        got = rig.admit("bad-room", prompt, _with(kvwire_room="not-an-int"))
    assert (got.external, got.is_async) == (10, True)
    meta = got.meta
    assert not meta.recvs and len(meta.fails) == 1
    fail = meta.fails[0]
    assert fail.req_id == "bad-room" and "kvwire_room" in fail.reason
    assert len(fail.block_ids) == 3  # the blocks the load would have filled
    assert any(
        "bad-room" in r.getMessage() and "kvwire_room" in r.getMessage() for r in caplog.records
    )
    rig.release(got.request)


def test_bad_token_count_still_releases_prefill(rigs: dict[str, Any]) -> None:
    rig = rigs["decode"]
    got = rig.admit("bad-count", list(range(10)), _with(remote_num_tokens="10"))
    assert [f.req_id for f in got.meta.fails] == ["bad-count"]
    assert "remote_num_tokens" in got.meta.fails[0].reason
    (rel,) = got.meta.recvs  # an empty receive tells prefill to free its blocks
    assert (rel.room, rel.bootstrap_addr, rel.block_ids, rel.report) == (
        12345,
        "127.0.0.1:8998",
        [],
        False,
    )
    rig.release(got.request)


def test_good_params_queue_a_receive(rigs: dict[str, Any]) -> None:
    rig = rigs["decode"]
    prompt = list(range(100, 110))
    got = rig.admit("good", prompt, {**GOOD, "kvwire_prompt_hash": prompt_hash(prompt)})
    assert (got.external, got.is_async) == (10, True) and not got.meta.fails
    (recv,) = got.meta.recvs
    assert (recv.room, recv.report, len(recv.block_ids)) == (12345, True, 3)
    assert got.request.kv_transfer_params["do_remote_prefill"] is False
    rig.release(got.request)


def test_kv_of_another_prompt_is_refused_naming_both_hashes(rigs: dict[str, Any]) -> None:
    """Prefill computed prompt A; the router sends decode prompt B (same length) with A's
    params: decode refuses the KV before any transfer (a failure, and a release of
    prefill's blocks), naming both hashes."""
    a, b = list(range(300, 312)), list(range(400, 412))
    pre = rigs["prefill"].admit("hash-a", a, {"do_remote_decode": True})
    delay, params = rigs["prefill"].finish(pre.request, _finished_status("FINISHED_STOPPED"))
    assert delay is True and params is not None
    assert params["kvwire_prompt_hash"] == prompt_hash(a) != prompt_hash(b)
    rigs["prefill"].conn.build_connector_meta(None)
    rigs["prefill"].conn.update_connector_output(_Out({"hash-a"}, set()))
    rigs["prefill"].release(pre.request)
    got = rigs["decode"].admit("hash-b", b, params)
    (fail,) = got.meta.fails
    assert prompt_hash(a) in fail.reason and prompt_hash(b) in fail.reason, fail.reason
    assert [r.report for r in got.meta.recvs] == [False]  # only the release
    rigs["decode"].release(got.request)
    ok = rigs["decode"].admit("hash-a-ok", a, dict(params, do_remote_prefill=True))
    assert not ok.meta.fails and [r.report for r in ok.meta.recvs] == [True]
    rigs["decode"].release(ok.request)


def test_malformed_prefill_request_is_computed_but_not_pushed(rigs: dict[str, Any]) -> None:
    rig = rigs["prefill"]
    got = rig.admit("pre-bad", list(range(200, 209)), {"do_remote_decode": "yes"})
    assert (got.external, got.is_async) == (0, False)
    delay, params = rig.finish(got.request, _finished_status("FINISHED_LENGTH_CAPPED"))
    assert (delay, params) == (False, None)
    assert rig.conn.build_connector_meta(None).empty()


# Hostile values: every JSON type and then some, addresses that almost parse.
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24),
    st.binary(max_size=6),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.builds(
        lambda h, p: f"{h}:{p}",
        st.sampled_from(["127.0.0.1", "[::1]", "::1", "localhost", "", "a b", "[x]", "h"]),
        st.integers(min_value=-5, max_value=70_000),
    ),
)
_KEYS = st.one_of(
    st.sampled_from(
        [*GOOD, "kvwire_", "kvwire_x", "remote_engine_id", "KVWIRE_ROOM", "do_remote_prefil"]
    ),
    st.text(max_size=12),
)
#: Params near the real ones (each field kept, replaced or dropped, extra keys added), and
#: random dicts and non-dicts.
_PARAMS = st.one_of(
    st.builds(
        lambda base, extra: {**extra, **base},
        st.fixed_dictionaries(
            {}, optional={k: st.one_of(st.just(v), _VALUES) for k, v in GOOD.items()}
        ),
        st.dictionaries(_KEYS, _VALUES, max_size=3),
    ),
    st.dictionaries(_KEYS, _VALUES, max_size=8),
    _VALUES,
)


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    params=_PARAMS,
    n=st.integers(min_value=1, max_value=40),
    status=st.sampled_from(["FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED", "FINISHED_ABORTED"]),
    abort_early=st.booleans(),
)
def test_fuzz_no_params_escape_the_scheduler_half(
    rigs: dict[str, Any], params: Any, n: int, status: str, abort_early: bool
) -> None:
    """Random and hostile params on both roles: no exception leaves the connector's
    scheduler methods, what it queues for the workers is well-formed, a kvwire load with
    unusable params is failed (never loaded), and every block is free again afterwards."""
    prompt = [(7 * i + n) % 50 for i in range(n)]
    for role, rig in rigs.items():
        rid = f"fuzz-{role}-{time.monotonic_ns()}"
        free_before = rig.kvm.block_pool.get_num_free_blocks()
        _fuzz_one(rig, role, rid, prompt, copy.deepcopy(params), status, abort_early)
        assert not rig.conn.has_pending_push_work()
        assert rig.kvm.block_pool.get_num_free_blocks() == free_before


def _fuzz_one(
    rig: Any, role: str, rid: str, prompt: list[int], params: Any, status: str, abort: bool
) -> None:
    n = len(prompt)
    if isinstance(params, dict):  # GOOD's values made to fit this prompt, when kept
        if params.get("kvwire_prompt_hash") == GOOD["kvwire_prompt_hash"]:
            params["kvwire_prompt_hash"] = prompt_hash(prompt)
        if params.get("remote_num_tokens") == GOOD["remote_num_tokens"]:
            params["remote_num_tokens"] = n
    verdict = read_decode_params(params) if role == "decode" else None
    got = rig.admit(rid, prompt, params)
    try:
        meta = got.meta
        for r in meta.recvs:  # what the workers would act on is valid
            assert isinstance(r.room, int) and 0 <= r.room < 2**63
            check_host_port(r.bootstrap_addr)
        if role == "prefill" or verdict is None:
            assert (got.external, got.is_async) == (0, False)
            assert meta.empty()
        else:
            assert (got.external, got.is_async) == (n - got.local, True)
            usable = (
                isinstance(verdict, RemotePrefill)
                and verdict.remote_num_tokens == n
                and verdict.kvwire_prompt_hash == prompt_hash(prompt)
            )
            assert [r.report for r in meta.recvs if r.report] == ([True] if usable else [])
            assert [f.req_id for f in meta.fails] == ([] if usable else [rid])
        if role == "decode" and got.is_async:
            if abort:  # the client goes away while the KV arrives
                rig.finish(got.request, _finished_status("FINISHED_ABORTED"))
                assert rig.conn.build_connector_meta(None).aborts == [rid]
            rig.conn.update_connector_output(_Out(set(), {rid}))
            if not abort:
                rig.finish(got.request, _finished_status(status))
        else:
            delay, out = rig.finish(got.request, _finished_status(status))
            if out is not None:
                assert delay is True and role == "prefill"
                assert isinstance(read_decode_params(out), RemotePrefill)
                (send,) = rig.conn.build_connector_meta(None).sends
                assert send.req_id == rid
                rig.conn.update_connector_output(_Out({rid}, set()))
            else:
                assert delay is False
        rig.conn.build_connector_meta(None)
    finally:
        rig.release(got.request)  # idempotent: what vLLM frees once the workers report


@dataclass
class _Out:
    """The reduced worker report ``update_connector_output`` reads."""

    finished_sending: set[str]
    finished_recving: set[str]


# ----------------------------------------------------- two processes, real kvwire workers
@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Instance, Instance]]:
    ctx = mp.get_context("spawn")
    # beats every 2 s (eviction after 6 s; nothing here tests eviction by silence): with 0.5 s
    # beats a prefill process whose threads all stalled for 1.5-2.6 s beside two busy loops
    # (10 engines' threads in one process) was evicted, and a room failed by that silent loss
    # is held for the transfer timeout (61 s: its writes may still land), longer than a test
    # waits; 0.2 s beats evicted live peers at load 15-20 on 2 cores
    control = {"heartbeat_interval_s": 2.0, "bootstrap_timeout_s": 20}
    port = free_bootstrap_port("127.0.0.1", [])
    pre = {
        "nhd": {
            "layout": "LBNHC",
            "extra": {"transfer_backend": "tcp", "bootstrap_port": port, "control": control},
        }
    }
    dec = {"nhd": {"layout": "LBNHC", "extra": {"transfer_backend": "tcp", "control": control}}}
    p, d = Instance(ctx, "prefill", pre), Instance(ctx, "decode", dec)
    try:
        p.ready()
        d.ready()
        yield p, d
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kvwire_room": "not-an-int"}, "kvwire_room"),
        ({"kvwire_bootstrap_addr": "127.0.0.1"}, "kvwire_bootstrap_addr"),
        ({"remote_num_tokens": None}, "remote_num_tokens"),
        ({"kvwire_surprise": 1}, "kvwire_surprise"),
    ],
    ids=["room-not-int", "addr-no-port", "tokens-none", "unknown-key"],
)
def test_bad_params_fail_the_request_and_the_instance_serves_on(
    cluster: tuple[Instance, Instance], change: dict[str, Any], field: str
) -> None:
    p, d = cluster
    prompt = prompt_of(hash(field) % 1000, 14)
    rid = f"bad-{field}"
    pre = p.call("nhd", "prefill", rid=rid, prompt=prompt)
    bad = {**pre["params"], **change}
    t0 = time.monotonic()
    d.call("nhd", "decode", rid=rid, prompt=prompt, params=bad, n=N_DECODE)
    rep = wait_report(d, "nhd", rid, "failed", timeout=10)
    assert rep["failed"] is True and rep["invalid_blocks"]
    err = d.call("nhd", "status")["errors"][rid]
    assert field in err, err
    if field in ("kvwire_room", "kvwire_bootstrap_addr"):
        # decode cannot name prefill's room: prefill frees it at its bootstrap timeout;
        # release it here with the real params (the rest of the module needs it idle)
        d.call("nhd", "decode", rid=rid + "-rel", prompt=prompt, params=pre["params"], n=1)
        assert wait_report(d, "nhd", rid + "-rel", "failed")["failed"] is False
    else:
        assert wait_report(p, "nhd", rid, "sent", timeout=5)["sent"] is True
        assert time.monotonic() - t0 < 5
    for inst in cluster:
        idle(inst, "nhd")
    ok_prompt = prompt_of(999, 17)
    _, ok = pd(cluster, "nhd", rid + "-next", ok_prompt)
    assert ok["failed"] is False and ok["tokens"] == reference(ok_prompt, N_DECODE)


def test_a_room_prefill_does_not_hold_fails_fast_naming_it(
    cluster: tuple[Instance, Instance],
) -> None:
    """Decode given a room this prefill instance served already (replayed params) or never
    issued (another instance's room): prefill answers at once that it does not hold it, and
    the request fails within a couple of seconds (it used to wait decode's 60 s waiting
    timeout), naming the room."""
    p, d = cluster
    prompt = prompt_of(61, 12)
    pre, ok = pd(cluster, "nhd", "room-served", prompt)
    assert ok["failed"] is False
    assert wait_report(p, "nhd", "room-served", "sent")["sent"] is True
    room = pre["params"]["kvwire_room"]
    cases = [
        ("room-replayed", room, "served or released"),
        ("room-foreign", room ^ (1 << 61), "never issued"),
    ]
    for rid, bad_room, why in cases:
        t0 = time.monotonic()
        params = {**pre["params"], "kvwire_room": bad_room}
        d.call("nhd", "decode", rid=rid, prompt=prompt, params=params, n=N_DECODE)
        rep = wait_report(d, "nhd", rid, "failed", timeout=30)
        took = time.monotonic() - t0
        assert rep["failed"] is True
        assert took < 5.0, took
        err = d.call("nhd", "status")["errors"][rid]
        assert f"does not hold room {bad_room}" in err and why in err, err
    for inst in cluster:
        idle(inst, "nhd")


def test_kv_of_another_prompt_fails_the_request_before_any_transfer(
    cluster: tuple[Instance, Instance],
) -> None:
    """Two processes: decode's request for prompt B carries prompt A's params (same length):
    it fails naming both hashes, prefill's blocks are released at once, nothing is moved."""
    p, d = cluster
    a, b = prompt_of(71, 13), prompt_of(72, 13)
    pre = p.call("nhd", "prefill", rid="pair-a", prompt=a)
    t0 = time.monotonic()
    d.call("nhd", "decode", rid="pair-b", prompt=b, params=pre["params"], n=N_DECODE)
    rep = wait_report(d, "nhd", "pair-b", "failed", timeout=10)
    assert rep["failed"] is True and "tokens" not in rep
    err = d.call("nhd", "status")["errors"]["pair-b"]
    assert prompt_hash(a) in err and prompt_hash(b) in err, err
    assert wait_report(p, "nhd", "pair-a", "sent", timeout=10)["sent"] is True
    assert time.monotonic() - t0 < 5
    for inst in cluster:
        idle(inst, "nhd")


def test_prefill_advertises_a_valid_bootstrap_address() -> None:
    """What prefill writes into the params passes decode's check: an IPv6 host gets its
    brackets; a bad operator setting is refused at startup, not on every request."""
    from kvwire.errors import ConfigError
    from kvwire_vllm.config import bootstrap_address, parse_extra_config

    opts, cfg = parse_extra_config({"advertise_host": "::1", "bootstrap_port": 9000})
    assert bootstrap_address(opts, cfg) == "[::1]:9000"
    opts, cfg = parse_extra_config({"advertise_host": "prefill 0"})
    with pytest.raises(ConfigError, match="advertise_host"):
        bootstrap_address(opts, cfg)
    with pytest.raises(ConfigError, match="bootstrap_addr"):
        parse_extra_config({"bootstrap_addr": "10.0.0.1"})
