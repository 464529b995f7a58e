"""KV layout: what one rank owns and how its KV pool is shaped (its regions: :mod:`kvwire.regions`).

A :class:`KVLayout` is built once per rank at startup, by the engine that embeds kvwire, from
its KV pool (torch tensors or raw pointers). It is exchanged with peers at handshake and is the
input of every :class:`~kvwire.index.base.IndexMapper`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cached_property
from typing import Any, Literal, Self

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

#: Kinds of buffer groups beyond the paged K/V of :class:`ModelSpec`'s attention layers.
GroupKind = Literal["state", "window", "paged"]

#: Default index set of each group kind (see :attr:`BufferGroup.index`).
DEFAULT_GROUP_INDEX: dict[str, str] = {"state": "state", "window": "window", "paged": "pages"}

#: Fields of :class:`BufferGroup` that must be equal on both sides of a transfer.
GROUP_COMPAT_FIELDS = (
    "kind",
    "index",
    "num_layers",
    "per_layer",
    "total_heads",
    "sharding",
    "head_elems",
    "dtype",
    "page_size",
    "window",
    "sections",
)


class GroupSection(BaseModel):
    """One separately head-sharded part of each row of a :class:`BufferGroup` slot (protocol
    1.6): ``total_heads`` heads of ``head_elems`` elements, split across TP ranks like KV heads
    (``max(1, total_heads // tp)`` per rank, replicated when there are fewer heads than
    ranks). Built by the engine, both roles, e.g. the q, k and v channel blocks of a
    gated-delta-net conv state."""

    model_config = _FROZEN

    total_heads: int = Field(ge=1, description="Heads of this section in the whole model.")
    head_elems: int = Field(ge=1, description="Elements of one head in one row.")

    def local_heads(self, tp_size: int) -> int:
        """Heads of this section a rank of a TP group of ``tp_size`` holds."""
        return max(1, self.total_heads // tp_size)

    def __str__(self) -> str:
        return f"{self.total_heads}x{self.head_elems}"


class BufferGroup(BaseModel):
    """Buffers of a rank beyond the attention layers' paged K/V, with their own indexing.

    * ``kind="state"``: one slot per request per layer (Mamba/SSM conv and temporal states,
      linear-attention states). A request names its slot through ``state_indices``.
    * ``kind="window"``: sliding-window attention KV in its own paged pool; only the pages of
      the request's last ``window`` tokens move. A request names those pages (of this pool,
      last pages of the request, in order) through ``state_indices``.
    * ``kind="paged"``: extra paged layers addressed by the attention KV's own page indices
      (the draft model's KV, MTP layers); ``page_size`` must equal the model's.

    Each buffer holds slots of ``page_size`` rows (tokens for a window or paged group; for a
    state, 1 unless its slot is stored row by row, e.g. a conv state ``[K-1, channels]``) of
    ``local_heads`` heads of ``head_elems`` elements of ``dtype``: ``item_len = page_size *
    local_heads * head_elems * dtype_size``. ``sharding="heads"`` splits ``total_heads`` across
    TP ranks like KV heads (replicated when there are fewer heads than ranks: ``local_heads =
    max(1, H // tp)``); ``"replicated"`` keeps every head on every rank (sent once, by one
    rank). ``buffers`` are ordered ``[part 0 of layers start..end-1, part 1 of layers
    start..end-1, ...]`` with ``per_layer`` parts (1 for a state, 2 for K and V). Built by the
    engine, both roles.

    ``sections`` (protocol 1.6): a row that is the concatenation of several separately
    sharded head blocks (a gated-delta-net conv state's q, k and v channels, each split by TP
    on its own): row ``= [section 0's local heads | section 1's | ...]``, each a
    :class:`GroupSection`, and a slot is ``page_size`` such rows (row outermost). Leave
    ``total_heads`` and ``head_elems`` out: they are filled with the unsharded row as one
    head (1, the row's elements at TP 1), which is what a peer without sections would see.
    Sections are sharded by heads (``sharding="heads"``) and there are at least two. A layout
    whose section blocks are outermost with the rows inside each (``[sections][heads][rows]``)
    cannot be described; register each section as its own group if they are separate tensors.
    """

    model_config = _FROZEN

    name: str = Field(min_length=1, max_length=64, description="Unique within a layout.")
    kind: GroupKind
    #: The engine index set that addresses the group's slots: a key of ``state_indices``
    #: ("state", "window", or one of the engine's own names), or "pages" (the KV page indices;
    #: ``paged`` groups only). Empty: the kind's default.
    index: str = ""
    num_layers: int = Field(ge=1, description="Layers of this group in the whole model.")
    start_layer: int = Field(default=0, ge=0)
    end_layer: int | None = None
    per_layer: int = Field(default=1, ge=1, le=8)
    total_heads: int = Field(default=1, ge=1)
    sharding: Literal["heads", "replicated"] = "heads"
    head_elems: int = Field(
        default=0, ge=0, description="Elements of one head in one row (required without sections)."
    )
    dtype: str = "bfloat16"
    page_size: int = Field(default=1, ge=1, description="Rows per slot (tokens; 1: a state).")
    window: int | None = Field(default=None, ge=1, description="Window in tokens (window kind).")
    buffers: tuple[MemoryRegion, ...]
    #: Separately sharded head blocks of each row (empty: one block, ``total_heads`` x
    #: ``head_elems``). Omitted from the wire when empty (a group without sections encodes
    #: and hashes as in protocol 1.5).
    sections: tuple[GroupSection, ...] = ()

    @model_serializer(mode="wrap")
    def _omit_no_sections(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and not data.get("sections"):
            data.pop("sections", None)  # older peers and fixtures see the group they know
        return data

    def _check_sections(self, where: str) -> None:
        if not self.sections:
            if self.head_elems < 1:
                raise LayoutError(
                    f"{where}: head_elems is required (elements of one head in one row), or "
                    "give sections"
                )
            return
        if len(self.sections) < 2:
            raise LayoutError(
                f"{where}: one section is a plain head-sharded group; give total_heads and "
                "head_elems instead of sections"
            )
        if self.sharding != "heads":
            raise LayoutError(
                f"{where}: sections are sharded by heads; a group every rank holds whole needs "
                "no sections (sharding='replicated' with total_heads and head_elems)"
            )
        row = sum(s.total_heads * s.head_elems for s in self.sections)
        if self.total_heads != 1 or self.head_elems not in (0, row):
            raise LayoutError(
                f"{where}: with sections, leave total_heads and head_elems out (they are "
                f"filled as 1 and {row}, the unsharded row); got total_heads="
                f"{self.total_heads}, head_elems={self.head_elems}"
            )
        object.__setattr__(self, "head_elems", row)

    @model_validator(mode="after")
    def _check_group(self) -> Self:
        if not self.index:
            object.__setattr__(self, "index", DEFAULT_GROUP_INDEX[self.kind])
        where = f"buffer group {self.name!r}"
        self._check_sections(where)
        if self.dtype not in DTYPE_SIZES:
            raise LayoutError(
                f"{where}: unknown dtype {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}"
            )
        if (self.kind == "paged") != (self.index == "pages"):
            raise LayoutError(
                f"{where}: kind {self.kind!r} with index {self.index!r}; paged groups (and only "
                "they) are addressed by the KV page indices (index 'pages')"
            )
        if (self.kind == "window") != (self.window is not None):
            raise LayoutError(f"{where}: window= is required for, and only for, kind 'window'")
        end = self.layer_end
        if not self.start_layer < end <= self.num_layers:
            raise LayoutError(
                f"{where}: layer range [{self.start_layer}, {end}) is not inside its "
                f"{self.num_layers} layers"
            )
        want = (end - self.start_layer) * self.per_layer
        if len(self.buffers) != want:
            raise LayoutError(
                f"{where}: expected {want} buffers ({end - self.start_layer} layers x "
                f"{self.per_layer} per layer); got {len(self.buffers)}"
            )
        slots = {b.num_items for b in self.buffers}
        if len(slots) != 1:
            raise LayoutError(f"{where}: buffers must have the same number of slots; got {slots}")
        return self

    @property
    def layer_end(self) -> int:
        """One past the last layer of the group this rank holds."""
        return self.end_layer if self.end_layer is not None else self.num_layers

    @property
    def num_slots(self) -> int:
        """Slots per buffer."""
        return self.buffers[0].num_items

    @property
    def dtype_size(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def head_bytes(self) -> int:
        """Bytes of one head in one row."""
        return self.head_elems * self.dtype_size

    def local_heads(self, tp_size: int) -> int:
        """Heads a rank of a TP group of ``tp_size`` holds (replicated heads count once); a
        group with sections counts its row as one head (see :meth:`section_heads`)."""
        if self.sharding == "replicated" or self.sections:
            return self.total_heads
        return max(1, self.total_heads // tp_size)

    @property
    def head_sections(self) -> tuple[GroupSection, ...]:
        """The row's head blocks: :attr:`sections`, or the one block ``total_heads`` x
        ``head_elems``. Called by the group mapper at handshake."""
        return self.sections or (
            GroupSection(total_heads=self.total_heads, head_elems=self.head_elems),
        )

    def section_heads(self, tp_size: int) -> tuple[int, ...]:
        """Heads of each of :attr:`head_sections` a rank of a TP group of ``tp_size`` holds."""
        if self.sharding == "replicated":
            return (self.total_heads,)
        return tuple(s.local_heads(tp_size) for s in self.head_sections)

    def row_elems(self, tp_size: int) -> int:
        """Elements of one row of a slot on a rank of a TP group of ``tp_size``."""
        if self.sharding == "replicated":
            return self.total_heads * self.head_elems
        return sum(
            n * s.head_elems
            for n, s in zip(self.section_heads(tp_size), self.head_sections, strict=True)
        )

    def item_len(self, tp_size: int) -> int:
        """Bytes of one slot on a rank of a TP group of ``tp_size``."""
        return self.page_size * self.row_elems(tp_size) * self.dtype_size

    def geometry_text(self, tp_size: int) -> str:
        """How a slot is sized on a rank of a TP group of ``tp_size`` (for error messages)."""
        if self.sections:
            parts = " + ".join(
                f"{n}x{s.head_elems}"
                for n, s in zip(self.section_heads(tp_size), self.head_sections, strict=True)
            )
            return f"page_size {self.page_size} x ({parts}) section heads x elems"
        return f"page_size {self.page_size} x {self.local_heads(tp_size)} heads x {self.head_elems}"

    @cached_property
    def buffer_keys(self) -> NDArray[np.int64]:
        """``(layer, part)`` of each buffer, shape ``[n, 2]``."""
        layers = np.arange(self.start_layer, self.layer_end, dtype=np.int64)
        part = np.repeat(np.arange(self.per_layer, dtype=np.int64), len(layers))
        return np.stack([np.tile(layers, self.per_layer), part], axis=1)

    @cached_property
    def bases(self) -> NDArray[np.uint64]:
        """Base address of each buffer."""
        return np.array([b.addr for b in self.buffers], dtype=np.uint64)

    @cached_property
    def devices(self) -> NDArray[np.uint64]:
        """Device id of each buffer."""
        return np.array([b.device_id for b in self.buffers], dtype=np.uint64)

    def compat_text(self) -> str:
        """The fields both sides must share, as text (hashing); a group without sections
        hashes as in protocol 1.5."""
        return f"{self.name}:" + ",".join(
            f"{f}={getattr(self, f)}"
            if f != "sections"
            else "sections=" + "/".join(str(s) for s in self.sections)
            for f in GROUP_COMPAT_FIELDS
            if f != "sections" or self.sections
        )


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


def group_problems(
    local: Sequence[BufferGroup], remote: Sequence[BufferGroup], names: tuple[str, str]
) -> list[str]:
    """Every buffer group field that differs between two layouts' groups, naming the group,
    the field and both values (``names``: how to call the two sides, e.g. prefill, decode)."""
    a, b = names
    mine = {g.name: g for g in local}
    theirs = {g.name: g for g in remote}
    out = []
    for name in sorted(mine.keys() | theirs.keys()):
        g, h = mine.get(name), theirs.get(name)
        if g is None or h is None:
            out.append(
                f"group {name!r}: {a}={'present' if g else 'absent'} "
                f"{b}={'present' if h else 'absent'} (both sides must register the same groups)"
            )
            continue
        out += [
            f"group {name!r} {f}: {a}={_field_text(g, f)} {b}={_field_text(h, f)}"
            for f in GROUP_COMPAT_FIELDS
            if getattr(g, f) != getattr(h, f)
        ]
    return out


def _field_text(g: BufferGroup, f: str) -> str:
    """A group field's value in a handshake problem (sections as ``heads x elems`` blocks)."""
    if f == "sections":
        return "(" + ", ".join(str(s) for s in g.sections) + ")"
    return repr(getattr(g, f))
