"""Placement of the cluster harness's rank processes on GPUs (issue 27 item 6): a CPU test
of :func:`kvwire.testing.cluster.rank_gpu`, the rule every rank process applies to itself;
and their optional CPU pinning (:func:`kvwire.testing.cluster_spec.rank_cpus`)."""

from __future__ import annotations

import os

import pytest

from kvwire.layout import ModelSpec
from kvwire.testing.cluster import ClusterError, ClusterSpec, rank_gpu
from kvwire.testing.cluster_spec import pin_rank, rank_cpus

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


def test_pinned_ranks_get_disjoint_equal_cpu_shares() -> None:
    """``pin_cpus``: each rank process an equal, disjoint share of the CPUs, in rank order
    (prefill first), none when off or when there are fewer CPUs than ranks."""
    spec = ClusterSpec(model=MODEL, prefill_tp=2, decode_tp=1, decode_instances=2, pin_cpus=True)
    cpus = list(range(3, 35))  # 32 CPUs, not starting at 0
    got = [rank_cpus(spec, "prefill", 0, tp, 0, cpus) for tp in range(2)]
    got += [rank_cpus(spec, "decode", inst, 0, 0, cpus) for inst in range(2)]
    assert got == [cpus[0:8], cpus[8:16], cpus[16:24], cpus[24:32]]
    assert rank_cpus(spec, "decode", 1, 0, 0, cpus[:3]) is None  # 4 ranks, 3 CPUs
    off = spec.model_copy(update={"pin_cpus": False})
    assert rank_cpus(off, "prefill", 0, 0, 0, cpus) is None
    # in a process: pinned to its share, then put back
    before = os.sched_getaffinity(0)
    mine = sorted(before)
    one = ClusterSpec(model=MODEL, pin_cpus=True)  # 1P1D: two ranks
    try:
        want = mine[len(mine) // 2 :] if len(mine) >= 2 else None
        assert pin_rank(one, "decode", 0, 0, 0) == want
        if want is not None:
            assert sorted(os.sched_getaffinity(0)) == want
    finally:
        os.sched_setaffinity(0, before)
