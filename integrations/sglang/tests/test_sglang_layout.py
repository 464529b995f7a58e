"""``KVArgs`` -> kvwire layout: what maps (MHA, MLA, draft KV, Mamba state), and refusals that
name the field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from sgl_harness import KVH, LAYERS, PS, Pool

from kvwire.layout import MemKind
from kvwire_sglang.layout import EngineFacts, UnsupportedKVArgsError, build_layout

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
