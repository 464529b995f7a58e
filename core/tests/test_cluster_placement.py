"""Placement of the cluster harness's rank processes on GPUs (issue 27 item 6): a CPU test
of :func:`kvwire.testing.cluster.rank_gpu`, the rule every rank process applies to itself."""

from __future__ import annotations

import pytest

from kvwire.layout import ModelSpec
from kvwire.testing.cluster import ClusterError, ClusterSpec, rank_gpu

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=4)


def _spec(**kw: object) -> ClusterSpec:
    return ClusterSpec.model_validate({"model": MODEL, "device": "cuda", **kw})


def _placement(spec: ClusterSpec, count: int) -> tuple[list[int | None], list[int | None]]:
    """Devices of every prefill and every decode rank, in the order the harness spawns them."""
    pre = [
        rank_gpu(spec, "prefill", inst, tp, pp, count)
        for inst in range(max(spec.prefill_instances, spec.prefill_dp))
        for pp in range(spec.prefill_pp)
        for tp in range(spec.prefill_tp)
    ]
    dec = [
        rank_gpu(spec, "decode", inst, tp, pp, count)
        for inst in range(spec.decode_instances)
        for pp in range(spec.decode_pp)
        for tp in range(spec.decode_tp)
    ]
    return pre, dec


def test_one_prefill_one_decode_on_two_gpus() -> None:
    assert _placement(_spec(), 2) == ([0], [1])
    assert _placement(_spec(), 8) == ([0], [1])
    assert _placement(_spec(), 1) == ([0], [0])  # one GPU: every rank on it


def test_round_robin_prefill_first_then_decode() -> None:
    spec = _spec(prefill_tp=2, decode_tp=2)
    assert _placement(spec, 2) == ([0, 1], [0, 1])
    assert _placement(spec, 4) == ([0, 1], [2, 3])
    assert _placement(spec, 8) == ([0, 1], [2, 3])
    spec = _spec(prefill_tp=2, prefill_pp=2, decode_tp=4, decode_instances=2)
    pre, dec = _placement(spec, 8)
    assert pre == [0, 1, 2, 3] and dec == [4, 5, 6, 7, 0, 1, 2, 3]
    pre, dec = _placement(_spec(prefill_dp=2, prefill_tp=2, decode_tp=2), 8)
    assert pre == [0, 1, 2, 3] and dec == [4, 5]  # DP ranks count as prefill instances
    pre, dec = _placement(_spec(prefill_instances=3, decode_tp=2), 4)
    assert pre == [0, 1, 2] and dec == [3, 0]


def test_gpus_option() -> None:
    assert _placement(_spec(gpus=(3, 1)), 4) == ([3], [1])
    assert _placement(_spec(gpus=(2,), prefill_tp=2, decode_tp=2), 4) == ([2, 2], [2, 2])
    assert _placement(_spec(gpus=(0, 1, 2), decode_tp=2), 3) == ([0], [1, 2])
    with pytest.raises(ClusterError, match=r"\[5\] not among 4 devices"):
        rank_gpu(_spec(gpus=(0, 5)), "prefill", 0, 0, 0, 4)
    with pytest.raises(ClusterError, match="no CUDA device"):
        rank_gpu(_spec(), "decode", 0, 0, 0, 0)
    with pytest.raises(ValueError, match="gpus"):
        _spec(gpus=())
    with pytest.raises(ValueError, match="gpus"):
        _spec(gpus=(-1,))


def test_not_placed_off_cuda() -> None:
    """CPU pools, or an explicit device for every rank: no placement."""
    assert rank_gpu(_spec(device="cpu"), "decode", 0, 0, 0, 2) is None
    assert rank_gpu(_spec(device="cuda:1"), "prefill", 0, 0, 0, 2) is None
