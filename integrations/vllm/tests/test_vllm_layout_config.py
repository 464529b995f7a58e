"""How vLLM's KV views are described to kvwire, and how the extra config maps onto kvwire's.

In-process and without importing vLLM (its import costs ~15 s): the views are built with
``torch.as_strided`` the way vLLM's ``create_kv_cache_views`` lays them out (logical
``[B, H, N, C]``, physical order given by the layout), and the cross-process tests
(``test_vllm_pd.py``) run the same description on views made by vLLM itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvwire.errors import ConfigError, LayoutError
from kvwire.layout import RankPosition, compatibility_problems
from kvwire_vllm.config import DEFAULT_BOOTSTRAP_PORT, bootstrap_address, parse_extra_config
from kvwire_vllm.layout import HeadFacts, describe_kv_caches, head_facts

B, H, N, D = 10, 2, 4, 8  # blocks, KV heads, tokens per block, head size (C = 2 * D)
PHYS = {  # physical order of the logical [L, B, H, N, C] axes
    "LBNHC": (0, 1, 3, 2, 4),
    "LBHNC": (0, 1, 2, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "LHBNC": (0, 2, 1, 3, 4),
}


def views(
    layout: str, layers: int = 3, blocks: int = B, n: int = N
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One float32 buffer viewed per layer as [B, H, N, 2D] in ``layout``'s physical order."""
    shape = (layers, blocks, H, n, 2 * D)
    order = PHYS[layout]
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(math.prod(shape), dtype=torch.float32)
    v5 = torch.as_strided(raw, shape, strides)
    return raw, {f"layer.{i}": v5[i] for i in range(layers)}


def test_layer_major_layouts_give_one_buffer_per_layer() -> None:
    for name in ("LBNHC", "LBHNC"):
        raw, kv = views(name)
        desc = describe_kv_caches(kv, B, RankPosition())
        page = H * N * 2 * D * 4
        bufs = desc.layout.buffers
        assert [b.addr for b in bufs] == [raw.data_ptr() + i * B * page for i in range(3)]
        assert {(b.item_len, b.num_items) for b in bufs} == {(page, B)}
        m = desc.layout.model
        assert (m.is_mla, m.page_size, m.total_kv_heads, m.dtype) == (True, 1, 1, "float32")
        assert m.head_dim * 4 == page and m.num_layers == 3


def test_block_major_layout_packs_all_layers_of_a_block_into_one_slot() -> None:
    raw, kv = views("BLHNC")
    desc = describe_kv_caches(kv, B, RankPosition())
    page = H * N * 2 * D * 4
    (buf,) = desc.layout.buffers
    assert (buf.addr, buf.item_len, buf.num_items) == (raw.data_ptr(), 3 * page, B)
    assert desc.packed_layers == 3


