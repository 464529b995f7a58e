"""Mapping of buffer groups (per-request state, sliding-window KV, draft-model layers).

A :class:`GroupMapper` is built by prefill at handshake, once per decode rank, from the two
layouts' :class:`~kvwire.layout.BufferGroup` s (through :meth:`IndexMapper.group_mapper
<kvwire.index.base.IndexMapper.group_mapper>`, so a mapper for another parallelism can bring
its own). It builds one descriptor table pair holding every group's rows, and turns one
request's indices (state slots, window pages, KV pages) into index arrays into that pair.
Everything a request's groups need moves in one transfer after its last KV chunk (their
content is final only then: a recurrent state is updated by every chunk).

Per group, with ``H`` = the group's total heads, ``Tp``/``Td`` the TP sizes and ``r`` ranks:

* equal TP, or ``sharding="replicated"``: whole slots, one row per (buffer, slot). A replicated
  group with ``Tp > Td`` is sent by the first of the ``Tp/Td`` sources only (the others are
  dummies for it): replicated bytes move once.
* ``sharding="heads"`` with ``Tp > Td`` (gather): source rank ``r`` holds unique head group
  ``r // max(1, Tp // H)`` of ``src_heads = max(1, H // Tp)`` heads and writes them at head
  offset ``(unique * src_heads) % dst_heads`` of each destination row; of several sources
  holding the same heads only one sends.
* ``sharding="heads"`` with ``Tp < Td`` (scatter): decode rank ``r`` needs unique group
  ``r // max(1, Td // H)`` (integer division) and receives ``dst_heads`` heads starting at
  source head ``(unique * dst_heads) % src_heads``.

A group with :attr:`~kvwire.layout.BufferGroup.sections` (a gated-delta-net conv state: q, k
and v channel blocks each split by TP) applies these formulas to every section on its own
(``H`` = the section's heads): each section is a *segment* of a row, at byte offset ``sum of
the earlier sections' local heads x head bytes`` on each side, and a source may be a dummy for
one section (its heads replicated on another source) and send another. A group without
sections is one segment.

Sliced rows are one per (buffer, slot, row, segment): a state slot has ``page_size`` rows
(usually 1), a window or paged slot ``page_size`` token rows. Index of segment ``k`` of row
``t`` of slot ``s`` of buffer pair ``p``: ``row0 + ((p * slots + s) * rows + t) * segments +
k`` on each side. NumPy only; the Python loops are over groups and sections (a handful), never
over descriptors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kvwire.descriptors import IndexArray, make_table
from kvwire.errors import DescriptorError, LayoutError
from kvwire.index.ranks import head_slice
from kvwire.index.tables import TablePair
from kvwire.layout import BufferGroup, KVLayout, group_problems

__all__ = ["GroupMapper", "GroupPlan"]


@dataclass(frozen=True)
class GroupPlan:
    """How one group moves between one source rank and one destination rank."""

    group: BufferGroup
    #: Buffer indices (source, destination) holding the same (layer, part).
    src_buf: NDArray[np.int64]
    dst_buf: NDArray[np.int64]
    #: Rows per slot moved (1: whole slots) and each row's size on both sides.
    rows: int
    src_stride: int
    dst_stride: int
    #: Per segment of a row (a section's head slice; one for whole slots or a group without
    #: sections): byte offsets in the source and destination row, and length.
    src_offsets: NDArray[np.uint64]
    dst_offsets: NDArray[np.uint64]
    lengths: NDArray[np.uint64]
    #: Segments this source writes (another source writes the same bytes of the others).
    active: NDArray[np.bool_]
    #: First row of this group in the source and destination tables.
    src_row0: int
    dst_row0: int
    src_slots: int
    dst_slots: int

    @property
    def pairs(self) -> int:
        """Buffer pairs moved per slot."""
        return int(self.src_buf.size)

    @property
    def segments(self) -> int:
        """Segments per row (table rows per slot row, dummy ones included)."""
        return int(self.lengths.size)

    @property
    def dummy(self) -> bool:
        """Another source rank sends every byte of this group to this destination."""
        return not bool(self.active.any())


def _pair(src: BufferGroup, dst: BufferGroup) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Source and destination buffer indices holding the same (layer, part)."""
    width = src.per_layer
    lookup = np.full(src.num_layers * width, -1, dtype=np.int64)
    dk = dst.buffer_keys
    lookup[dk[:, 0] * width + dk[:, 1]] = np.arange(len(dk))
    sk = src.buffer_keys
    d = lookup[sk[:, 0] * width + sk[:, 1]]
    if (d < 0).any():
        raise LayoutError(
            f"buffer group {src.name!r}: the destination lacks layers "
            f"{sorted(set(sk[d < 0, 0].tolist()))} the source holds"
        )
    return np.arange(len(sk), dtype=np.int64), d


