"""The hybrid model (state slots, a multi-section GDN conv state, sliding window, draft
layer) prefilled and decoded with its
caches moved over Mooncake Transfer Engine (TCP): decode's greedy tokens equal a single
process's, both TP directions."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.testing.cluster_suite import GroupsConformance
from kvwire.testing.hybrid import CORRUPTIONS, checked_groups, config, run_pd
from kvwire.testing.hybrid_model import HybridSpec, reference_tokens

SPEC = HybridSpec()
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, SPEC.vocab, 11)]


@pytest.mark.slow
@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_hybrid_model_over_mooncake(tp_p: int, tp_d: int) -> None:
    ref = reference_tokens(SPEC, PROMPT, 5)
    assert run_pd(SPEC, PROMPT, 5, tp_p, tp_d, cfg=config("mooncake")).tokens == ref
    for what in ("state", "sections"):  # an SSM state slot; the GDN conv state's v section
        bad = run_pd(SPEC, PROMPT, 5, tp_p, tp_d, cfg=config("mooncake"), corrupt=CORRUPTIONS[what])
        assert bad.tokens != ref, what


@pytest.mark.slow
def test_checked_groups_over_mooncake() -> None:
    """Decode checks KV and buffer-group checksums (protocol 1.14): the same tokens, and one
    bit flipped in the first group row that landed fails the request naming its group."""
    same, error = checked_groups("mooncake", SPEC, PROMPT, 5)
    assert same
    assert "buffer-group checksum mismatch" in error, error


class TestMooncakeClusterGroups(GroupsConformance):
    """Buffer groups (head-sharded, replicated and multi-section states, a window, draft
    pages) across real processes over Mooncake, every element checked on decode."""

    backend_name = "mooncake"