def test_kernel_blocks_are_grouped_into_scheduler_blocks() -> None:
    # vLLM may split each scheduler block into kernel blocks: 2 x [H, N/2, C] per block.
    _raw, kv = views("LBHNC", blocks=2 * B, n=N // 2)
    desc = describe_kv_caches(kv, B, RankPosition())
    assert {(b.item_len, b.num_items) for b in desc.layout.buffers} == {(H * N * 2 * D * 4, B)}


def test_heads_outside_blocks_are_refused() -> None:
    _, kv = views("LHBNC")
    with pytest.raises(LayoutError, match="contiguous run"):
        describe_kv_caches(kv, B, RankPosition())


def test_views_of_another_shape_or_past_the_storage_are_refused() -> None:
    with pytest.raises(LayoutError, match="blocks, heads, tokens, content"):
        describe_kv_caches({"x": torch.zeros(2, B, N, H, D)}, B, RankPosition())
    _, kv = views("LBNHC")
    with pytest.raises(LayoutError, match="not a multiple"):
        describe_kv_caches(kv, B + 1, RankPosition())
    with pytest.raises(LayoutError, match="no KV cache"):
        describe_kv_caches({}, B, RankPosition())


def test_differing_block_size_or_heads_differ_in_the_handshake_hash() -> None:
    """A prefill and decode that disagree on the block's bytes are refused at handshake."""
    _, a = views("LBNHC")
    _, b = views("LBNHC", blocks=B // 2, n=2 * N)  # same memory, 8-token blocks
    da = describe_kv_caches(a, B, RankPosition()).layout
    db = describe_kv_caches(b, B // 2, RankPosition()).layout
    assert any("head_dim" in p for p in compatibility_problems(da.model, db.model))
    assert da.compatibility_hash() != db.compatibility_hash()


def test_extra_config_maps_onto_kvwire_config(monkeypatch: pytest.MonkeyPatch) -> None:
    opts, cfg = parse_extra_config(
        {"transfer_backend": "tcp", "control": {"num_workers": 2, "host": "10.1.2.3"}}
    )
    assert cfg.transfer_backend == "tcp"
    assert (cfg.control.num_workers, cfg.control.host) == (2, "10.1.2.3")
    assert cfg.control.bootstrap_port == DEFAULT_BOOTSTRAP_PORT and cfg.control.run_bootstrap
    assert bootstrap_address(opts, cfg) == f"127.0.0.1:{DEFAULT_BOOTSTRAP_PORT}"
    opts, cfg = parse_extra_config({"bootstrap_port": 9100, "advertise_host": "p0.local"})
    assert bootstrap_address(opts, cfg) == "p0.local:9100"
    opts, cfg = parse_extra_config({"bootstrap_addr": "boot:7000"})
    assert not cfg.control.run_bootstrap and bootstrap_address(opts, cfg) == "boot:7000"
    monkeypatch.setenv("KVWIRE_TRANSFER_BACKEND", "tcp")  # unset keys fall back to KVWIRE_*
    assert parse_extra_config({})[1].transfer_backend == "tcp"


def test_extra_config_sets_pools() -> None:
    """The per-pool map reaches kvwire's config from vLLM's extra config, checked there."""
    _, cfg = parse_extra_config({"pools": {"host": {"staging": "direct", "mapper": "m"}}})
    assert (cfg.pools["host"].staging, cfg.pools["host"].mapper) == ("direct", "m")
    with pytest.raises(ConfigError, match="stagin"):
        parse_extra_config({"pools": {"host": {"stagin": "direct"}}})


def test_extra_config_refuses_secrets_and_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="KVWIRE_SECRET"):
        parse_extra_config({"secret": "hunter2"})
    with pytest.raises(ConfigError, match="transfer_backnd"):
        parse_extra_config({"transfer_backnd": "tcp"})
    with pytest.raises(ConfigError, match="num_workers"):
        parse_extra_config({"control": {"num_workers": 0}})


def test_layer_major_layouts_with_head_facts_are_fused_kv_pages() -> None:
    """With the model's head facts, a layer-major pool is described with its heads: K|V
    rows, token-major (NHD) or head-major (HND) pages of a block's tokens; kernel blocks of
    an NHD pool make one page of the scheduler block's tokens."""
    facts = HeadFacts(head_size=D, total_kv_heads=2 * H)
    rank = RankPosition(tp_size=2, tp_rank=1)
    for name, head_major in (("LBNHC", False), ("LBHNC", True)):
        raw, kv = views(name)
        desc = describe_kv_caches(kv, B, rank, facts)
        lay = desc.layout
        assert desc.heads and lay.kv_fused and lay.head_major == head_major
        m = lay.model
        assert (m.is_mla, m.page_size, m.total_kv_heads, m.head_dim) == (False, N, 2 * H, D)
        assert lay.local_kv_heads == H and lay.head_bytes == 2 * D * 4
        assert [b.addr for b in lay.buffers] == [
            raw.data_ptr() + i * B * H * N * 2 * D * 4 for i in range(3)
        ]
        # the element of (block 3, head 1, token 2) sits where kvwire's layout says
        got = lay.buffers[0].addr + 3 * lay.slot_bytes + int(lay.byte_offsets([2], [1])[0, 0])
        assert got == kv["layer.0"][3, 1, 2].data_ptr()
    _raw, kv = views("LBNHC", blocks=2 * B, n=N // 2)
    assert describe_kv_caches(kv, B, rank, facts).layout.model.page_size == N


def test_layouts_that_cannot_carry_heads_fall_back_to_whole_blocks() -> None:
    facts = HeadFacts(head_size=D, total_kv_heads=H)
    for kv in (
        views("BLHNC")[1],  # block-major: a block holds every layer's page
        views("LBHNC", blocks=2 * B, n=N // 2)[1],  # HND kernel blocks: [2, H, N/2, C]
    ):
        desc = describe_kv_caches(kv, B, RankPosition(), facts)
        assert not desc.heads and desc.layout.model.is_mla
    other = HeadFacts(head_size=D // 2, total_kv_heads=H)  # C is not 2 x head size
    assert not describe_kv_caches(views("LBNHC")[1], B, RankPosition(), other).heads
    with pytest.raises(LayoutError, match="heads per rank"):
        describe_kv_caches(views("LBNHC")[1], B, RankPosition(), HeadFacts(D, 3 * H))


def test_head_facts_from_the_connector_options() -> None:
    from types import SimpleNamespace

    spec = SimpleNamespace(head_size=D, head_size_v=D, num_kv_heads=H)
    kcc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    opts, _ = parse_extra_config({})
    assert head_facts(SimpleNamespace(model_config=None), kcc, opts, 2) == HeadFacts(D, 2 * H)
    mc = SimpleNamespace(get_total_num_kv_heads=lambda: 1)  # replicated: 1 head over TP 2
    assert head_facts(SimpleNamespace(model_config=mc), kcc, opts, 2) == HeadFacts(D, 1)
    opts, _ = parse_extra_config({"total_kv_heads": 8})
    assert head_facts(SimpleNamespace(model_config=mc), kcc, opts, 2) == HeadFacts(D, 8)
    opts, _ = parse_extra_config({"kv_pool": "blocks"})
    assert head_facts(SimpleNamespace(model_config=None), kcc, opts, 2) is None
    spec_v = SimpleNamespace(head_size=D, head_size_v=D // 2, num_kv_heads=H)
    kcc_v = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec_v)])
    assert (
        head_facts(SimpleNamespace(model_config=None), kcc_v, parse_extra_config({})[0], 2) is None
    )
