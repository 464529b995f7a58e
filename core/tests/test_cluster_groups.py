"""Buffer groups in the multi-process cluster harness over tcp (the NIXL and Mooncake plugin
tests run the same suite): state slots split by heads, replicated and multi-section, a
sliding window and draft pages, every element checked on decode, TP 2 -> 1 and 1 -> 2; decode
pipeline stages refused at handshake. And the harness's own checker, in one process: the
encoding survives a TP change through the group mapper and any damage shows."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from kvwire.config import KVWireConfig
from kvwire.index.groups import GroupMapper
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.session import KVPoll
from kvwire.testing.cluster import Cluster, RoomPlan
from kvwire.testing.cluster_groups import GROUP_KINDS, RankGroups
from kvwire.testing.cluster_suite import GroupsConformance
from kvwire.testing.kvfill import make_pool

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=4, dtype="int32", page_size=4)


class TestTcpClusterGroups(GroupsConformance):
    backend_name = "tcp"


class TestTcpClusterGroupsChecked(GroupsConformance):
    """The same requests with decode checking KV and buffer-group checksums (protocol 1.14):
    cached prefixes (paged draft groups skip the cached pages), layer-wise sends and both TP
    directions land with every group's sums matching."""

    backend_name = "tcp"

    @classmethod
    def config(cls, **control: Any) -> KVWireConfig:
        return super().config(kv_checksum=True, **control)


def test_decode_pp_with_groups_is_refused_naming_the_group() -> None:
    """Decode ranks with pipeline stages hold a range of each group's layers (as an engine
    would register them); the handshake refuses that, naming the group and its layer range,
    and the request fails on every rank (the refusal is the same on every backend)."""
    with Cluster(TestTcpClusterGroups.spec(1, 1, 4, decode_pp=2)) as c:
        (res,) = c.run([RoomPlan(room=77, num_pages=2, chunks=[2])], timeout_s=60)
    decode = sorted((r for r in res.reports if r.role == "decode"), key=lambda r: r.rank)
    assert [r.status for r in decode] == [int(KVPoll.Failed)] * 2
    for r, layers in zip(decode, ("[0, 1)", "[1, 2)"), strict=True):
        want = f"group 'state_heads' layers {layers}: a decode rank must hold all 2 layers"
        assert want in str(r.error), r.error
    assert all(r.status == int(KVPoll.Failed) for r in res.reports if r.role == "prefill")


def _rank(tp: int, r: int, seed: int) -> tuple[KVLayout, RankGroups]:
    pos = RankPosition(tp_size=tp, tp_rank=r)
    groups = RankGroups(tuple(GROUP_KINDS), MODEL, pos, (0, 2), 16, 8, seed)
    _, arrays = make_pool(MODEL, pos, 16)
    lay = KVLayout.from_tensors(
        MODEL, arrays, pos, groups=groups.groups, group_tensors=groups.tensors
    )
    return lay, groups


def test_checker_sees_every_element_after_a_tp_change_and_any_damage() -> None:
    room, pages_p, pages_d = 31337, np.array([5, 2, 9]), np.array([1, 7, 3])
    src = [_rank(2, r, r) for r in range(2)]
    lay_d, dst = _rank(1, 0, 9)
    allocs = [g.alloc(3) for _, g in src]
    for (_, g), a in zip(src, allocs, strict=True):
        g.fill(room, a, pages_p)
    ad = dst.alloc(3)
    dst.poison(ad, pages_d)
    assert dst.mismatches(room, ad, pages_d, 0) > 0  # poisoned: nothing verified yet
    for (lay_s, _), a in zip(src, allocs, strict=True):
        gm = GroupMapper(lay_s, lay_d)
        tables = gm.build_tables()
        idx = {"state": np.array([a.state]), "window": a.window, "pages": pages_p}
        didx = {"state": np.array([ad.state]), "window": ad.window, "pages": pages_d}
        si, di = gm.map_request(idx, didx)
        for s, d in zip(si.tolist(), di.tolist(), strict=True):
            ctypes.memmove(int(tables.dst[d, 0]), int(tables.src[s, 0]), int(tables.src[s, 1]))
    assert dst.mismatches(room, ad, pages_d, 0) == 0
    assert dst.mismatches(room + 1, ad, pages_d, 0) > 0  # another request's encoding
    sections = dst.groups[[g.name for g in dst.groups].index("state_sections")]
    i = dst.groups.index(sections)
    dst.arrays[i][1][ad.state, -1] += 1  # one element of the v section, layer 1
    assert dst.mismatches(room, ad, pages_d, 0) == 1


def test_group_pools_as_torch_tensors_fill_poison_and_check_like_numpy() -> None:
    """The harness's group pools on a GPU are torch tensors (``ClusterSpec(device="cuda")``,
    run by scripts/gpu_layout_cluster.py on the GPU machine); here the same code on torch's
    CPU tensors gives what the NumPy pools give, and damage shows."""
    torch = pytest.importorskip("torch")
    from kvwire.testing import cluster_groups

    pos = RankPosition(tp_size=1, tp_rank=0)
    host = RankGroups(tuple(GROUP_KINDS), MODEL, pos, (0, 2), 16, 8, 3)
    dev = RankGroups(tuple(GROUP_KINDS), MODEL, pos, (0, 2), 16, 8, 3)
    dev.arrays = [[torch.from_numpy(a.copy()) for a in arrs] for arrs in dev.arrays]
    pages = np.array([4, 1, 6])
    for g in (host, dev):
        a = g.alloc(3)
        g.poison(a, pages)
        assert g.mismatches(5, a, pages, 0) > 0
        g.fill(5, a, pages)
        assert g.mismatches(5, a, pages, 0) == 0
    for h, d in zip(host.tensors, dev.tensors, strict=True):
        assert np.array_equal(h, d.numpy())
    t = dev.arrays[0][0]
    slot = np.array([int(np.flatnonzero(t.numpy()[:, 0] != 0)[0])])
    before = cluster_groups._get(t, slot).copy()
    cluster_groups._put(t, slot, before + 1)
    assert np.array_equal(cluster_groups._get(t, slot), before + 1)
