"""Segments by memory kind: a table pair whose rows mix VRAM and DRAM on either side.

Engines prepare one memory type per descriptor list (NIXL refuses a mixed list), and a
transfer from VRAM may take a different path than one from DRAM. When a link's source or
destination regions mix kinds, prefill prepares one pair per (source kind, destination kind)
present, at handshake, and each chunk's rows are split by kind into one transfer per segment.
Each segment completes on its own (its own note, :attr:`ChunkNote.parts`), and decode counts the
chunk once every segment has arrived.

Called by prefill only: :func:`split_tables` at handshake (control thread), and
:meth:`KindSplit.segments` per chunk on the transfer worker. All NumPy; no per-row loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kvwire.descriptors import ADDR, LEN, DescTable, IndexArray, locate_rows
from kvwire.errors import DescriptorError
from kvwire.index.base import TablePair
from kvwire.layout import MemKind, MemoryRegion
from kvwire.staging.base import Segment


def row_kinds(table: DescTable, regions: Sequence[MemoryRegion], what: str) -> NDArray[np.int8]:
    """The memory kind of every row of ``table`` (the kind of the region holding it)."""
    order = sorted(regions, key=lambda r: r.addr)
    starts = np.array([r.addr for r in order], dtype=np.uint64)
    ends = np.array([r.end for r in order], dtype=np.uint64)
    kinds = np.array([int(r.kind) for r in order], dtype=np.int8)
    pos = locate_rows(starts, ends, table[:, ADDR], table[:, LEN])
    if (pos < 0).any():
        i = int(np.argmax(pos < 0))
        raise DescriptorError(
            f"{what}: row {i} (addr {int(table[i, ADDR]):#x}) lies outside every region"
        )
    out: NDArray[np.int8] = kinds[pos]
    return out


def segment_label(src_kind: int, dst_kind: int) -> str:
    """``"VRAM>DRAM"`` style name of a (source kind, destination kind) segment."""
    return f"{MemKind(src_kind).name}>{MemKind(dst_kind).name}"


@dataclass
class KindSplit:
    """How one table pair splits by kind: per row of each full table, its kind and its position
    in that kind's sub-table; and the prepared pair name of each (source, destination) kind."""

    name: str
    src_kind: NDArray[np.int8]
    dst_kind: NDArray[np.int8]
    src_pos: NDArray[np.int64]
    dst_pos: NDArray[np.int64]
    #: (source kind, destination kind) -> prepared pair name.
    tables: dict[tuple[int, int], str]

    def segments(self, src_idx: IndexArray, dst_idx: IndexArray) -> list[Segment]:
        """A chunk's rows (indices into the full tables) as one segment per kind pair present,
        with indices into that pair's sub-tables. Row order within a segment is kept."""
        ks = self.src_kind[src_idx].astype(np.int64)
        kd = self.dst_kind[dst_idx].astype(np.int64)
        combo = ks * 2 + kd
        out: list[Segment] = []
        for c in np.unique(combo).tolist():
            mask = combo == c
            key = (c // 2, c % 2)
            table = self.tables.get(key)
            if table is None:  # cannot happen: every combo present in the tables was prepared
                raise DescriptorError(f"{self.name}: no prepared {segment_label(*key)} segment")
            out.append(
                Segment(
                    label=segment_label(*key),
                    table=table,
                    src_idx=self.src_pos[src_idx[mask]],
                    dst_idx=self.dst_pos[dst_idx[mask]],
                )
            )
        return out


def _positions(kinds: NDArray[np.int8]) -> NDArray[np.int64]:
    """Position of each row among the rows of its own kind."""
    pos = np.empty(kinds.shape, dtype=np.int64)
    for k in (0, 1):
        mask = kinds == k
        pos[mask] = np.arange(int(mask.sum()), dtype=np.int64)
    return pos


def split_tables(
    name: str,
    tables: TablePair,
    src_regions: Sequence[MemoryRegion],
    dst_regions: Sequence[MemoryRegion],
) -> tuple[dict[str, TablePair], KindSplit | None]:
    """Prefill, at handshake: the pairs to prepare for ``tables``. One pair named ``name`` when
    each side holds a single memory kind (no split, no extra cost); otherwise one pair per
    (source kind, destination kind), named ``name@SRC>DST``, and the :class:`KindSplit` that
    maps chunk rows onto them. Only combinations that can occur (both kinds present) are
    prepared; NIXL refuses a descriptor list that mixes kinds, so every sub-table holds one."""
    if len({r.kind for r in src_regions}) <= 1 and len({r.kind for r in dst_regions}) <= 1:
        return {name: tables}, None
    sk = row_kinds(tables.src, src_regions, f"{name} source table")
    dk = row_kinds(tables.dst, dst_regions, f"{name} destination table")
    pairs: dict[str, TablePair] = {}
    names: dict[tuple[int, int], str] = {}
    src_kinds = [k for k in (0, 1) if (sk == k).any()]
    dst_kinds = [k for k in (0, 1) if (dk == k).any()]
    for a in src_kinds:
        for b in dst_kinds:
            table = f"{name}@{segment_label(a, b)}"
            names[(a, b)] = table
            pairs[table] = TablePair(src=tables.src[sk == a], dst=tables.dst[dk == b])
    return pairs, KindSplit(name, sk, dk, _positions(sk), _positions(dk), names)
