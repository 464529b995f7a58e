"""What the handshake decides: whether two ranks can work together, and who sends what.

Called on the prefill side when a decode rank's :class:`~kvwire.control.wire.Hello` arrives
(:func:`handshake_problems`, :func:`build_mapper`, :func:`aux_problems`), and on both sides to
agree, without asking each other, who sends to whom (:func:`topology_for`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwire.config import AUTO, KVWireConfig
from kvwire.descriptors import DescTable, make_table
from kvwire.errors import KVWireError
from kvwire.index.base import IndexMapper, core_mapper_name, default_mapper_name
from kvwire.index.topology import Topology
from kvwire.layout import COMPAT_FIELDS, KVLayout, MemoryRegion, group_problems
from kvwire.selection import select_mapper


def handshake_problems(
    prefill: KVLayout,
    decode: KVLayout,
    prefill_backends: Sequence[str],
    decode_backends: Sequence[str],
) -> list[str]:
    """Every reason a prefill layout and a decode layout cannot work together, each naming
    the field and both values; empty when they can.

    Page sizes may differ (the core mappers move token ranges, :mod:`kvwire.index.paging`)
    unless a buffer group is addressed by the KV page indices (kind ``paged``: draft or MTP
    layers); a configured mapper that does not convert page sizes refuses in its constructor,
    naming both. The two sides must share at least one transfer backend (each side's list in
    its preference order; which one a link uses is decided when the peer is added,
    :meth:`~kvwire.backend.TransferBackend.add_link`)."""
    out = [
        f"{f}: prefill={getattr(prefill.model, f)!r} decode={getattr(decode.model, f)!r}"
        for f in COMPAT_FIELDS
        if f != "page_size" and getattr(prefill.model, f) != getattr(decode.model, f)
    ]
    pp, pd = prefill.model.page_size, decode.model.page_size
    if pp != pd:
        out += [
            f"page_size: prefill={pp} decode={pd}: buffer group {g.name!r} of the {side} is "
            "addressed by the KV page indices (kind 'paged'), so both sides need one page size"
            for side, layout in (("prefill", prefill), ("decode", decode))
            for g in layout.groups
            if g.kind == "paged"
        ]
    if not set(prefill_backends) & set(decode_backends):
        out.append(
            f"transfer backend: prefill={','.join(prefill_backends)!r} "
            f"decode={','.join(decode_backends)!r}: none in common"
        )
    out += layout_topology(prefill, decode).problems()
    if decode.rank.pp_size == 1 and (
        decode.start_layer != 0 or decode.layer_end != decode.model.num_layers
    ):
        out.append(
            f"decode layers [{decode.start_layer}, {decode.layer_end}): a decode rank without "
            f"pipeline parallelism must hold all {decode.model.num_layers} layers"
        )
    out += group_problems(prefill.groups, decode.groups, ("prefill", "decode"))
    out += [
        f"group {g.name!r} layers [{g.start_layer}, {g.layer_end}): a decode rank must hold "
        f"all {g.num_layers} layers of every group"
        for g in decode.groups
        if g.start_layer != 0 or g.layer_end != g.num_layers
    ]
    return out


def mapper_name(config: KVWireConfig, src: KVLayout, dst: KVLayout) -> str:
    """The configured index mapper, or the core one that fits the layout pair."""
    return config.index_mapper if config.index_mapper != AUTO else default_mapper_name(src, dst)


def build_mapper(config: KVWireConfig, src: KVLayout, dst: KVLayout) -> IndexMapper:
    """The configured (or fitting) index mapper for a (prefill, decode) layout pair."""
    sel = select_mapper(mapper_name(config, src, dst), config.index_mapper_options)
    mapper: IndexMapper = sel.cls(src, dst, sel.options)
    return mapper


def layout_topology(prefill: KVLayout, decode: KVLayout) -> Topology:
    """The core topology of a (prefill, decode) layout pair (validation at handshake)."""
    return Topology(
        prefill.rank.tp_size, prefill.rank.pp_size, decode.rank.tp_size, decode.rank.pp_size
    )


def topology_for(
    config: KVWireConfig,
    local: KVLayout,
    prefill_tp: int,
    prefill_pp: int,
    decode_tp: int,
    decode_pp: int = 1,
) -> Topology:
    """The topology chosen with the mapper (:attr:`IndexMapper.topology`) for a prefill
    instance of ``prefill_tp`` x ``prefill_pp`` and a decode instance of ``decode_tp`` x
    ``decode_pp``;
    ``local`` is this rank's layout (the model is the same on both sides). Used by both
    sides, before any handshake (decode pairs with ranks listed by bootstrap)."""
    name = config.index_mapper
    if name == AUTO:
        name = core_mapper_name(local.model.is_mla, prefill_tp, decode_tp)
    try:
        cls = select_mapper(name, config.index_mapper_options).cls
    except KVWireError:
        cls = IndexMapper
    topo: type[Topology] = getattr(cls, "topology", Topology)
    return topo(prefill_tp, prefill_pp, decode_tp, decode_pp)


def aux_problems(prefill: Sequence[MemoryRegion], decode: Sequence[MemoryRegion]) -> list[str]:
    """Aux rows must have the same buffers with the same row sizes on both sides."""
    if len(prefill) != len(decode):
        return [f"aux buffers: prefill has {len(prefill)}, decode has {len(decode)}"]
    return [
        f"aux buffer {i} row bytes: prefill={p.item_len} decode={d.item_len}"
        for i, (p, d) in enumerate(zip(prefill, decode, strict=True))
        if p.item_len != d.item_len
    ]


def slot_table(regions: Sequence[MemoryRegion]) -> DescTable:
    """One row per (region, slot), region-major; the regions must have equal slot counts."""
    slots = {r.num_items for r in regions}
    if len(slots) != 1:
        raise KVWireError(f"aux buffers must have the same number of rows; got {sorted(slots)}")
    s = slots.pop()
    bases = np.array([r.addr for r in regions], dtype=np.uint64)
    items = np.array([r.item_len for r in regions], dtype=np.uint64)
    devs = np.array([r.device_id for r in regions], dtype=np.uint64)
    idx = np.arange(s, dtype=np.uint64)
    return make_table(
        (bases[:, None] + idx[None, :] * items[:, None]).ravel(),
        np.repeat(items, s),
        np.repeat(devs, s),
    )


def slot_rows(num_regions: int, num_slots: int, slot: int) -> Any:
    """Rows of :func:`slot_table` holding ``slot`` of every region."""
    return np.arange(num_regions, dtype=np.int64) * num_slots + slot
