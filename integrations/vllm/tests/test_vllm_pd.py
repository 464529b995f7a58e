"""Prefill -> decode through ``KVWireConnector`` across two processes, checked by computation.

One prefill process and one decode process (spawned) each host three vLLM "instances" that
differ in the KV cache layout vLLM resolved (``LBNHC`` = NHD, ``LBHNC`` = HND, and the
block-major ``BLHNC``) over kvwire's ``tcp`` backend, plus one ``LBNHC`` instance over
``nixl`` (chosen through ``kv_connector_extra_config``), each with its own connector halves
and kvwire manager; see ``vllm_pd_harness``. Decode's greedy tokens must equal a single-process
run of the same random-weight GQA model (``vllm_pd_model.reference``), which holds only if
every K/V element of the prompt arrived in the right block, head and token.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator

import pytest
from vllm_pd_client import N_DECODE, Instance, idle, pd, prompt_of, wait_report
from vllm_pd_model import reference

from kvwire.testing.cluster import free_bootstrap_port
from kvwire_vllm.rooms import SEQ_BITS

pytestmark = pytest.mark.timeout(240)

#: engine name -> (vLLM KV cache layout of prefill, of decode, kvwire backend, prefill TP,
#: decode TP). Layer-major pools are described with their heads (``kv_pool: heads``), so the
#: two instances may differ in TP and page order; the block-major one moves whole blocks.
ENGINES = {
    "nhd": ("LBNHC", "LBNHC", "tcp", 1, 1),
    "hnd": ("LBHNC", "LBHNC", "tcp", 1, 1),
    "blk": ("BLHNC", "BLHNC", "tcp", 1, 1),
    "nixl": ("LBNHC", "LBNHC", "nixl", 1, 1),
    "tp2": ("LBNHC", "LBNHC", "tcp", 2, 2),
    "gather": ("LBNHC", "LBNHC", "tcp", 2, 1),
    "scatter-hnd": ("LBHNC", "LBHNC", "tcp", 1, 2),
    "nhd-to-hnd": ("LBNHC", "LBHNC", "nixl", 2, 1),
    "blocks-4to8": ("LBNHC", "LBHNC", "tcp", 2, 1),
    "blocks-8to4": ("LBHNC", "LBNHC", "tcp", 1, 2),
    "bulk-gather-hnd": ("LBNHC", "LBHNC", "tcp", 2, 1),
}
#: kvwire staging where not the default: bulk staging through the connector, which hands
#: kvwire no KV tensors (the strategy views the layout's buffers by address)
STAGING = {"bulk-gather-hnd": "bulk"}
#: vLLM block size (tokens) of prefill and decode where not 4 (kvwire moves token ranges)
BLOCKS = {"blocks-4to8": (4, 8), "blocks-8to4": (8, 4)}


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Instance, Instance]]:
    ctx = mp.get_context("spawn")
    # beats every 2 s (eviction after 6 s; nothing here tests eviction by silence): with 0.5 s
    # beats a prefill process whose threads all stalled for 1.5-2.6 s beside two busy loops
    # (10 engines' threads in one process) was evicted, and a room failed by that silent loss
    # is held for the transfer timeout (61 s: its writes may still land), longer than a test
    # waits; 0.2 s beats evicted live peers at load 15-20 on 2 cores
    control = {"heartbeat_interval_s": 2.0, "bootstrap_timeout_s": 20}
    # bootstrap ports outside the ephemeral range, distinct: a port picked in the ephemeral
    # range here can be taken by another process's socket before the engine binds it
    ports: list[int] = []
    for _ in ENGINES:
        ports.append(free_bootstrap_port("127.0.0.1", ports))
    pre = {
        name: {
            "layout": lay,
            "tp": tp,
            "block": BLOCKS.get(name, (4, 4))[0],
            "extra": {
                "transfer_backend": be,
                "bootstrap_port": port,
                "control": control,
                "staging": STAGING.get(name, "direct"),
            },
        }
        for port, (name, (lay, _, be, tp, _)) in zip(ports, ENGINES.items(), strict=True)
    }
    dec = {
        name: {
            "layout": lay,
            "tp": tp,
            "block": BLOCKS.get(name, (4, 4))[1],
            "extra": {
                "transfer_backend": be,
                "control": control,
                "staging": STAGING.get(name, "direct"),
            },
        }
        for name, (_, lay, be, _, tp) in ENGINES.items()
    }
    p, d = Instance(ctx, "prefill", pre), Instance(ctx, "decode", dec)
    try:
        for inst in (p, d):
            pools = inst.ready()  # engine -> the worker's pool summary
            for name, summary in pools.items():
                heads = ENGINES[name][0] != "BLHNC"  # layer-major: described with heads
                assert ("K|V rows" in summary) == heads, (name, summary)
        yield p, d
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize("engine", list(ENGINES))
def test_decode_tokens_equal_single_process(
    cluster: tuple[Instance, Instance], engine: str
) -> None:
    for i, n in enumerate((13, 16, 29)):  # partial last block, whole blocks, several blocks
        prompt = prompt_of(100 + i, n)
        want = reference(prompt, N_DECODE)
        pre, rep = pd(cluster, engine, f"{engine}-ok-{i}", prompt)
        assert pre["params"]["remote_num_tokens"] == n
        assert pre["first"] == want[0]
        assert rep["failed"] is False and rep["external"] == n and rep["local_hit"] == 0
        assert rep["tokens"] == want, (engine, n)
    for inst, tp in zip(cluster, ENGINES[engine][3:], strict=True):
        st = idle(inst, engine)
        assert st["backend"] == ENGINES[engine][2]
        assert st["ranks"] == list(range(tp))
    if engine in STAGING:  # the chunks went through decode's staging ring
        assert idle(cluster[1], engine)["staged_chunks"] >= 3, engine


def test_corrupted_kv_changes_tokens(cluster: tuple[Instance, Instance]) -> None:
    """Negative control: the same run with decode's received KV damaged must not match."""
    prompt = prompt_of(7, 21)
    _, rep = pd(cluster, "nhd", "nhd-corrupt", prompt, corrupt=True)
    assert rep["failed"] is False
    assert rep["tokens"] != reference(prompt, N_DECODE)


