"""One description of a KV layout: every buffer of a rank as named dims with byte strides.

A buffer is a strided array whose dims have names (outermost first), e.g. a token-major page
pool ``("slot", "page", "head", "dim")``. The names are the vocabulary every mover and mapper
shares, so nothing else needs to read layout flags:

* ``slot``: the page slot an engine's page index addresses (required, any position);
* ``layer``: layers of the model held in one buffer (vLLM's cross-layer blocks), counted from
  :attr:`BufferDims.first_layer`; absent: the buffer holds that one layer;
* ``kv``: K (0) and V (1) in one buffer (size 2); absent: the buffer holds
  :attr:`BufferDims.kv` only;
* ``page``: the tokens of a page (size ``page_size``; required);
* ``head``: the rank's KV heads (absent only with ``latent``);
* ``dim``: a head's elements, innermost and contiguous (stride = element size);
* ``latent``: MLA's one latent row (``kv_lora_rank + rope``), innermost, in place of
  ``head`` and ``dim``: one head of ``latent`` elements.

:data:`LAYOUTS` names the layouts kvwire knows; :func:`dims_of` derives the description of a
:class:`~kvwire.layout.KVLayout` (its flags ``head_major``, ``kv_fused``, ``kv_in_slot`` and
``is_mla`` become dims tuples), and :func:`cross_layer_dims` describes a pool with all layers of
a block contiguous, which a :class:`~kvwire.layout.KVLayout` cannot express yet. Byte runs
between two descriptions: :mod:`kvwire.index.dims_runs`.

Built by whoever addresses a pool (a mapper or a mover), on either side, from a layout it
holds or received in the handshake; immutable, thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvwire.errors import LayoutError
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.regions import MemoryRegion

__all__ = [
    "DIM_NAMES",
    "LAYOUTS",
    "BufferDims",
    "LayoutDims",
    "buffer_dims",
    "cross_layer_dims",
    "dims_of",
    "layout_names",
]

#: Every dim name a buffer may use (see the module docstring).
DIM_NAMES = ("slot", "layer", "kv", "page", "head", "dim", "latent")

#: The layouts kvwire knows: the dims of one buffer, outermost first.
LAYOUTS: dict[str, tuple[str, ...]] = {
    # one buffer per layer and K/V (KVLayout's default; head_major=True)
    "nhd": ("slot", "page", "head", "dim"),
    "hnd": ("slot", "head", "page", "dim"),
    # K and V side by side in each row, one buffer per layer (vLLM; kv_fused=True)
    "nhd_fused": ("slot", "page", "head", "kv", "dim"),
    "hnd_fused": ("slot", "head", "page", "kv", "dim"),
    # K's page then V's page in each slot (FlashInfer, TensorRT-LLM; kv_in_slot=True)
    "nhd_in_slot": ("slot", "kv", "page", "head", "dim"),
    "hnd_in_slot": ("slot", "kv", "head", "page", "dim"),
    # MLA: one latent row per token, one buffer per layer (is_mla=True)
    "mla": ("slot", "page", "latent"),
    # vLLM's cross-layer blocks: every layer's K and V of a block contiguous, one buffer
    "cross_layer": ("slot", "layer", "kv", "page", "head", "dim"),
    "cross_layer_hnd": ("slot", "layer", "kv", "head", "page", "dim"),
}


@dataclass(frozen=True)
class BufferDims:
    """One buffer of a rank described by named dims: ``names`` outermost first, their
    ``sizes`` and byte ``strides``, the element size ``elem``, and the registered region it
    lives in (``addr``, ``length``, ``device``). ``first_layer`` is the model layer of index 0
    along ``layer`` (or the one layer the buffer holds); ``kv`` the half a buffer without a
    ``kv`` dim holds (0: K, or MLA's latent; 1: V). Check with :meth:`check`."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    elem: int
    addr: int
    length: int
    device: int = 0
    first_layer: int = 0
    kv: int = 0

    def size(self, name: str) -> int:
        """Size of dim ``name`` (1 when the buffer has no such dim)."""
        return self.sizes[self.names.index(name)] if name in self.names else 1

    def stride(self, name: str) -> int:
        """Byte stride of dim ``name`` (0 when the buffer has no such dim)."""
        return self.strides[self.names.index(name)] if name in self.names else 0

    @property
    def inner(self) -> str:
        """The innermost dim (``dim`` or ``latent``)."""
        return self.names[-1]

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token for one of K/V (MLA: the latent row)."""
        return self.size(self.inner) * self.elem

    @property
    def layers(self) -> range:
        """Model layers this buffer holds."""
        return range(self.first_layer, self.first_layer + self.size("layer"))

    @property
    def kvs(self) -> range:
        """K/V halves this buffer holds (``range(0, 2)`` with a ``kv`` dim)."""
        return range(0, 2) if "kv" in self.names else range(self.kv, self.kv + 1)

    @property
    def extent(self) -> int:
        """Bytes from the buffer's first element to one past its last."""
        return sum((n - 1) * s for n, s in zip(self.sizes, self.strides, strict=True)) + self.elem

    def check(self, where: str = "buffer") -> None:
        """The validation rule of a description; raises :class:`LayoutError` naming the
        problem: known unique names; ``slot`` and ``page`` present; ``dim`` (with ``head``) or
        ``latent`` (without ``head`` and ``kv``) innermost with the element size as stride; a
        ``kv`` dim of 2; positive sizes and strides; no two elements at one byte (each stride
        at least the extent of the dims inside it); everything inside the region."""
        names, sizes, strides = self.names, self.sizes, self.strides
        if not (len(names) == len(sizes) == len(strides)):
            raise LayoutError(
                f"{where}: {len(names)} names, {len(sizes)} sizes, {len(strides)} strides"
            )
        unknown = [n for n in names if n not in DIM_NAMES]
        if unknown or len(set(names)) != len(names):
            raise LayoutError(
                f"{where}: dims {names} must be distinct names from {DIM_NAMES}"
                + (f"; unknown {unknown}" if unknown else "")
            )
        for need in ("slot", "page"):
            if need not in names:
                raise LayoutError(f"{where}: dims {names} lack {need!r}")
        inner = names[-1]
        if inner not in ("dim", "latent") or ("dim" in names) == ("latent" in names):
            raise LayoutError(f"{where}: dims {names} must end in 'dim' or 'latent' (one of them)")
        if inner == "dim" and "head" not in names:
            raise LayoutError(f"{where}: dims {names} have 'dim' without 'head'")
        if inner == "latent" and ("head" in names or "kv" in names):
            raise LayoutError(f"{where}: an MLA latent buffer {names} has no 'head' nor 'kv' dim")
        if self.elem < 1 or any(n < 1 for n in sizes) or any(s < 1 for s in strides):
            raise LayoutError(
                f"{where}: sizes {sizes}, strides {strides} and element size {self.elem} must "
                "be positive"
            )
        if strides[-1] != self.elem:
            raise LayoutError(
                f"{where}: the innermost dim {inner!r} must be contiguous (stride {strides[-1]} "
                f"!= element size {self.elem})"
            )
        if "kv" in names and self.size("kv") != 2:
            raise LayoutError(f"{where}: a 'kv' dim holds K and V (size 2), not {self.size('kv')}")
        if "kv" not in names and self.kv not in (0, 1):
            raise LayoutError(f"{where}: kv={self.kv}; a buffer holds K (0) or V (1)")
        if self.first_layer < 0:
            raise LayoutError(f"{where}: first_layer {self.first_layer} < 0")
        reach = self.elem  # bytes spanned by the dims inside the current one
        for n, s in sorted(zip(sizes, strides, strict=True), key=lambda p: p[1]):
            if n > 1 and s < reach:
                raise LayoutError(
                    f"{where}: dims {names} with strides {strides} overlap (a stride of {s} "
                    f"bytes inside {reach} bytes of inner dims)"
                )
            reach += (n - 1) * s
        if self.extent > self.length:
            raise LayoutError(
                f"{where}: dims {names} x {sizes} with strides {strides} span {self.extent} "
                f"bytes, past the registered region of {self.length}"
            )


def buffer_dims(
    names: Sequence[str],
    region: MemoryRegion,
    model: ModelSpec,
    local_heads: int,
    first_layer: int = 0,
    num_layers: int = 1,
    kv: int = 0,
) -> BufferDims:
    """The description of ``region`` holding dims ``names`` of ``model``, densely packed
    (C order) inside each slot, slots ``region.item_len`` apart: sizes from the model
    (``page_size``, ``head_dim``, ``local_heads``; ``layer``: ``num_layers``; ``kv``: 2;
    ``slot``: the region's slots). Checked (:meth:`BufferDims.check`)."""
    size_of = {
        "slot": region.num_items,
        "layer": num_layers,
        "kv": 2,
        "page": model.page_size,
        "head": local_heads,
        "dim": model.head_dim,
        "latent": model.head_dim,
    }
    names = tuple(names)
    unknown = [n for n in names if n not in size_of]
    if unknown:
        raise LayoutError(f"dims {names}: unknown {unknown}; known {DIM_NAMES}")
    sizes = tuple(size_of[n] for n in names)
    strides = [0] * len(names)
    step = model.dtype_size
    for i in range(len(names) - 1, -1, -1):
        strides[i] = region.item_len if names[i] == "slot" else step
        step = strides[i] * sizes[i]
    out = BufferDims(
        names=names,
        sizes=sizes,
        strides=tuple(strides),
        elem=model.dtype_size,
        addr=region.addr,
        length=region.length,
        device=region.device_id,
        first_layer=first_layer,
        kv=kv,
    )
    out.check(f"buffer at {region.addr:#x}")
    return out


@dataclass(frozen=True)
class LayoutDims:
    """Every KV buffer of one rank, described by named dims. Checked at construction: each
    buffer's rule (:meth:`BufferDims.check`), one page size, head count, head size and slot
    count across the buffers, and no (layer, K/V) held twice."""

    buffers: tuple[BufferDims, ...]

    def __post_init__(self) -> None:
        if not self.buffers:
            raise LayoutError("a layout description needs at least one buffer")
        for i, b in enumerate(self.buffers):
            b.check(f"buffer {i}")
        first = self.buffers[0]
        for what in ("page", "head", "slot"):
            got = {b.size(what) for b in self.buffers}
            if len(got) != 1:
                raise LayoutError(f"buffers disagree on the size of {what!r}: {sorted(got)}")
        if len({(b.head_bytes, b.inner) for b in self.buffers}) != 1:
            raise LayoutError("buffers disagree on the head (bytes of 'dim' or 'latent')")
        for what in ("slot", "page"):  # a unit is addressed alike in every buffer
            got = {b.stride(what) for b in self.buffers}
            if len(got) != 1:
                raise LayoutError(f"buffers disagree on the stride of {what!r}: {sorted(got)}")
        seen: set[tuple[int, int]] = set()
        for b in self.buffers:
            keys = {(layer, kv) for layer in b.layers for kv in b.kvs}
            if keys & seen:
                raise LayoutError(
                    f"(layer, K/V) {sorted(keys & seen)[:3]} held by two buffers (dims "
                    f"{first.names})"
                )
            seen |= keys

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.buffers[0].size("page")

    @property
    def heads(self) -> int:
        """Heads per token of each of K and V (1 for MLA)."""
        return self.buffers[0].size("head")

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token for one of K/V."""
        return self.buffers[0].head_bytes

    @property
    def num_slots(self) -> int:
        """Page slots per buffer."""
        return self.buffers[0].size("slot")

    @property
    def is_latent(self) -> bool:
        """An MLA pool (a latent row per token)."""
        return self.buffers[0].inner == "latent"


def layout_names(layout: KVLayout) -> tuple[str, ...]:
    """The dims of each buffer of ``layout`` (one of :data:`LAYOUTS`), from its flags."""
    if layout.model.is_mla:
        return LAYOUTS["mla"]
    order = "hnd" if layout.head_major else "nhd"
    if layout.kv_fused:
        return LAYOUTS[f"{order}_fused"]
    if layout.kv_in_slot:
        return LAYOUTS[f"{order}_in_slot"]
    return LAYOUTS[order]


def dims_of(layout: KVLayout) -> LayoutDims:
    """The description of a rank's real :class:`~kvwire.layout.KVLayout` (not a mapper's
    plane view): one :class:`BufferDims` per buffer, in the layout's buffer order. Called by a
    mapper or mover on either side, for its own layout or a peer's."""
    if layout._pitch or layout._plane or layout._page:
        raise LayoutError("dims_of describes a rank's layout, not a mapper's plane view")
    names = layout_names(layout)
    nl = layout.layer_end - layout.start_layer
    one = len(layout.buffers) == nl  # one buffer per layer (MLA, fused rows, in-slot)
    return LayoutDims(
        tuple(
            buffer_dims(
                names,
                region,
                layout.model,
                layout.local_kv_heads,
                first_layer=layout.start_layer + i % nl,
                kv=0 if one else i // nl,
            )
            for i, region in enumerate(layout.buffers)
        )
    )


