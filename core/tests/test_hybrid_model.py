"""Proof by computation: a tiny hybrid model (GQA attention over paged KV, a Mamba-style layer
with per-request conv and SSM state, a sliding-window layer, a draft layer) prefilled on one
instance and decoded on another, its caches moved by kvwire over tcp. Decode's greedy tokens
must equal a single process's, for heterogeneous TP both ways and chunked prefill; damaging
one moved state slot or page must change them."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.testing.hybrid import CORRUPTIONS, config, run_pd
from kvwire.testing.hybrid_model import HybridSpec, reference_tokens

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
    conv_bc, aux = 16 * 4, 64 + 64  # replicated conv state; stamp row + engine row
    split = kv + swa + draft + conv_x + ssm
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