def test_prefix_cached_on_decode_moves_only_the_rest(cluster: tuple[Instance, Instance]) -> None:
    """Decode already holds the first 3 blocks (12 tokens) of the second prompt: it asks for
    the rest only, into the blocks after them, and still decodes the reference tokens."""
    shared = prompt_of(11, 12)
    first, second = shared + prompt_of(12, 9), shared + prompt_of(13, 7)
    _, rep1 = pd(cluster, "blk", "blk-prefix-a", first)
    assert rep1["tokens"] == reference(first, N_DECODE)
    _, rep2 = pd(cluster, "blk", "blk-prefix-b", second)
    assert rep2["local_hit"] == 12 and rep2["external"] == len(second) - 12
    assert rep2["tokens"] == reference(second, N_DECODE)


def test_bad_prefill_block_ids_fail_the_request_on_both_sides(
    cluster: tuple[Instance, Instance],
) -> None:
    p, d = cluster
    prompt = prompt_of(21, 14)
    pre = p.call("hnd", "prefill", rid="hnd-badp", prompt=prompt, bad_blocks=True)
    d.call("hnd", "decode", rid="hnd-badp", prompt=prompt, params=pre["params"], n=N_DECODE)
    rep = wait_report(d, "hnd", "hnd-badp", "failed")
    assert rep["failed"] is True
    assert rep["invalid_blocks"], "the failed request's blocks must be reported as load errors"
    err = p.call("hnd", "status")["errors"]["hnd-badp"]
    assert "DescriptorError" in err and str(48 + 3) in err, err
    assert wait_report(p, "hnd", "hnd-badp", "sent")["sent"] is True  # prefill freed it
    for inst in cluster:
        idle(inst, "hnd")


