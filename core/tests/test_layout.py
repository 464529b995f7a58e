"""KVLayout and MemoryRegion validation: clear errors for malformed pools."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvwire.layout import (
    KVLayout,
    MemKind,
    MemoryRegion,
    ModelSpec,
    RankPosition,
    compatibility_problems,
)

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="bfloat16", page_size=2)


def kv_tensors(tp: int = 1, slots: int = 6) -> list[torch.Tensor]:
    heads = max(1, 4 // tp)
    return [torch.zeros(slots, 2, heads, 8, dtype=torch.bfloat16) for _ in range(4)]


def test_region_from_torch_tensor() -> None:
    t = torch.zeros(10, 2, 4, 8, dtype=torch.bfloat16)
    r = MemoryRegion.from_tensor(t)
    assert r.addr == t.data_ptr() and r.length == t.numel() * 2
    assert r.item_len == 2 * 4 * 8 * 2 and r.num_items == 10
    assert r.kind is MemKind.DRAM and r.device_id == 0


def test_region_from_numpy_and_pointer() -> None:
    a = np.zeros((4, 16), dtype=np.uint8)
    r = MemoryRegion.from_tensor(a)
    assert (r.addr, r.length, r.item_len) == (a.ctypes.data, 64, 16)
    p = MemoryRegion.from_pointer(0x1000, 4096, 512, MemKind.VRAM, device_id=3)
    assert p.end == 0x2000 and p.kind is MemKind.VRAM and p.device_id == 3


def test_region_with_high_bit_address() -> None:
    r = MemoryRegion.from_pointer((1 << 63) + 4096, 1024, 256)
    assert r.addr > (1 << 63) and r.num_items == 4
    with pytest.raises(ValueError, match="overflows 64 bits"):
        MemoryRegion.from_pointer((1 << 64) - 512, 1024, 256)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"addr": 0, "length": 0, "item_len": 4}, "length 0"),
        ({"addr": 0, "length": 8, "item_len": 0}, "item_len 0"),
        ({"addr": 0, "length": 10, "item_len": 4}, "not a multiple of item_len 4"),
    ],
)
def test_region_validation(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryRegion(**kwargs)


def test_non_contiguous_tensor_refused() -> None:
    t = torch.zeros(8, 8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        MemoryRegion.from_tensor(t)


def test_layout_from_tensors() -> None:
    lay = KVLayout.from_tensors(MODEL, kv_tensors(tp=2), RankPosition(tp_size=2, tp_rank=1))
    assert lay.num_slots == 6 and lay.local_kv_heads == 2
    assert lay.token_row_bytes == 2 * 8 * 2
    assert lay.buffer_keys.tolist() == [[0, 0], [1, 0], [0, 1], [1, 1]]


def test_overlapping_buffers_refused() -> None:
    t = torch.zeros(12, 2, 4, 8, dtype=torch.bfloat16)
    r1 = MemoryRegion.from_pointer(t.data_ptr(), 3 * 128, 128)
    r2 = MemoryRegion.from_pointer(t.data_ptr() + 128, 3 * 128, 128)
    others = [MemoryRegion.from_tensor(x) for x in kv_tensors(slots=3)[:2]]
    with pytest.raises(ValueError, match="overlap"):
        KVLayout(model=MODEL, buffers=(r1, r2, *others))


def test_wrong_item_len_names_the_parts() -> None:
    bad = [torch.zeros(6, 2, 3, 8, dtype=torch.bfloat16) for _ in range(4)]
    with pytest.raises(ValueError, match="item_len 96 != page_size 2 x token row 64"):
        KVLayout.from_tensors(MODEL, bad)


def test_wrong_buffer_count_and_ranks() -> None:
    with pytest.raises(ValueError, match="expected 4 buffers"):
        KVLayout.from_tensors(MODEL, kv_tensors()[:3])
    with pytest.raises(ValueError, match="tp_rank 2 is not below tp_size 2"):
        RankPosition(tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="one must divide the other"):
        KVLayout.from_tensors(MODEL, kv_tensors(), RankPosition(tp_size=3, tp_rank=0))


def test_unequal_slot_counts_refused() -> None:
    ts = kv_tensors()
    ts[3] = torch.zeros(7, 2, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="same number of slots"):
        KVLayout.from_tensors(MODEL, ts)


def test_pp_stage_layer_range() -> None:
    ts = [torch.zeros(6, 2, 4, 8, dtype=torch.bfloat16) for _ in range(2)]
    lay = KVLayout.from_tensors(MODEL, ts, RankPosition(pp_size=2, pp_rank=1), start_layer=1)
    assert lay.buffer_keys.tolist() == [[1, 0], [1, 1]]
    assert lay.rank.sender_id == 1
    with pytest.raises(ValueError, match="not inside the model"):
        KVLayout.from_tensors(MODEL, ts, start_layer=2)


def test_mla_needs_one_head() -> None:
    with pytest.raises(ValueError, match="total_kv_heads=1"):
        ModelSpec(num_layers=1, total_kv_heads=2, head_dim=576, is_mla=True)


def test_compatibility_problems_name_both_sides() -> None:
    other = MODEL.model_copy(update={"page_size": 4, "dtype": "float16"})
    probs = compatibility_problems(MODEL, other)
    assert "page_size: local=2 remote=4" in probs
    assert "dtype: local='bfloat16' remote='float16'" in probs
    a = KVLayout.from_tensors(MODEL, kv_tensors())
    assert a.compatibility_hash() == KVLayout.from_tensors(MODEL, kv_tensors()).compatibility_hash()
    b = KVLayout.from_tensors(
        other, [torch.zeros(6, 4, 4, 8, dtype=torch.float16) for _ in range(4)]
    )
    assert a.compatibility_hash() != b.compatibility_hash()


class _FakeCudaTensor:
    """Stands in for a CUDA tensor, which no CI machine can allocate (no GPU here).

    Mirrors the torch attributes ``MemoryRegion.from_tensor`` reads; a real CUDA tensor was
    checked on the lent GPU machine (see docs/benchmarks.md, "GPU checks").
    """

    is_cuda = True

    class device:  # noqa: N801 - mirrors torch.device's attribute access
        index = 3

    shape = (16, 4, 2, 8)

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return 0x7F00_0000_0000

    def numel(self) -> int:
        return 16 * 4 * 2 * 8

    def element_size(self) -> int:
        return 2

    def dim(self) -> int:
        return 4


def test_region_from_cuda_tensor_is_vram_on_its_device() -> None:
    r = MemoryRegion.from_tensor(_FakeCudaTensor())
    assert r.kind is MemKind.VRAM and r.device_id == 3
    assert r.addr == 0x7F00_0000_0000 and r.length == 2048 and r.item_len == 128
