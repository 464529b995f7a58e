"""Proof by computation: a tiny hybrid model (GQA attention over paged KV, a Mamba-style layer
with per-request conv and SSM state, a gated-delta-net layer whose conv state has q, k and v
sections of different head counts, a sliding-window layer, a draft layer) prefilled on one
instance and decoded on another, its caches moved by kvwire over tcp. Decode's greedy tokens
must equal a single process's, for heterogeneous TP both ways and chunked prefill; damaging
one moved state slot or page must change them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvwire.errors import ConfigError, DescriptorError, KVWireError
from kvwire.layout import BufferGroup
from kvwire.session import KVPoll
from kvwire.testing import hybrid
from kvwire.testing.hybrid import CORRUPTIONS, RankPools, config, instances, run_pd
from kvwire.testing.hybrid_model import HybridSpec, reference_tokens
from kvwire.testing.pair import wait_for

SPEC = HybridSpec()
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, SPEC.vocab, 14)]
N_GEN = 6


@pytest.fixture(scope="module")
def reference() -> list[int]:
    tokens = reference_tokens(SPEC, PROMPT, N_GEN)
    assert len(set(tokens)) > 2  # not a degenerate model
    return tokens


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
@pytest.mark.parametrize("chunk_pages", [1, 3])
def test_decode_tokens_equal_single_process(
    reference: list[int], tp_p: int, tp_d: int, chunk_pages: int
) -> None:
    out = run_pd(SPEC, PROMPT, N_GEN, tp_p, tp_d, chunk_pages=chunk_pages)
    assert out.tokens == reference


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_gdn_conv_state_stored_row_by_row(tp_p: int, tp_d: int) -> None:
    """The GDN conv state stored ``[k-1, channels]`` (a state of 2 rows, each q|k|v local
    channels) instead of channel-major: the same tokens."""
    spec = HybridSpec(conv_rows=True)
    assert run_pd(spec, PROMPT, N_GEN, tp_p, tp_d).tokens == reference_tokens(spec, PROMPT, N_GEN)


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_gdn_conv_state_described_as_one_block_moves_wrongly(
    reference: list[int], tp_p: int, tp_d: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why sections exist: the same conv state registered as one run of 2 heads per slot
    (sizes fit on every rank) is accepted, but heterogeneous TP then moves the q, k and v
    channels to the wrong places and decode's tokens differ."""
    real = hybrid.state_group

    def one_block(spec: HybridSpec, name: str, buffers: Any) -> BufferGroup:
        if name != "conv_qkv":
            return real(spec, name, buffers)
        elems = spec.state_shape(name)[0] * spec.state_shape(name)[1]
        return BufferGroup(name=name, kind="state", num_layers=1, dtype="float32",
                           total_heads=2, head_elems=elems // 2, buffers=buffers)  # fmt: skip

    monkeypatch.setattr(hybrid, "state_group", one_block)
    assert run_pd(SPEC, PROMPT, N_GEN, tp_p, tp_d).tokens != reference


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_layerwise_chunks_give_the_same_tokens(reference: list[int], tp_p: int, tp_d: int) -> None:
    """Every chunk sent layer-wise before its pass (state buffers and the draft layer too):
    nothing may move before its layers are marked computed."""
    out = run_pd(SPEC, PROMPT, N_GEN, tp_p, tp_d, chunk_pages=1, layerwise=True)
    assert out.tokens == reference


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_layerwise_through_the_staging_ring(reference: list[int], tp_p: int, tp_d: int) -> None:
    """Bulk staging, every chunk sent layer-wise before its pass: each layer group's head
    slices are gathered into the staging block once computed and the block goes out in one
    write per group (more transfers than whole blocks); tokens still equal."""
    cfg = config(staging="bulk")  # small units, so that each layer group owns some
    cfg.staging_options = {"block_bytes": 64, "ring_bytes": 1 << 16, "buffer_bytes": 1 << 14}
    out = run_pd(SPEC, PROMPT, N_GEN, tp_p, tp_d, chunk_pages=1, cfg=cfg, layerwise=True)
    assert out.tokens == reference
    whole = run_pd(SPEC, PROMPT, N_GEN, tp_p, tp_d, chunk_pages=1, cfg=cfg)
    assert sum(out.transfers) > sum(whole.transfers), (out.transfers, whole.transfers)


def test_only_the_window_moves_and_replicated_state_is_sent_once() -> None:
    """Bytes per prefill rank, TP 2 -> 1: each rank sends its half of every head-split buffer
    (4 prompt pages of KV and draft KV, but only the 2 pages of the 6-token window), the
    replicated conv state only from rank 0, which also writes the aux row."""
    out = run_pd(SPEC, PROMPT, N_GEN, 2, 1, chunk_pages=2)
    page = SPEC.page_size * 1 * SPEC.head_dim * 4  # one KV head per rank, float32
    kv = 4 * 4 * page  # 4 pages x (K, V) x 2 layers
    swa = 2 * 2 * page  # the window's 2 pages, K and V
    draft = 4 * 2 * page
    conv_x, ssm = 2 * 2 * 4 * 4, 2 * 16 * 4  # 2 of the 4 mamba heads each
    # GDN conv state, [channels, 2] per rank: 1 of 2 q heads and 1 of 2 k heads (2 channels
    # each), 2 of 4 v heads (3 channels each); delta state: 2 of 4 v heads of 3 x 2
    conv_qkv, delta = (2 + 2 + 2 * 3) * 2 * 4, 2 * 6 * 4
    conv_bc, aux = 16 * 4, 64 + 64  # replicated conv state; stamp row + engine row
    split = kv + swa + draft + conv_x + ssm + conv_qkv + delta
    assert out.bytes_sent == [split + conv_bc + aux, split]


@pytest.mark.parametrize("what", sorted(CORRUPTIONS))
def test_negative_control_damaged_slot_or_page_changes_tokens(
    reference: list[int], what: str
) -> None:
    out = run_pd(SPEC, PROMPT, N_GEN, 2, 1, corrupt=CORRUPTIONS[what])
    assert out.tokens != reference


def test_bulk_staging_with_state_buffers(reference: list[int]) -> None:
    """Heterogeneous TP with bulk staging: KV chunks go through the staging ring, the
    groups move directly; tokens still equal."""
    for tp_p, tp_d in ((2, 1), (1, 2)):
        out = run_pd(SPEC, PROMPT, N_GEN, tp_p, tp_d, cfg=config(staging="bulk"))
        assert out.tokens == reference, (tp_p, tp_d)
        direct = run_pd(SPEC, PROMPT, N_GEN, tp_p, tp_d)
        assert sum(out.descriptors) < sum(direct.descriptors)  # the KV really was staged


def test_signed_control_plane(reference: list[int]) -> None:
    out = run_pd(SPEC, PROMPT, N_GEN, 2, 1, cfg=config(secret="hybrid-secret"))
    assert out.tokens == reference


# ------------------------------------------------------------------ fail fast, both sides
def pools(spec: HybridSpec, tp: int) -> list[RankPools]:
    return [RankPools.build(spec, tp, r, 8, 8, 4) for r in range(tp)]


def test_handshake_refuses_a_mismatching_group_naming_the_field() -> None:
    other = HybridSpec(window=8)
    with instances(config(), pools(SPEC, 1), pools(other, 1)) as (pm, dm, addr):
        rx = dm[0].receiver(7, addr)
        rx.init()
        rx.send_metadata([0, 1], aux_index=0, state_indices={"state": 0, "window": [0]})
        wait_for(lambda: rx.poll() is KVPoll.Failed)
        with pytest.raises(KVWireError, match="group 'swa' window: prefill=6 decode=8"):
            rx.failure_exception()
        tx = pm[0].sender(7)
        wait_for(lambda: tx.poll() is KVPoll.Failed)  # pushed to prefill at once
        rx.clear()
        tx.clear()


def test_bad_state_indices_fail_the_request_on_both_sides() -> None:
    with instances(config(), pools(SPEC, 1), pools(SPEC, 1)) as (pm, dm, addr):
        rx = dm[0].receiver(8, addr)
        rx.init()
        with pytest.raises(DescriptorError, match=r"state_indices\['state'\]"):
            rx.send_metadata([0, 1], aux_index=0, state_indices={"state": 99, "window": [0]})
        assert rx.poll() is KVPoll.Failed
        tx = pm[0].sender(8)
        wait_for(lambda: tx.poll() is KVPoll.Failed)
        rx.clear()
        tx.clear()
        # decode is fine, prefill forgets the state on its last chunk
        rx = dm[0].receiver(9, addr)
        rx.init()
        with pytest.raises(ConfigError, match="pass state_indices"):
            rx.send_metadata([0, 1], aux_index=0)
        rx.clear()
        rx = dm[0].receiver(10, addr)
        rx.init()
        rx.send_metadata([0, 1], aux_index=0, state_indices={"state": 1, "window": [2]})
        tx = pm[0].sender(10)
        wait_for(lambda: tx.poll() >= KVPoll.WaitingForInput)
        tx.init(2, aux_index=0)
        with pytest.raises(ConfigError, match=r"'window': \.\.\."):
            tx.send([0, 1], last=True)
        wait_for(lambda: rx.poll() is KVPoll.Failed)
        with pytest.raises(KVWireError, match="bad state_indices in send"):
            rx.failure_exception()
        rx.clear()
        tx.clear()
        # counts that disagree between the sides (2 window pages here, 1 on decode) fail it
        rx = dm[0].receiver(11, addr)
        rx.init()
        rx.send_metadata([0, 1], aux_index=1, state_indices={"state": 1, "window": [2]})
        tx = pm[0].sender(11)
        wait_for(lambda: tx.poll() >= KVPoll.WaitingForInput)
        tx.init(2, aux_index=1)
        tx.send([0, 1], last=True, state_indices={"state": 0, "window": [3, 4]})
        wait_for(lambda: rx.poll() is KVPoll.Failed and tx.poll() is KVPoll.Failed)
        with pytest.raises(KVWireError, match="prefill gave 2 'window' indices, decode 1"):
            tx.failure_exception()
        rx.clear()
        tx.clear()