def cross_layer_dims(
    model: ModelSpec,
    region: MemoryRegion,
    rank: RankPosition | None = None,
    start_layer: int = 0,
    end_layer: int | None = None,
    head_major: bool = False,
) -> LayoutDims:
    """A pool with every layer of a block contiguous (vLLM's cross-layer KV blocks): one
    region whose slot holds ``[layers, 2, page, heads, dim]`` (``head_major``: ``[layers, 2,
    heads, page, dim]``) for layers ``[start_layer, end_layer)``. Not for MLA."""
    if model.is_mla:
        raise LayoutError("cross-layer blocks hold K and V; an MLA pool is one latent per layer")
    rank = rank or RankPosition()
    end = model.num_layers if end_layer is None else end_layer
    if not 0 <= start_layer < end <= model.num_layers:
        raise LayoutError(f"layers [{start_layer}, {end}) are not inside {model.num_layers}")
    heads = max(1, model.total_kv_heads // rank.tp_size)
    names = LAYOUTS["cross_layer_hnd" if head_major else "cross_layer"]
    want = (end - start_layer) * 2 * model.page_size * heads * model.head_dim * model.dtype_size
    if region.item_len != want:
        raise LayoutError(
            f"a cross-layer block of {end - start_layer} layers x K/V x {model.page_size} tokens "
            f"x {heads} heads x {model.head_dim} x {model.dtype_size} B is {want} bytes; the "
            f"region's slots are {region.item_len}"
        )
    return LayoutDims((buffer_dims(names, region, model, heads, start_layer, end - start_layer),))
