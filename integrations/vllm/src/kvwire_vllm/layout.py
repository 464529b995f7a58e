"""vLLM's KV cache tensors described to kvwire (:class:`~kvwire.layout.KVLayout`).

vLLM (0.3x) hands the worker connector one view per attention layer with the logical shape
``[B, H, N, C]``: blocks, KV heads, tokens of a block, and content ``C = head_size +
head_size_v`` elements holding a token's K *and* V of one head side by side. The physical
order of those axes is the resolved ``KVCacheLayout`` (``LBNHC`` = "NHD", ``LBHNC`` = "HND",
block-major ``BLNHC``/``BLHNC`` where one block holds the pages of every layer, ...), and a
manager block may be split into several kernel blocks. kvwire's own MHA layout wants separate
K and V buffers of ``[slots, page, heads, dim]``, which none of these is.

**Layer-major layouts with real heads** (``LBNHC``, and ``LBHNC`` without kernel-block
splitting), when the worker knows the model's KV head size and ``C = 2 x head_size``: each
layer's tensor is a kvwire buffer of pages ``[block_size, heads, 2, head_size]`` (``LBNHC``)
or ``[heads, block_size, 2, head_size]`` (``LBHNC``), described as such
(:attr:`KVLayout.kv_fused <kvwire.layout.KVLayout.kv_fused>`, ``head_major``): kvwire's
mappers then move head slices, so prefill and decode may differ in TP size (with GQA
replication), block size and page order, like any kvwire pool (:func:`describe_kv_caches`,
``heads`` given).

Otherwise the connector falls back to whole blocks. What every supported layout does have is
this: **the bytes of one block are one contiguous run** (of one layer, or of all layers for
block-major layouts), and blocks sit a fixed stride apart. So the connector describes the pool
by those runs, read from the tensors' real data pointers and strides, never from a layout name:

* one kvwire buffer per layer when a layer's blocks are back to back (``LBNHC``, ``LBHNC``),
  or one buffer per packed group of layers when block-major (``BLNHC``, ``BLHNC``), with one
  slot per vLLM block (``item_len`` = the block's bytes, or the block stride when packed);
* as a model of ``is_mla=True, total_kv_heads=1, page_size=1`` whose "head row" is the whole
  slot: kvwire then moves whole blocks, one descriptor per (buffer, block), and the only
  index arithmetic is the block ids. The row size enters kvwire's layout hash, so a prefill
  and a decode that differ in block size, KV heads per rank, head size, dtype or layout are
  refused at handshake (``head_dim: local=... remote=...``) instead of exchanging garbage.

Consequences of whole blocks: prefill and decode need the same block size, the same layout
and the same KV heads per rank (equal TP for GQA models; MLA latents are replicated, so any
TP pair works as for kvwire's ``mla`` mapper). ``LHBNC`` (heads outside blocks) is refused:
a block is not contiguous there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvwire.errors import LayoutError
from kvwire.layout import DTYPE_SIZES, KVLayout, MemKind, MemoryRegion, ModelSpec, RankPosition
from kvwire_vllm.config import ConnectorOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerBlocks:
    """Where one layer's blocks live: first block's address, bytes of a block, block stride."""

    name: str
    addr: int
    block_bytes: int
    stride: int
    kind: MemKind
    device_id: int
    dtype: str
    end: int  # one past the last byte of the tensor's storage
    shape: tuple[int, ...]  # the view's logical [B * ratio, H, N, C]
    strides: tuple[int, ...]  # its element strides
    ratio: int  # kernel blocks per manager block


@dataclass(frozen=True)
class PoolDescription:
    """The kvwire layout of a vLLM KV pool and how it was read (for logs and checks)."""

    layout: KVLayout
    num_blocks: int
    block_bytes: int
    packed_layers: int  # layers per kvwire buffer: 1 layer-major, >1 block-major

    @property
    def heads(self) -> bool:
        """Whether the pool is described with its heads (head slices can move), not as
        opaque whole blocks."""
        return self.layout.kv_fused

    @property
    def summary(self) -> str:
        """One line for the logs."""
        kind = "layer-major" if self.packed_layers == 1 else f"block-major x{self.packed_layers}"
        if self.heads:
            m = self.layout
            order = "HND" if m.head_major else "NHD"
            kind += f", {m.local_kv_heads} of {m.model.total_kv_heads} KV heads, K|V rows, {order}"
        return (
            f"{len(self.layout.buffers)} buffers ({kind}), {self.num_blocks} blocks of "
            f"{self.layout.buffers[0].item_len} bytes"
        )


def _dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether dims with these sizes and (element) strides cover one dense run, any order."""
    dims = sorted((s, n) for s, n in zip(strides, shape, strict=True) if n != 1)
    want = 1
    for stride, size in dims:
        if stride != want:
            return False
        want *= size
    return True


