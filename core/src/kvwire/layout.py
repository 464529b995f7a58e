"""KV layout: what one rank owns and how its KV pool is shaped (its regions: :mod:`kvwire.regions`).

A :class:`KVLayout` is built once per rank at startup, by the engine that embeds kvwire, from
its KV pool (torch tensors or raw pointers). It is exchanged with peers at handshake and is the
input of every :class:`~kvwire.index.base.IndexMapper`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cached_property
from typing import Any, Self

import numpy as np
from numpy.typing import NDArray
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from kvwire.buffer_groups import (
    BufferGroup,
    GroupSection,
    group_problems,
)
from kvwire.errors import LayoutError
from kvwire.regions import (
    ADDR_LIMIT,
    DTYPE_SIZES,
    MemKind,
    MemoryRegion,
    check_no_overlap,
)

__all__ = [
    "ADDR_LIMIT",
    "DTYPE_SIZES",
    "BufferGroup",
    "GroupSection",
    "KVLayout",
    "MemKind",
    "MemoryRegion",
    "ModelSpec",
    "RankPosition",
    "check_no_overlap",
    "compatibility_problems",
    "group_problems",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ModelSpec(BaseModel):
    """Model facts that decide the shape of the KV cache; must agree across prefill and decode."""

    model_config = _FROZEN

    num_layers: int = Field(ge=1)
    total_kv_heads: int = Field(ge=1, description="KV heads of the whole model (MLA: 1).")
    head_dim: int = Field(ge=1, description="Elements per head row (MLA: kv_lora_rank + rope).")
    dtype: str = "bfloat16"
    page_size: int = Field(default=1, ge=1, description="Tokens per page slot.")
    is_mla: bool = False

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.dtype not in DTYPE_SIZES:
            raise LayoutError(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}"
            )
        if self.is_mla and self.total_kv_heads != 1:
            raise LayoutError(
                f"an MLA model has one shared latent 'head'; got total_kv_heads="
                f"{self.total_kv_heads}. Set total_kv_heads=1 and head_dim=kv_lora_rank+rope_dim"
            )
        return self

    @property
    def dtype_size(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]


class RankPosition(BaseModel):
    """Where a rank sits in its instance: attention TP and pipeline (PP) coordinates."""

    model_config = _FROZEN

    tp_size: int = Field(default=1, ge=1)
    tp_rank: int = Field(default=0, ge=0)
    pp_size: int = Field(default=1, ge=1)
    pp_rank: int = Field(default=0, ge=0)
    dp_rank: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.tp_rank >= self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} is not below tp_size {self.tp_size}")
        if self.pp_rank >= self.pp_size:
            raise LayoutError(f"pp_rank {self.pp_rank} is not below pp_size {self.pp_size}")
        return self

    @property
    def sender_id(self) -> int:
        """Unique id of this rank among all ranks of its instance (``pp_rank * tp + tp_rank``)."""
        return self.pp_rank * self.tp_size + self.tp_rank


#: Fields of :class:`ModelSpec` that must be equal on both sides of a transfer.
COMPAT_FIELDS = ("page_size", "dtype", "head_dim", "num_layers", "total_kv_heads", "is_mla")


class KVLayout(BaseModel):
    """The KV pool of one rank: model facts, its position, and its KV buffers.

    ``buffers`` are ordered ``[K_start .. K_end-1, V_start .. V_end-1]`` for MHA/GQA and
    ``[L_start .. L_end-1]`` for MLA and for pools holding K and V in one buffer per layer
    (:attr:`kv_fused`, :attr:`kv_in_slot`), where
    ``[start_layer, end_layer)`` are the layers this rank holds (its PP stage). Every buffer
    has the same number of slots. ``groups`` are the rank's other buffers (per-request state,
    sliding-window KV, draft-model layers; see :class:`BufferGroup`); a layout without groups
    serialises and hashes exactly as before protocol 1.4.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    #: Objects owning the memory of :attr:`buffers` (the engine's tensors, when built with
    #: :meth:`from_tensors`); held so the memory outlives every registration of this layout.
    _owners: tuple[Any, ...] = PrivateAttr(default=())
    #: Set only on a mapper's plane view of a pool holding K and V in one buffer
    #: (:func:`kvwire.index.planes.split_kv`): bytes from one head of a token row to the next,
    #: bytes of one head in a plane, and bytes of one plane's page.
    _pitch: int = PrivateAttr(default=0)
    _plane: int = PrivateAttr(default=0)
    _page: int = PrivateAttr(default=0)

    model: ModelSpec
    rank: RankPosition = RankPosition()
    start_layer: int = Field(default=0, ge=0)
    end_layer: int | None = None
    buffers: tuple[MemoryRegion, ...]
    groups: tuple[BufferGroup, ...] = ()
    #: Pages are head-major, ``[slots, heads, page_size, head_dim]`` per buffer (a head's
    #: tokens contiguous), instead of token-major ``[slots, page_size, heads, head_dim]``.
    head_major: bool = False
    #: K and V of a head side by side in each row: one buffer per layer, pages
    #: ``[slots, page_size, heads, 2, head_dim]`` (head-major: ``[slots, heads, page_size, 2,
    #: head_dim]``), as vLLM keeps its FlashAttention cache. Not for MLA.
    kv_fused: bool = False
    #: K's page then V's page inside each slot: one buffer per layer, ``[slots, 2, page_size,
    #: heads, head_dim]`` (head-major: ``[slots, 2, heads, page_size, head_dim]``), as
    #: FlashInfer-style and TensorRT-LLM caches keep them. Not for MLA, not with kv_fused.
    kv_in_slot: bool = False

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):  # older peers and fixtures see the layout they know
            if not data.get("groups"):
                data.pop("groups", None)
            for flag in ("head_major", "kv_fused", "kv_in_slot"):
                if not data.get(flag):
                    data.pop(flag, None)
        return data

    def byte_offsets(self, tokens: Any, heads: Any) -> NDArray[np.uint64]:
        """Byte offset inside a page slot of (token ``tokens[i]``, local head ``heads[j]``),
        shape ``[len(tokens), len(heads)]``, for this layout's page order."""
        m = self.model
        hb = np.uint64(self.elem_pitch)
        t = np.asarray(tokens, dtype=np.uint64)[:, None]
        h = np.asarray(heads, dtype=np.uint64)[None, :]
        if self.head_major:
            out: NDArray[np.uint64] = (h * np.uint64(m.page_size) + t) * hb
        else:
            out = (t * np.uint64(self.local_kv_heads) + h) * hb
        return out

    @model_validator(mode="after")
    def _check(self) -> Self:
        m = self.model
        end = self.end_layer if self.end_layer is not None else m.num_layers
        if not (self.start_layer < end <= m.num_layers):
            raise LayoutError(
                f"layer range [{self.start_layer}, {end}) is not inside the model's "
                f"{m.num_layers} layers"
            )
        nl = end - self.start_layer
        if self.kv_fused and m.is_mla:
            raise LayoutError(
                "kv_fused: an MLA pool has no separate K and V (one latent buffer per layer); "
                "leave kv_fused False"
            )
        if self.kv_in_slot and (m.is_mla or self.kv_fused):
            raise LayoutError(
                "kv_in_slot: K's page then V's page in each slot; not for MLA (one latent "
                "buffer) nor with kv_fused (K and V side by side in each row): pick one"
            )
        one = m.is_mla or self.kv_fused or self.kv_in_slot
        want = nl if one else 2 * nl
        if len(self.buffers) != want:
            shape = (
                "one buffer per layer (MLA)"
                if m.is_mla
                else "one K|V buffer per layer (kv_fused)"
                if self.kv_fused
                else "one buffer per layer with K's then V's page (kv_in_slot)"
                if self.kv_in_slot
                else "a K and a V buffer per layer"
            )
            raise LayoutError(
                f"expected {want} buffers for layers [{self.start_layer}, {end}) ({shape}); "
                f"got {len(self.buffers)}"
            )
        tp, heads = self.rank.tp_size, m.total_kv_heads
        if not m.is_mla and heads % tp and tp % heads:
            raise LayoutError(f"total_kv_heads={heads} and tp_size={tp}: one must divide the other")
        slots = {b.num_items for b in self.buffers}
        if len(slots) != 1:
            raise LayoutError(f"all KV buffers must have the same number of slots; got {slots}")
        row = self.token_row_bytes
        pages = 2 if self.kv_in_slot else 1
        for i, b in enumerate(self.buffers):
            if b.item_len != pages * m.page_size * row:
                raise LayoutError(
                    f"buffer {i}: item_len {b.item_len} != {'2 pages x ' * (pages - 1)}"
                    f"page_size {m.page_size} x token row {row} bytes ({self.local_kv_heads} "
                    f"heads x {self.head_bytes} B{' (K|V)' if self.kv_fused else ''}); check "
                    "heads per rank, head_dim, dtype, kv_fused and kv_in_slot"
                )
        if self.head_major and m.is_mla:
            raise LayoutError(
                "head_major: an MLA pool has one latent head, so its pages are the same in "
                "either order; leave head_major False"
            )
        check_no_overlap(self.buffers, "KV buffers")
        if self.groups:
            self._check_groups()
        return self

    def _check_groups(self) -> None:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise LayoutError(f"buffer group names must be unique; got {names}")
        tp = self.rank.tp_size
        for g in self.groups:
            for sec in g.head_sections if g.sharding == "heads" else ():
                if sec.total_heads % tp and tp % sec.total_heads:
                    what = "a section's total_heads" if g.sections else "total_heads"
                    raise LayoutError(
                        f"buffer group {g.name!r}: {what}={sec.total_heads} and tp_size={tp}: "
                        "one must divide the other (or use sharding='replicated')"
                    )
            if g.kind == "paged" and g.page_size != self.model.page_size:
                raise LayoutError(
                    f"buffer group {g.name!r}: a paged group shares the KV page indices, so its "
                    f"page_size ({g.page_size}) must equal the model's ({self.model.page_size})"
                )
            if g.kind == "paged" and g.num_slots != self.buffers[0].num_items:
                raise LayoutError(
                    f"buffer group {g.name!r}: a paged group shares the KV page indices, so it "
                    f"needs the KV pool's {self.buffers[0].num_items} slots, not {g.num_slots}"
                )
            want = g.item_len(tp)
            for i, b in enumerate(g.buffers):
                if b.item_len != want:
                    raise LayoutError(
                        f"buffer group {g.name!r} buffer {i}: item_len {b.item_len} != "
                        f"{g.geometry_text(tp)} x {g.dtype_size} B = {want}; check heads per "
                        "rank, head_elems and dtype"
                    )
        check_no_overlap(
            [*self.buffers, *(b for g in self.groups for b in g.buffers)], "KV and group buffers"
        )

    @property
    def layer_end(self) -> int:
        """One past the last layer this rank holds."""
        return self.end_layer if self.end_layer is not None else self.model.num_layers

    def group(self, name: str) -> BufferGroup | None:
        """The buffer group called ``name``, or None."""
        return next((g for g in self.groups if g.name == name), None)

    @property
    def group_regions(self) -> tuple[MemoryRegion, ...]:
        """Every buffer of every group (registered with the backend beside the KV buffers)."""
        return tuple(b for g in self.groups for b in g.buffers)

    @property
    def num_slots(self) -> int:
        """Page slots per buffer."""
        return self.buffers[0].num_items

    @property
    def local_kv_heads(self) -> int:
        """KV heads held by this rank (replicated heads count once)."""
        if self.model.is_mla:
            return 1
        return max(1, self.model.total_kv_heads // self.rank.tp_size)

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token in one buffer (K and V together when fused)."""
        if self._plane:
            return self._plane
        m = self.model
        return m.head_dim * m.dtype_size * (2 if self.kv_fused else 1)

    @property
    def elem_pitch(self) -> int:
        """Bytes from one head of a token row to the next (from one token of a head to the
        next, head-major): :attr:`head_bytes`, except on a plane view of a fused pool."""
        return self._pitch or self.head_bytes

    @property
    def token_row_bytes(self) -> int:
        """Bytes of one token's row in one buffer."""
        return self.local_kv_heads * self.elem_pitch

    @property
    def slot_bytes(self) -> int:
        """Bytes from one page slot of a buffer to the next."""
        return self.buffers[0].item_len

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one buffer (of K or of V in a :attr:`kv_in_slot` slot): the
        slot, except where a slot holds two pages."""
        if self._page:
            return self._page
        return self.slot_bytes // 2 if self.kv_in_slot else self.slot_bytes

    @cached_property
    def buffer_keys(self) -> NDArray[np.int64]:
        """``(layer, kv)`` of each buffer, shape ``[n, 2]``; kv is 0 for K (or MLA, or a fused
        K|V buffer), 1 for V."""
        layers = np.arange(self.start_layer, self.layer_end, dtype=np.int64)
        if self.model.is_mla or self.kv_fused or self.kv_in_slot:
            return np.stack([layers, np.zeros_like(layers)], axis=1)
        kv = np.repeat(np.array([0, 1], dtype=np.int64), len(layers))
        return np.stack([np.tile(layers, 2), kv], axis=1)

    @cached_property
    def bases(self) -> NDArray[np.uint64]:
        """Base address of each buffer."""
        return np.array([b.addr for b in self.buffers], dtype=np.uint64)

    @cached_property
    def devices(self) -> NDArray[np.uint64]:
        """Device id of each buffer."""
        return np.array([b.device_id for b in self.buffers], dtype=np.uint64)

    def compatibility_hash(self, page_size: int | None = None) -> str:
        """Digest of the model facts both sides must share (see :data:`COMPAT_FIELDS`).
        ``page_size``: the peer's page size, when the sides may differ in it (prefill hashes
        its layout with decode's page size when acknowledging a converting link, so decode,
        hashing its own layout, sees the same digest)."""
        model = (
            self.model
            if page_size is None
            else self.model.model_copy(update={"page_size": page_size})
        )
        text = "|".join(f"{f}={getattr(model, f)}" for f in COMPAT_FIELDS)
        if self.groups:  # absent for layouts without groups: their hash is unchanged
            text += "|groups=" + ";".join(g.compat_text() for g in self.groups)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_tensors(
        cls,
        model: ModelSpec,
        tensors: Sequence[Any],
        rank: RankPosition | None = None,
        start_layer: int = 0,
        end_layer: int | None = None,
        groups: Sequence[BufferGroup] = (),
        group_tensors: Sequence[Any] = (),
        head_major: bool = False,
        kv_fused: bool = False,
        kv_in_slot: bool = False,
    ) -> KVLayout:
        """Build a layout from the engine's KV tensors, ordered as :attr:`buffers` documents.
        ``groups`` (built with regions from ``group_tensors``, which are kept alive with the
        layout) are the rank's other buffers (:class:`BufferGroup`). ``head_major``: the
        tensors are ``[slots, heads, page_size, head_dim]`` (see :attr:`head_major`);
        ``kv_fused``: one tensor per layer holds K and V side by side (:attr:`kv_fused`);
        ``kv_in_slot``: one tensor per layer holds K's page then V's in each slot."""
        regions = tuple(MemoryRegion.from_tensor(t) for t in tensors)
        layout = cls(
            model=model,
            rank=rank or RankPosition(),
            start_layer=start_layer,
            end_layer=end_layer,
            buffers=regions,
            groups=tuple(groups),
            head_major=head_major,
            kv_fused=kv_fused,
            kv_in_slot=kv_in_slot,
        )
        # The regions are raw addresses: keep the tensors alive as long as the layout (and so
        # every manager that registered it) exists, or a dropped tensor frees registered memory.
        layout._owners = (*tensors, *group_tensors)
        return layout


def compatibility_problems(local: ModelSpec, remote: ModelSpec) -> list[str]:
    """Name every model field that differs, with both values; empty when compatible."""
    return [
        f"{f}: local={getattr(local, f)!r} remote={getattr(remote, f)!r}"
        for f in COMPAT_FIELDS
        if getattr(local, f) != getattr(remote, f)
    ]
