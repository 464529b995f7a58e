"""End to end across processes: SGLang-shaped prefill ranks (TP 2) and a decode rank (TP 1),
each its own spawned process with its own KV pool and ``KvwireKVManager``, SGLang's bootstrap
server object (kvwire's service) in the test process, kvwire's tcp backend. Decode's greedy
tokens must equal a single-process run's; a damaged page must change them."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from sgl_harness import KVH, LAYERS, PS, Cluster, Request, reference
from sglang.srt.disaggregation.base.conn import KVPoll

PROMPT = [3, 17, 5, 22, 9, 1, 30, 12, 7, 26, 14, 2, 19, 33, 8, 11, 4, 25]  # 18 tokens: 5 pages


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    mp = pytest.MonkeyPatch()
    mp.setenv("KVWIRE_TRANSFER_BACKEND", "tcp")
    mp.setenv("KVWIRE_CONTROL__HEARTBEAT_INTERVAL_S", "0.5")
    mp.setenv("KVWIRE_CONTROL__NUM_WORKERS", "1")
    mp.setenv("KVWIRE_SGLANG_KV_MEMORY", "dram")
    c = Cluster(prefill_tp=2, port=_port())
    try:
        yield c
    finally:
        c.close()
        mp.undo()


def test_heterogeneous_tp_chunked_prefill_tokens_match(cluster: Cluster) -> None:
    """Prefill TP 2 -> decode TP 1 (head slices gathered), prompt sent in chunks of 2 pages
    through send() without a last flag."""
    pre, dec = cluster.run(Request(room=101, prompt=PROMPT, n_gen=6, chunk_pages=2))
    assert [p["status"] for p in pre] == [KVPoll.Success, KVPoll.Success]
    assert dec["status"] == KVPoll.Success
    assert dec["tokens"] == reference(PROMPT, 6)
    # Each prefill rank moved its head (half a token row) of every page, K and V, plus aux.
    kv_bytes = 5 * PS * (KVH // 2) * 4 * 4 * 2 * LAYERS
    assert all(kv_bytes <= p["bytes"] < kv_bytes + 4096 for p in pre), pre


def test_prefix_cached_on_decode(cluster: Cluster) -> None:
    """Decode holds the first 2 pages (decode_prefix_len=8): they are not moved, yet the
    tokens are right."""
    pre, dec = cluster.run(Request(room=202, prompt=PROMPT, n_gen=6, cached_pages=2))
    assert dec["status"] == KVPoll.Success
    assert dec["tokens"] == reference(PROMPT, 6)
    kv_bytes = 3 * PS * (KVH // 2) * 4 * 4 * 2 * LAYERS  # 3 of 5 pages
    assert all(kv_bytes <= p["bytes"] < kv_bytes + 4096 for p in pre), pre


def test_negative_control_damaged_page_changes_tokens(cluster: Cluster) -> None:
    _, dec = cluster.run(Request(room=303, prompt=PROMPT, n_gen=6, corrupt=True))
    assert dec["status"] == KVPoll.Success
    assert dec["tokens"] != reference(PROMPT, 6)


def test_single_chunk_and_partial_last_page(cluster: Cluster) -> None:
    prompt = PROMPT[:13]  # 4 pages, the last one partial, one send
    _, dec = cluster.run(Request(room=404, prompt=prompt, n_gen=5, chunk_pages=8))
    assert dec["tokens"] == reference(prompt, 5)