def test_bad_decode_block_ids_fail_the_request(cluster: tuple[Instance, Instance]) -> None:
    p, d = cluster
    prompt = prompt_of(31, 10)
    pre = p.call("nhd", "prefill", rid="nhd-badd", prompt=prompt)
    d.call(
        "nhd",
        "decode",
        rid="nhd-badd",
        prompt=prompt,
        params=pre["params"],
        n=N_DECODE,
        bad_blocks=True,
    )
    rep = wait_report(d, "nhd", "nhd-badd", "failed")
    assert rep["failed"] is True
    err = d.call("nhd", "status")["errors"]["nhd-badd"]
    assert "-1" in err, err
    assert wait_report(p, "nhd", "nhd-badd", "sent")["sent"] is True
    for inst in cluster:
        idle(inst, "nhd")


def test_abort_while_receiving_frees_blocks_only_when_reported(
    cluster: tuple[Instance, Instance],
) -> None:
    """A decode request whose prefill does not push (a room this prefill instance may still
    issue, far ahead of its latest: kept as an early request) is aborted by the client: vLLM
    holds its blocks until the connector reports it, which it does once no prefill write can
    land; then every block is free again."""
    p, d = cluster
    prompt = prompt_of(41, 18)
    pre = p.call("blk", "prefill", rid="blk-abort-src", prompt=prompt)
    room = pre["params"]["kvwire_room"]
    ahead = (room >> SEQ_BITS) << SEQ_BITS | (room + 10**6) % (1 << SEQ_BITS)
    params = dict(pre["params"], kvwire_room=ahead)
    d.call("blk", "decode", rid="blk-abort", prompt=prompt, params=params, n=N_DECODE)
    deadline = time.monotonic() + 30  # by its state, not a guessed 0.3 s
    while True:
        st = d.call("blk", "status")
        if st["free_blocks"] < st["free0"] and "blk-abort" in st["waiting"]:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    d.call("blk", "abort", rid="blk-abort")
    rep = wait_report(d, "blk", "blk-abort", "abort_reported")
    assert "failed" not in rep and "tokens" not in rep
    idle(d, "blk")
    # The real request's room was never asked for: prefill still holds its blocks until
    # its bootstrap timeout fails the room (20 s here); abort it from decode's side instead.
    d.call("blk", "decode", rid="blk-abort-src", prompt=prompt, params=pre["params"], n=1)
    assert wait_report(d, "blk", "blk-abort-src", "failed")["failed"] is False
    for inst in cluster:
        idle(inst, "blk")


def test_prompt_mismatch_fails_the_load_and_releases_prefill(
    cluster: tuple[Instance, Instance],
) -> None:
    """Decode gets params for a prompt of another length: it refuses that KV through vLLM's
    load-failure path (reported failed at the next step, its blocks as load errors; the
    harness applies kv_load_failure_policy="fail"), naming both lengths, and still tells
    prefill, which holds the blocks for it, to free them at once (an empty receive), long
    before prefill's 20 s bootstrap timeout would. The next request is served."""
    p, d = cluster
    prompt = prompt_of(51, 15)
    pre = p.call("nhd", "prefill", rid="nhd-mismatch", prompt=prompt)
    longer = [*prompt, 5]
    t0 = time.monotonic()
    d.call("nhd", "decode", rid="nhd-mismatch", prompt=longer, params=pre["params"], n=N_DECODE)
    rep = wait_report(d, "nhd", "nhd-mismatch", "failed", timeout=5)
    assert rep["async"] is True and rep["failed"] is True and "tokens" not in rep
    assert rep["invalid_blocks"], "the refused load's blocks are reported as load errors"
    err = d.call("nhd", "status")["errors"]["nhd-mismatch"]
    assert "15 prompt tokens" in err and "has 16" in err, err
    assert wait_report(p, "nhd", "nhd-mismatch", "sent", timeout=5)["sent"] is True
    assert time.monotonic() - t0 < 5
    for inst in cluster:
        idle(inst, "nhd")
    _, ok = pd(cluster, "nhd", "nhd-after-mismatch", longer)
    assert ok["failed"] is False and ok["tokens"] == reference(longer, N_DECODE)
