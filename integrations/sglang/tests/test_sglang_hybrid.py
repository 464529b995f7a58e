"""A hybrid / speculative model end to end through kvwire-sglang's classes, across processes:
SGLang-shaped prefill ranks (TP 2) and a decode rank (TP 1) fill SGLang's ``KVArgs`` with the
full-attention KV, the draft model's KV and Mamba state (plus an SWA pool in mode "swa"),
as SGLang 0.5.23 lays them out (see ``sgl_hybrid``). Decode's greedy tokens must equal a
single-process run's; damaging a moved state slot, draft page or window page must change them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest
from sgl_hybrid import SPEC, HybridCluster, Request, Setup
from sglang.srt.disaggregation.base.conn import KVPoll

from kvwire.testing.hybrid import conv_sections
from kvwire.testing.hybrid_model import reference_tokens

PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, SPEC.vocab, 15)]  # 4 pages
N_GEN = 5


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster() -> Iterator[HybridCluster]:
    mp = pytest.MonkeyPatch()
    mp.setenv("KVWIRE_CONTROL__HEARTBEAT_INTERVAL_S", "0.5")
    mp.setenv("KVWIRE_CONTROL__NUM_WORKERS", "1")
    mp.setenv("KVWIRE_CONTROL__BOOTSTRAP_TIMEOUT_S", "10")
    mp.setenv("KVWIRE_SGLANG_KV_MEMORY", "dram")
    c = HybridCluster(prefill_tp=2, decode_tp=1)
    try:
        yield c
    finally:
        c.close()
        mp.undo()


MAMBA_TCP = Setup(backend="tcp", mode="mamba", port=_port())
SWA_TCP = Setup(backend="tcp", mode="swa", port=_port())
SWA_NIXL = Setup(backend="nixl", mode="swa", port=_port())
OPAQUE_DRAFT = Setup(backend="tcp", mode="mamba", draft_facts=False, port=_port())
REF = reference_tokens(SPEC, PROMPT, N_GEN)


def _ok(cluster: HybridCluster, setup: Setup, req: Request) -> list[int]:
    pre, dec = cluster.run(setup, req)
    assert [p["status"] for p in pre] == [KVPoll.Success] * 2, pre
    assert dec[0]["status"] == KVPoll.Success, dec
    tokens: list[int] = dec[0]["tokens"]
    return tokens


def test_mamba_draft_tp2_to_tp1_chunked(cluster: HybridCluster) -> None:
    """Mamba conv/SSM state split by heads (state_dim_per_tensor), the GDN conv state's q, k
    and v blocks each gathered on its own (state_conv_shard_groups), the delta-rule state, and
    the draft KV, from two prefill ranks into one decode rank; chunks of 1 and of 2 pages."""
    assert _ok(cluster, MAMBA_TCP, Request(room=11, prompt=PROMPT, chunk_pages=2)) == REF
    assert _ok(cluster, MAMBA_TCP, Request(room=12, prompt=PROMPT, chunk_pages=1)) == REF


@pytest.mark.parametrize("what", ["state", "draft", "sections"])
def test_mamba_negative_controls(cluster: HybridCluster, what: str) -> None:
    """A Mamba state slot, a draft page, or the v section of the GDN conv state (moved from
    state_conv_shard_groups as kvwire sections) damaged on decode after the transfer: other
    tokens (so the tokens above depend on the bytes kvwire moved)."""
    req = Request(room=20 + len(what), prompt=PROMPT, corrupt=what)
    assert _ok(cluster, MAMBA_TCP, req) != REF


def test_swa_window_and_mamba_tp2_to_tp1(cluster: HybridCluster) -> None:
    """SGLang's SWA pool as a kvwire window group (only the window's pages move) beside the
    Mamba state; a damaged window page changes the tokens."""
    assert _ok(cluster, SWA_TCP, Request(room=31, prompt=PROMPT, chunk_pages=3)) == REF
    assert _ok(cluster, SWA_TCP, Request(room=32, prompt=PROMPT, corrupt="window")) != REF


def test_swa_mamba_draft_over_nixl(cluster: HybridCluster) -> None:
    assert _ok(cluster, SWA_NIXL, Request(room=41, prompt=PROMPT)) == REF
    assert _ok(cluster, SWA_NIXL, Request(room=42, prompt=PROMPT, corrupt="state")) != REF


def test_opaque_draft_with_tp_mismatch_is_refused_naming_it(cluster: HybridCluster) -> None:
    """Without the draft's head facts the draft KV is opaque pages, which need equal TP: prefill
    TP 2 -> decode TP 1 fails on both sides at handshake, naming the group."""
    pre, dec = cluster.run(OPAQUE_DRAFT, Request(room=51, prompt=PROMPT))
    assert dec[0]["status"] == KVPoll.Failed
    assert "group 'draft'" in dec[0]["error"], dec[0]["error"]
    assert all(p["status"] == KVPoll.Failed for p in pre), pre


def test_groups_built_from_kvargs_and_bytes_moved(cluster: HybridCluster) -> None:
    """What the conversion made of SGLang's fields, on each side, and the exact bytes each
    prefill rank moved: its head of every KV/draft page, the window's pages only, its heads of
    the Mamba state; the replicated conv state and the aux row once (by one rank)."""
    pre, dec = cluster.run(SWA_TCP, Request(room=61, prompt=PROMPT))
    for side, tp in ((pre[0], 2), (dec[0], 1)):
        assert side["backend"] == "tcp"
        assert side["groups"] == {
            "draft": ("paged", "heads", SPEC.kv_heads, "pages"),
            "swa0": ("window", "heads", SPEC.kv_heads, "state0"),
            "mamba1_0": ("state", "heads", SPEC.mamba_heads, "state1"),  # conv_x
            "mamba1_1": ("state", "replicated", 1, "state1"),  # conv_bc (dim 0)
            "mamba1_2": ("state", "heads", SPEC.mamba_heads, "state1"),  # ssm
            "mamba2_0": ("state", "heads", 1, "state2"),  # GDN conv: q, k, v sections
            "mamba2_1": ("state", "heads", SPEC.gdn_v_heads, "state2"),  # delta state
        }, (side["groups"], tp)
    page_head = SPEC.page_size * SPEC.head_dim * 4  # one KV head of one page, float32
    pages, window_pages = 4, 2  # 15 tokens; the window (6) starts in page 2
    kv = pages * 2 * 2 * page_head  # attn0, attn1: K and V, one of 2 heads per rank
    draft = pages * 2 * page_head
    window = window_pages * 2 * page_head
    k1 = SPEC.conv_k - 1
    conv_x = (SPEC.mamba_heads // 2) * k1 * SPEC.mamba_p * 4
    ssm = (SPEC.mamba_heads // 2) * SPEC.mamba_p * SPEC.mamba_n * 4
    conv_bc = k1 * 2 * SPEC.mamba_n * 4
    aux = 16 * 4 + 64  # SGLang's metadata row and kvwire's room stamp row, by one rank
    channels = sum(total * dim for total, dim in conv_sections(SPEC)) // 2  # this rank's
    gdn = channels * k1 * 4 + (SPEC.gdn_v_heads // 2) * SPEC.gdn_v_dim * SPEC.gdn_k_dim * 4
    mine = kv + draft + window + conv_x + ssm + gdn
    assert sorted(p["bytes"] for p in pre) == [mine, mine + conv_bc + aux], pre
    assert pre[0]["backend"] == "tcp"
    nixl_pre, _ = cluster.run(SWA_NIXL, Request(room=62, prompt=PROMPT))
    assert {p["backend"] for p in nixl_pre} == {"nixl"}
