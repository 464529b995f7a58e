"""Buffer groups: a rank's buffers beyond the attention layers' paged K/V (per-request
state, sliding-window KV, draft-model layers), with their own indexing.

Built by the engine with its :class:`~kvwire.layout.KVLayout` (both roles), exchanged at
handshake, and read by the group mapper (:mod:`kvwire.index.groups`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any, Literal, Self

import numpy as np
from numpy.typing import NDArray
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from kvwire.errors import LayoutError
from kvwire.regions import DTYPE_SIZES, MemoryRegion

__all__ = [
    "DEFAULT_GROUP_INDEX",
    "GROUP_COMPAT_FIELDS",
    "BufferGroup",
    "GroupKind",
    "GroupSection",
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