def _layer_blocks(name: str, t: Any, num_blocks: int) -> LayerBlocks:
    """Read one layer view (``[B*ratio, H, N, C]``) into block address, size and stride."""
    if t.dim() != 4:
        raise LayoutError(
            f"KV cache of layer {name!r} has shape {tuple(t.shape)}; kvwire-vllm expects vLLM's "
            "per-layer [blocks, heads, tokens, content] views (vLLM >= 0.30)"
        )
    shape, strides = tuple(int(x) for x in t.shape), tuple(int(x) for x in t.stride())
    if shape[0] % num_blocks:
        raise LayoutError(
            f"layer {name!r}: {shape[0]} kernel blocks is not a multiple of {num_blocks} blocks"
        )
    ratio = shape[0] // num_blocks  # kernel blocks per manager block
    es = int(t.element_size())
    if not _dense(shape[1:], strides[1:]):
        raise LayoutError(
            f"layer {name!r}: a block of shape {shape[1:]} with strides {strides[1:]} is not one "
            "contiguous run of bytes (a layout with heads outside blocks, such as LHBNC); use "
            "a layer-major (LBNHC, LBHNC) or block-major (BLNHC, BLHNC) KV cache layout"
        )
    kernel_bytes = shape[1] * shape[2] * shape[3] * es
    if ratio > 1 and strides[0] * es != kernel_bytes:
        raise LayoutError(
            f"layer {name!r}: kernel blocks of {kernel_bytes} bytes sit {strides[0] * es} bytes "
            "apart, so a block of the scheduler is not contiguous"
        )
    is_cuda = bool(getattr(t, "is_cuda", False))
    storage = t.untyped_storage()
    dtype = str(t.dtype).removeprefix("torch.")
    return LayerBlocks(
        name=name,
        addr=int(t.data_ptr()),
        block_bytes=kernel_bytes * ratio,
        stride=strides[0] * es * ratio,
        kind=MemKind.VRAM if is_cuda else MemKind.DRAM,
        device_id=int(t.device.index or 0) if is_cuda else 0,
        dtype=dtype if dtype in DTYPE_SIZES else "uint8",
        end=int(storage.data_ptr()) + int(storage.nbytes()),
        shape=shape,
        strides=strides,
        ratio=ratio,
    )


def _regions(layers: list[LayerBlocks], num_blocks: int) -> tuple[list[MemoryRegion], int]:
    """kvwire buffers covering every layer once, and how many layers each packs."""
    first = layers[0]
    if any(
        (x.block_bytes, x.stride, x.kind, x.device_id)
        != (first.block_bytes, first.stride, first.kind, first.device_id)
        for x in layers
    ):
        raise LayoutError(
            "KV cache layers differ in block size, block stride or device; kvwire-vllm "
            "supports models with one uniform attention KV cache group"
        )
    size, stride = first.block_bytes, first.stride
    # Layers that alias the same bytes (KV sharing across layers) are moved once.
    uniq = sorted({x.addr: x for x in layers}.values(), key=lambda x: x.addr)
    if stride == size:  # layer-major: each layer's blocks back to back
        chains = [[x] for x in uniq]
        item = size
    else:  # block-major: a block holds consecutive layers' pages, then the next block
        chains, cur = [], [uniq[0]]
        for x in uniq[1:]:
            if x.addr == cur[-1].addr + size and (len(cur) + 1) * size <= stride:
                cur.append(x)
            else:
                chains.append(cur)
                cur = [x]
        chains.append(cur)
        if len({len(c) for c in chains}) != 1 or len(chains[0]) * size > stride:
            raise LayoutError(
                f"block-major KV cache: layers of {size}-byte pages do not tile the "
                f"{stride}-byte block stride evenly; cannot describe it as packed slots"
            )
        item = stride
    out = []
    for chain in chains:
        base, length = chain[0].addr, num_blocks * item
        if base + length > chain[0].end:
            raise LayoutError(
                f"layer {chain[0].name!r}: {num_blocks} slots of {item} bytes run past the end "
                "of its storage"
            )
        out.append(MemoryRegion.from_pointer(base, length, item, first.kind, first.device_id))
    return out, len(chains[0])


@dataclass(frozen=True)
class HeadFacts:
    """Model facts that let the worker describe its pool with heads: the KV head size (K's
    and V's, which must be equal) and the model's total KV heads (vLLM's
    ``ModelConfig.get_total_num_kv_heads()``)."""

    head_size: int
    total_kv_heads: int


