"""``KVArgs`` -> kvwire layout: what maps (MHA, MLA, draft KV, Mamba state), and refusals that
name the field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from sgl_harness import KVH, LAYERS, PS, SLOTS, Pool

from kvwire.layout import MemKind
from kvwire_sglang.facts import EngineFacts
from kvwire_sglang.layout import UnsupportedKVArgsError, build_layout

FACTS = EngineFacts(num_layers=LAYERS, total_kv_heads=KVH, local_kv_heads=KVH)


def _build(a: Any, mla: bool = False, facts: EngineFacts = FACTS) -> Any:
    return build_layout(a, mla, facts, MemKind.DRAM, MemKind.DRAM)


def test_mha_layout_from_kvargs() -> None:
    pool = Pool(list(range(KVH)))
    layout, aux, names = _build(pool.kv_args(0, True))
    m = layout.model
    assert (m.num_layers, m.total_kv_heads, m.head_dim, m.dtype, m.page_size) == (
        LAYERS,
        KVH,
        4,
        "float32",
        PS,
    )
    assert [b.addr for b in layout.buffers] == [a.ctypes.data for a in (*pool.k, *pool.v)]
    assert len(aux) == 1 and aux[0].item_len == 64 and names == [] and layout.groups == ()


def test_draft_and_mamba_state_become_groups() -> None:
    pool = Pool(list(range(KVH)))
    a = pool.kv_args(0, True)
    draft = [np.zeros((8, PS, 1, 8), np.float16) for _ in range(2)]  # 1 draft layer: K, V
    conv, ssm = np.zeros((4, 24), np.float32), np.zeros((4, 64), np.float32)
    a.kv_data_ptrs += [d.ctypes.data for d in draft]
    a.kv_data_lens += [d.nbytes for d in draft]
    a.kv_item_lens += [d[0].nbytes for d in draft]
    a.num_draft_entries = 2
    with pytest.raises(Exception, match="slots"):  # a paged group shares the KV page indices
        _build(a)
    draft = [np.zeros((32, PS, 1, 8), np.float16) for _ in range(2)]
    a.kv_data_ptrs[-2:] = [d.ctypes.data for d in draft]
    a.kv_data_lens[-2:] = [d.nbytes for d in draft]
    a.state_types = ["mamba"]
    a.state_data_ptrs = [[conv.ctypes.data, ssm.ctypes.data]]
    a.state_data_lens = [[conv.nbytes, ssm.nbytes]]
    a.state_item_lens = [[conv[0].nbytes, ssm[0].nbytes]]
    layout, _, names = _build(a)
    assert names == ["state0"]
    groups = {g.name: g for g in layout.groups}
    assert groups["draft"].kind == "paged" and groups["draft"].per_layer == 2
    assert {g.kind for n, g in groups.items() if n != "draft"} == {"state"}
    assert sorted(g.buffers[0].item_len for n, g in groups.items() if n != "draft") == [96, 256]
    assert len(layout.buffers) == 2 * LAYERS  # the draft entries left the target KV


def test_mla_layout() -> None:
    kv = [np.zeros((16, PS, 1, 72), np.uint8) for _ in range(3)]
    pool = Pool(list(range(KVH)))
    a = pool.kv_args(0, False)
    a.kv_data_ptrs, a.kv_data_lens = [k.ctypes.data for k in kv], [k.nbytes for k in kv]
    a.kv_item_lens = [k[0].nbytes for k in kv]
    a.kv_cache_dtype_str = "fp8_e4m3"
    a.prefill_end_layer = 3
    layout, _, _ = _build(a, mla=True, facts=EngineFacts(num_layers=3))
    assert layout.model.is_mla and layout.model.head_dim == 72
    assert layout.model.dtype == "float8_e4m3fn"


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("state_types", ["minimax_index_k"], r"state_types\[0\] = 'minimax_index_k'"),
        ("host_kv_data_ptrs", [1], "host_kv_data_ptrs"),
        ("kv_layout", "hnd", "kv_layout"),
        ("mla_compression_ratios", [0, 4], "mla_compression_ratios"),
    ],
)
def test_refused_fields_are_named(field: str, value: Any, match: str) -> None:
    a = Pool(list(range(KVH))).kv_args(0, True)
    setattr(a, field, value)
    if field == "state_types":
        a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [[]], [[]], [[]]
    with pytest.raises(UnsupportedKVArgsError, match=match):
        _build(a)


def test_decode_without_head_facts_is_refused() -> None:
    a = Pool(list(range(KVH))).kv_args(0, False)
    with pytest.raises(UnsupportedKVArgsError, match="kv_head_num"):
        _build(a, facts=EngineFacts())


def _mamba(a: Any, arrs: list[Any], dims: list[Any], outer: list[int], shards: list[Any]) -> None:
    """A ``"mamba"`` component as ``append_state_component`` appends it."""
    a.state_types = ["mamba"]
    a.state_data_ptrs = [[x.ctypes.data for x in arrs]]
    a.state_data_lens = [[x.nbytes for x in arrs]]
    a.state_item_lens = [[x[0].nbytes for x in arrs]]
    a.state_dim_per_tensor = [dims]
    a.state_slice_outer_counts = [outer]
    a.state_conv_shard_groups = [shards]
    a.state_layer_ids = [[3, 7] * (len(arrs) // 2)]


def test_mamba_state_sharding_from_sglang_dims() -> None:
    """Per tensor (2 Mamba layers, tensor-major): a contiguous TP slice -> heads (dim x tp),
    dim 0 -> replicated, GDN conv sub-blocks -> sections, outer rows or sub-blocks that do not
    split evenly -> opaque (equal TP)."""
    pool = Pool([0])  # TP rank 0 of 2: one of the 2 KV heads (kept alive: its addresses)
    a = pool.kv_args(0, True)
    conv = [np.zeros((5, 6, 2), np.float16) for _ in range(2)]  # [slots, dim, K-1]
    bc = [np.zeros((5, 8), np.float32) for _ in range(2)]
    ssm = [np.zeros((5, 3, 4, 4), np.float32) for _ in range(2)]
    _mamba(a, [*conv, *bc, *ssm], [6, 6, 0, 0, 3, 3], [1] * 6, [None] * 6)
    tp2 = EngineFacts(attn_tp_size=2, num_layers=LAYERS, total_kv_heads=KVH, local_kv_heads=1)
    layout, _, names = _build(a, facts=tp2)
    assert names == ["state0"]
    got = {g.name: (g.sharding, g.total_heads, g.head_elems, g.num_layers) for g in layout.groups}
    assert got == {
        "mamba0_0": ("heads", 12, 4, 2),  # 6 rows of 2 fp16 per rank, 2 ranks
        "mamba0_1": ("replicated", 1, 32, 2),
        "mamba0_2": ("heads", 6, 64, 2),
    }
    # GDN conv: q, k and v blocks of 2, 2 and 4 channels in the whole model (1, 1, 2 per rank
    # at TP 2), a channel row of K-1 = 2 fp16 per "head"
    gdn = [np.zeros((5, 4, 2), np.float16) for _ in range(2)]  # [slots, channels, K-1]
    _mamba(a, [*gdn, *ssm], [4, 4, 3, 3], [1] * 4, [[2, 2, 4]] * 2 + [None] * 2)
    layout, _, _ = _build(a, facts=tp2)
    g = {x.name: x for x in layout.groups}["mamba0_0"]
    assert [(x.total_heads, x.head_elems) for x in g.sections] == [(2, 4), (2, 4), (4, 4)]
    assert g.item_len(2) == 4 * 4 and g.item_len(1) == 8 * 4
    # blocks that do not split evenly over the ranks (fewer heads than ranks): opaque
    _mamba(a, [*gdn, *ssm], [4, 4, 3, 3], [1] * 4, [[1, 3, 4]] * 2 + [None] * 2)
    layout, _, _ = _build(a, facts=tp2)
    assert {x.name: x.total_heads for x in layout.groups}["mamba0_0"] == 2  # tp runs of bytes
    _mamba(a, [*conv, *bc, *ssm], [6, 6, 0, 0, 3, 3], [2, 2, 1, 1, 1, 1], [None] * 6)
    layout, _, _ = _build(a, facts=tp2)
    opaque = {g.name: (g.sharding, g.total_heads) for g in layout.groups}
    assert opaque["mamba0_0"] == ("heads", 2)  # outer rows: tp "heads" of bytes
    a.state_dim_per_tensor = [[]]  # a pool that reports no dims: opaque too
    layout, _, _ = _build(a, facts=tp2)
    assert {g.total_heads for g in layout.groups} == {2}


def test_swa_pool_becomes_a_window_group() -> None:
    pool = Pool([0])
    a = pool.kv_args(1, True)
    swa = [np.zeros((12, PS, 1, 4), np.float32) for _ in range(2)]  # 1 SWA layer: K, V
    a.state_types = ["swa"]
    a.state_data_ptrs, a.state_data_lens = [[s.ctypes.data for s in swa]], [[s.nbytes for s in swa]]
    a.state_item_lens = [[s[0].nbytes for s in swa]]
    a.swa_kv_cache_layout = "nhd"
    facts = EngineFacts(attn_tp_size=2, num_layers=LAYERS, total_kv_heads=KVH, local_kv_heads=1)
    with pytest.raises(UnsupportedKVArgsError, match="sliding_window"):
        _build(a, facts=facts)
    layout, _, names = _build(a, facts=facts.model_copy(update={"sliding_window": 6}))
    (g,) = layout.groups
    assert (g.kind, g.window, g.per_layer, g.total_heads, g.sharding, g.index) == (
        "window",
        6,
        2,
        KVH,
        "heads",
        "state0",
    )
    assert names == ["state0"] and g.num_slots == 12
    a.swa_kv_cache_layout = "hnd"
    with pytest.raises(UnsupportedKVArgsError, match="swa_kv_cache_layout"):
        _build(a, facts=facts.model_copy(update={"sliding_window": 6}))


def test_dsa_indexer_becomes_a_paged_group_and_mla_draft_is_replicated() -> None:
    """DeepSeek V3.2: an MLA pool, indexer buffers per layer (one a 0-row placeholder) as a
    ``paged`` group sent once; its SGLang payload needs no kvwire index (name None)."""
    kv = [np.zeros((SLOTS, PS, 1, 72), np.uint8) for _ in range(3)]
    idx = [np.zeros((SLOTS, PS * 132), np.uint8) for _ in range(2)]
    hole = np.zeros((0, PS * 132), np.uint8)
    draft = [np.zeros((SLOTS, PS, 1, 72), np.uint8)]
    pool = Pool(list(range(KVH)))  # aux row only; kept alive while its addresses are used
    a = pool.kv_args(0, False)
    bufs = [*kv, *draft]
    a.kv_data_ptrs, a.kv_data_lens = [k.ctypes.data for k in bufs], [k.nbytes for k in bufs]
    a.kv_item_lens = [k[0].nbytes for k in bufs]
    a.num_draft_entries, a.prefill_end_layer = 1, 3
    a.state_types = ["dsa"]
    a.state_data_ptrs = [[idx[0].ctypes.data, hole.ctypes.data, idx[1].ctypes.data]]
    a.state_data_lens = [[idx[0].nbytes, 0, idx[1].nbytes]]
    a.state_item_lens = [[idx[0][0].nbytes, 0, idx[1][0].nbytes]]
    layout, _, names = _build(a, mla=True, facts=EngineFacts(attn_tp_size=2, num_layers=3))
    assert names == [None]
    got = {g.name: (g.kind, g.sharding, g.num_layers, g.index) for g in layout.groups}
    assert got == {
        "draft": ("paged", "replicated", 1, "pages"),
        "dsa0": ("paged", "replicated", 2, "pages"),
    }
