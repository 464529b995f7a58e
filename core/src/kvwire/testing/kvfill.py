"""KV pools whose every element encodes where it belongs, for end-to-end verification.

An element of layer ``l``, K/V ``kv``, global head ``h``, token position ``p`` and dim ``d``
holds :func:`encode` of those five numbers (an ``int32``), so a receiver can check every byte it
got without knowing what the sender did. Pools use the ``int32`` dtype.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.descriptors import ADDR, LEN, locate_rows
from kvwire.index.base import IndexMapper
from kvwire.layout import KVLayout, ModelSpec, RankPosition


def encode(layer: object, kv: object, head: object, pos: object, dim: object) -> NDArray[np.int32]:
    """Deterministic 31-bit code of an element's coordinates (NumPy broadcasting)."""
    v = (
        np.asarray(layer, dtype=np.int64) * 1_000_003
        + np.asarray(kv, dtype=np.int64) * 7_919
        + np.asarray(head, dtype=np.int64) * 104_729
        + np.asarray(pos, dtype=np.int64) * 131
        + np.asarray(dim, dtype=np.int64)
    )
    return (v & 0x7FFFFFFF).astype(np.int32)


def global_heads(model: ModelSpec, rank: RankPosition) -> NDArray[np.int64]:
    """Global KV head ids held by a TP rank (replicated ranks hold the same heads)."""
    if model.is_mla:
        return np.zeros(1, dtype=np.int64)
    h, tp = model.total_kv_heads, rank.tp_size
    local = max(1, h // tp)
    first = (rank.tp_rank // max(1, tp // h)) * local
    return np.arange(first, first + local, dtype=np.int64)


def make_pool(
    model: ModelSpec,
    rank: RankPosition,
    num_slots: int,
    start_layer: int = 0,
    end_layer: int | None = None,
    head_major: bool = False,
    kv_fused: bool = False,
    kv_in_slot: bool = False,
) -> tuple[KVLayout, list[NDArray[np.int32]]]:
    """Allocate a zeroed ``int32`` pool shaped ``[slots, page_size, heads, head_dim]`` (or
    ``[slots, heads, page_size, head_dim]`` with ``head_major``; ``kv_fused``: one buffer per
    layer with ``[2, head_dim]`` (K, V) in place of ``head_dim``; ``kv_in_slot``: one buffer
    per layer of ``[slots, 2, page_size, heads, head_dim]``, K's page then V's)."""
    if model.dtype != "int32":
        raise ValueError("verification pools use dtype 'int32'")
    end = end_layer if end_layer is not None else model.num_layers
    heads = len(global_heads(model, rank))
    nbuf = (end - start_layer) * (1 if model.is_mla or kv_fused or kv_in_slot else 2)
    shape = pool_shape(model, num_slots, heads, head_major, kv_fused, kv_in_slot)
    arrays = [np.zeros(shape, dtype=np.int32) for _ in range(nbuf)]
    layout = KVLayout.from_tensors(
        model,
        arrays,
        rank,
        start_layer,
        end_layer,
        head_major=head_major,
        kv_fused=kv_fused,
        kv_in_slot=kv_in_slot,
    )
    return layout, arrays


def pool_shape(
    model: ModelSpec,
    slots: int,
    heads: int,
    head_major: bool = False,
    kv_fused: bool = False,
    kv_in_slot: bool = False,
) -> tuple[int, ...]:
    """Shape of one buffer of a pool: ``[slots, page, heads, (2,) dim]`` (the page and head
    axes swapped head-major), or ``[slots, 2, page, heads, dim]`` with ``kv_in_slot``."""
    page: tuple[int, int] = (heads, model.page_size) if head_major else (model.page_size, heads)
    if kv_in_slot:
        return (slots, 2, *page, model.head_dim)
    return (slots, *page, *((2,) if kv_fused else ()), model.head_dim)


def to_pool_order(layout: KVLayout, values: NDArray[np.int32]) -> NDArray[np.int32]:
    """Page values in the canonical order :func:`page_values` gives (``[pages, page, heads,
    (K/V,) dim]``) laid out as the layout's buffers hold them."""
    if layout.kv_in_slot:  # [pages, page, heads, 2, dim] -> [pages, 2, page, heads, dim]
        values = np.moveaxis(values, 3, 1)
        return values.swapaxes(2, 3) if layout.head_major else values
    return values.swapaxes(1, 2) if layout.head_major else values


def from_pool_order(layout: KVLayout, values: NDArray[np.int32]) -> NDArray[np.int32]:
    """The inverse of :func:`to_pool_order`: a buffer's pages in the canonical order."""
    if layout.kv_in_slot:
        values = values.swapaxes(2, 3) if layout.head_major else values
        return np.moveaxis(values, 1, 3)
    return values.swapaxes(1, 2) if layout.head_major else values


def page_values(layout: KVLayout, buffer: int, first_pos: int, num_pages: int) -> NDArray[np.int32]:
    """Expected content of ``num_pages`` consecutive logical pages starting at ``first_pos``."""
    m = layout.model
    layer, kv = layout.buffer_keys[buffer]
    pos = first_pos + np.arange(num_pages * m.page_size).reshape(num_pages, m.page_size)
    heads = global_heads(m, layout.rank)
    if layout.kv_fused or layout.kv_in_slot:  # [pages, page, heads, K/V, dim]
        return encode(
            layer,
            np.arange(2)[None, None, None, :, None],
            heads[None, None, :, None, None],
            pos[:, :, None, None, None],
            np.arange(m.head_dim)[None, None, None, None, :],
        )
    return encode(
        layer,
        kv,
        heads[None, None, :, None],
        pos[:, :, None, None],
        np.arange(m.head_dim)[None, None, None, :],
    )


def fill_pages(
    layout: KVLayout, arrays: list[NDArray[np.int32]], pages: NDArray[np.int64], first_pos: int
) -> None:
    """Write the encoding of logical pages ``first_pos...`` into slots ``pages``."""
    for b, arr in enumerate(arrays):
        arr[pages] = to_pool_order(layout, page_values(layout, b, first_pos, len(pages)))


def count_mismatches(
    layout: KVLayout, arrays: list[NDArray[np.int32]], pages: NDArray[np.int64], first_pos: int
) -> int:
    """Elements of slots ``pages`` that differ from the expected encoding."""
    bad = 0
    for b, arr in enumerate(arrays):
        want = to_pool_order(layout, page_values(layout, b, first_pos, len(pages)))
        bad += int((arr[pages] != want).sum())
    return bad


def move_chunk(
    mapper: IndexMapper,
    src: list[NDArray[np.int32]],
    dst: list[NDArray[np.int32]],
    src_pages: Any,
    dst_pages: Any,
) -> None:
    """A transfer without a backend (mapper tests): every row of the chunk
    ``mapper.map_chunk(src_pages, dst_pages)`` copied at its table addresses, each row first
    checked to lie inside the pools' arrays and to pair rows of equal length."""
    tables = mapper.build_tables()
    s_idx, d_idx = mapper.map_chunk(np.asarray(src_pages), np.asarray(dst_pages))
    for table, idx, arrays in ((tables.src, s_idx, src), (tables.dst, d_idx, dst)):
        starts = np.array(sorted(a.ctypes.data for a in arrays), dtype=np.uint64)
        size = {a.ctypes.data: a.nbytes for a in arrays}
        ends = starts + np.array([size[int(a)] for a in starts], dtype=np.uint64)
        rows = table[idx]
        if (locate_rows(starts, ends, rows[:, ADDR], rows[:, LEN]) < 0).any():
            raise AssertionError("a row lies outside the pools")
    for s, d in zip(tables.src[s_idx], tables.dst[d_idx], strict=True):
        if s[LEN] != d[LEN]:
            raise AssertionError(f"paired rows differ in length: {s[LEN]} and {d[LEN]}")
        ctypes.memmove(int(d[ADDR]), int(s[ADDR]), int(s[LEN]))