def head_facts(
    vllm_config: Any, kv_cache_config: Any, opts: ConnectorOptions, tp: int
) -> HeadFacts | None:
    """The model facts a worker needs to describe its pool with heads, or None (``kv_pool:
    blocks``, MLA, K and V of different sizes: whole blocks then). Both roles, at
    construction."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    spec = groups[0].kv_cache_spec if groups else None
    if opts.kv_pool != "heads" or spec is None or "MLA" in type(spec).__name__:
        return None
    head, head_v = getattr(spec, "head_size", None), getattr(spec, "head_size_v", None)
    local = getattr(spec, "num_kv_heads", None)
    if not isinstance(head, int) or head_v != head or not isinstance(local, int):
        return None
    total = opts.total_kv_heads
    mc = getattr(vllm_config, "model_config", None)
    if total is None and mc is not None:
        total = int(mc.get_total_num_kv_heads())
    return HeadFacts(head_size=head, total_kv_heads=total or local * tp)


def _head_layout(
    layers: list[LayerBlocks], regions: list[MemoryRegion], facts: HeadFacts, rank: RankPosition
) -> KVLayout | None:
    """The pool as fused K|V pages with heads, or None when its layout cannot be (block-major,
    heads split across kernel blocks, K and V of other sizes, unknown dtype)."""
    x = layers[0]
    _, h, n, c = x.shape
    s_h, s_n = x.strides[1], x.strides[2]
    if x.dtype == "uint8" or c != 2 * facts.head_size:
        return None
    head_major = s_h > s_n
    if head_major and x.ratio > 1:
        return None  # [ratio, H, N, C]: a block is not one head-major page
    if x.stride != x.block_bytes:
        return None  # block-major: several layers' pages per block
    tp = rank.tp_size
    local = max(1, facts.total_kv_heads // tp)
    if local != h:
        raise LayoutError(
            f"the KV cache holds {h} heads per rank, but the model's {facts.total_kv_heads} KV "
            f"heads over TP {tp} give {local}; check the model's KV head count"
        )
    model = ModelSpec(
        num_layers=len(regions),
        total_kv_heads=facts.total_kv_heads,
        head_dim=facts.head_size,
        dtype=x.dtype,
        page_size=n * x.ratio,
    )
    return KVLayout(
        model=model, rank=rank, buffers=tuple(regions), kv_fused=True, head_major=head_major
    )


def describe_kv_caches(
    kv_caches: Mapping[str, Any],
    num_blocks: int,
    rank: RankPosition,
    heads: HeadFacts | None = None,
) -> PoolDescription:
    """Describe vLLM's per-layer KV views (``register_kv_caches``' argument) to kvwire.

    Worker side, once at startup. ``num_blocks`` is ``KVCacheConfig.num_blocks`` (the
    scheduler's block ids run over ``[0, num_blocks)``). With ``heads``, a layer-major pool
    is described with its heads (any TP pair, block size and page order can then move);
    without, or for layouts that cannot be, as whole blocks. Raises
    :class:`~kvwire.errors.LayoutError` for a layout kvwire-vllm cannot move.
    """
    if not kv_caches:
        raise LayoutError("register_kv_caches got no KV cache tensors")
    if num_blocks <= 0:
        raise LayoutError(f"num_blocks must be > 0, got {num_blocks}")
    layers = [_layer_blocks(name, t, num_blocks) for name, t in kv_caches.items()]
    regions, packed = _regions(layers, num_blocks)
    fused = _head_layout(layers, regions, heads, rank) if heads is not None else None
    if fused is not None:
        fused._owners = tuple(kv_caches.values())
        desc = PoolDescription(fused, num_blocks, layers[0].block_bytes, packed)
        logger.info("kvwire-vllm: KV pool of %d layers as %s", len(layers), desc.summary)
        return desc
    dtypes = {x.dtype for x in layers}
    dtype = dtypes.pop() if len(dtypes) == 1 else "uint8"
    dsize = DTYPE_SIZES[dtype]
    item = regions[0].item_len
    if item % dsize:
        dtype, dsize = "uint8", 1
    model = ModelSpec(
        num_layers=len(regions),
        total_kv_heads=1,
        head_dim=item // dsize,
        dtype=dtype,
        page_size=1,
        is_mla=True,
    )
    layout = KVLayout(model=model, rank=rank, buffers=tuple(regions))
    # The regions are raw addresses: hold the tensors for as long as the layout lives.
    layout._owners = tuple(kv_caches.values())
    desc = PoolDescription(layout, num_blocks, layers[0].block_bytes, packed)
    logger.info("kvwire-vllm: KV pool of %d layers as %s", len(layers), desc.summary)
    return desc