class GroupMapper:
    """Maps every buffer group of a (source layout, destination layout) pair; prefill side,
    built on a handshake thread, used by transfer workers (read-only after construction)."""

    def __init__(self, src: KVLayout, dst: KVLayout) -> None:
        problems = group_problems(src.groups, dst.groups, ("source", "destination"))
        if problems:
            raise LayoutError("buffer groups cannot work together: " + "; ".join(problems))
        self.src = src
        self.dst = dst
        self.plans: list[GroupPlan] = []
        srow = drow = 0
        for g in src.groups:
            d = dst.group(g.name)
            assert d is not None
            plan = self._plan(g, d, srow, drow)
            self.plans.append(plan)
            n = plan.pairs * plan.rows * plan.segments
            srow += n * g.num_slots
            drow += n * d.num_slots

    def _plan(self, g: BufferGroup, d: BufferGroup, srow: int, drow: int) -> GroupPlan:
        tp_s, tp_d = self.src.rank.tp_size, self.dst.rank.tp_size
        r_s, r_d = self.src.rank.tp_rank, self.dst.rank.tp_rank
        src_buf, dst_buf = _pair(g, d)
        item_s, item_d = g.item_len(tp_s), d.item_len(tp_d)

        def plan(
            rows: int, strides: tuple[int, int], segs: list[tuple[int, int, int, bool]]
        ) -> GroupPlan:
            cols = np.array([s[:3] for s in segs], dtype=np.uint64).reshape(-1, 3)
            return GroupPlan(
                g, src_buf, dst_buf, rows, strides[0], strides[1],
                cols[:, 0], cols[:, 1], cols[:, 2], np.array([s[3] for s in segs], dtype=bool),
                srow, drow, g.num_slots, d.num_slots,
            )  # fmt: skip

        if tp_s == tp_d or g.sharding == "replicated":  # whole slots
            send = tp_s <= tp_d or r_s % (tp_s // tp_d) == 0
            return plan(1, (item_s, item_d), [(0, 0, item_s, send)])
        segs = []
        s_off = d_off = 0  # byte offset of the section in the source / destination row
        for sec in g.head_sections:
            cut = head_slice(sec.total_heads, tp_s, tp_d, r_s, r_d)  # KV heads' rule
            hb = sec.head_elems * g.dtype_size
            segs.append(
                (s_off + cut.src_start * hb, d_off + cut.dst_start * hb, cut.count * hb, cut.sends)
            )
            s_off += cut.src_heads * hb
            d_off += cut.dst_heads * hb
        rows = g.page_size
        return plan(rows, (item_s // rows, item_d // rows), segs)

    # ------------------------------------------------------------------ tables
    @staticmethod
    def _rows(
        g: BufferGroup, bufs: NDArray[np.int64], item: int, p: GroupPlan, stride: int,
        offsets: NDArray[np.uint64],
    ) -> NDArray[np.uint64]:  # fmt: skip
        """Addresses of every (buffer, slot, row, segment), in table order."""
        slots = np.arange(g.num_slots, dtype=np.uint64) * np.uint64(item)
        toks = np.arange(p.rows, dtype=np.uint64) * np.uint64(stride)
        addr = (
            g.bases[bufs][:, None, None, None]
            + slots[None, :, None, None]
            + toks[None, None, :, None]
            + offsets[None, None, None, :]
        )
        out: NDArray[np.uint64] = addr.ravel()
        return out

    def build_tables(self) -> TablePair:
        """Both tables, every group's rows (dummy segments included, so row offsets are
        fixed); called once per peer on a handshake thread."""
        tp_s, tp_d = self.src.rank.tp_size, self.dst.rank.tp_size
        src_cols: list[list[NDArray[np.uint64]]] = [[], [], []]
        dst_cols: list[list[NDArray[np.uint64]]] = [[], [], []]
        for p in self.plans:
            g = p.group
            d = self.dst.group(g.name)
            assert d is not None
            for grp, bufs, item, stride, offs, cols in (
                (g, p.src_buf, g.item_len(tp_s), p.src_stride, p.src_offsets, src_cols),
                (d, p.dst_buf, d.item_len(tp_d), p.dst_stride, p.dst_offsets, dst_cols),
            ):
                addr = self._rows(grp, bufs, item, p, stride, offs)
                per_buf = grp.num_slots * p.rows
                cols[0].append(addr)
                cols[1].append(np.tile(p.lengths, bufs.size * per_buf))
                cols[2].append(np.repeat(grp.devices[bufs], per_buf * p.segments))
        if not self.plans:
            raise LayoutError("no buffer groups to map")
        return TablePair(
            src=make_table(*(np.concatenate(c) for c in src_cols)),
            dst=make_table(*(np.concatenate(c) for c in dst_cols)),
        )

    # --------------------------------------------------------------- per request
    @property
    def sends(self) -> bool:
        """Whether this source moves any group's bytes to this destination."""
        return any(not p.dummy for p in self.plans)

    @property
    def index_names(self) -> set[str]:
        """The index sets a request must name (``pages`` comes from the KV pages)."""
        return {p.group.index for p in self.plans}

    def map_request(
        self, src: Mapping[str, NDArray[np.int64]], dst: Mapping[str, NDArray[np.int64]]
    ) -> tuple[IndexArray, IndexArray]:
        """Index arrays into (src table, dst table) for one request; ``src``/``dst`` map each
        index name (:attr:`BufferGroup.index`, ``"pages"`` for the KV pages) to slot indices,
        already range-checked. Called on a transfer worker, once per request and destination.
        Raises :class:`DescriptorError` naming the group when the counts differ."""
        s_parts: list[NDArray[np.int64]] = []
        d_parts: list[NDArray[np.int64]] = []
        for p in self.plans:
            if p.dummy:
                continue
            name = p.group.index
            ss, ds = src.get(name), dst.get(name)
            if ss is None or ds is None:
                side = "prefill" if ss is None else "decode"
                raise DescriptorError(
                    f"buffer group {p.group.name!r}: {side} gave no {name!r} indices"
                )
            if ss.size != ds.size:
                raise DescriptorError(
                    f"buffer group {p.group.name!r}: prefill gave {ss.size} {name!r} indices, "
                    f"decode {ds.size}; both must name the same slots of the request"
                )
            if ss.size == 0:
                continue
            s_parts.append(self._request_rows(p, p.src_row0, p.src_slots, ss))
            d_parts.append(self._request_rows(p, p.dst_row0, p.dst_slots, ds))
        if not s_parts:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        return np.concatenate(s_parts), np.concatenate(d_parts)

    @staticmethod
    def _request_rows(
        p: GroupPlan, row0: int, slots: int, idx: NDArray[np.int64]
    ) -> NDArray[np.int64]:
        """Table rows of the active segments of every row of slots ``idx`` (one side)."""
        pairs = np.arange(p.pairs, dtype=np.int64)[:, None, None, None]
        toks = np.arange(p.rows, dtype=np.int64)[None, None, :, None]
        segs = np.flatnonzero(p.active).astype(np.int64)[None, None, None, :]
        rows = row0 + ((pairs * slots + idx[None, :, None, None]) * p.rows + toks) * p.segments
        out: NDArray[np.int64] = (rows + segs).ravel()
        return out
