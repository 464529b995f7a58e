"""Byte runs between two layout descriptions (:mod:`kvwire.index.dims`): the one function that
turns a (source, destination) pair plus a selection into ``(src_offset, dst_offset, nbytes)``.

A move is a set of logical elements, indexed by

* the **unit** pairs of the selection (source unit ``src_units[i]`` goes to destination unit
  ``dst_units[i]``): a page slot, or with a ``granule`` of ``g`` tokens (page-size
  conversion, :mod:`kvwire.index.paging`) the ``g``-token granule ``slot * (page / g) + k``;
* ``layer`` and ``kv`` (those both sides hold, within the selection's ranges);
* ``page``: the ``g`` tokens of a unit;
* ``head``: the head slice (``count`` heads from ``src_start`` into ``dst_start``;
  :func:`kvwire.index.ranks.head_slice` for a TP pair);
* ``dim``: the bytes of a head.

Each logical axis has a byte stride on each side (0 where a side's buffer lacks the dim, the
buffer then holding one value of it). For each (source buffer, destination buffer) pair that
shares a (layer, K/V), :class:`RunPlan` orders the axes by source stride, drops axes of one,
and folds an axis into the next inner one wherever it is contiguous on both sides; the
innermost folded axis is the run. Per chunk (:meth:`RunPlan.runs`) the unit indices broadcast
against the remaining axes (NumPy, no loop over pages, tokens or heads; pairs with the same
shape are computed together), and consecutive runs that touch on both sides are coalesced, so
consecutive whole pages of one buffer become one run, and a cross-layer block one run.

The runs are the input of movers (a fused kernel copies every run of a chunk in one launch)
and are equal, byte for byte, to what the index mappers move (``core/tests/test_dims_runs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kvwire.descriptors import check_indices
from kvwire.errors import DescriptorError, LayoutError
from kvwire.index.dims import BufferDims, LayoutDims
from kvwire.index.ranks import HeadSlice, head_slice
from kvwire.layout import RankPosition

__all__ = ["RunPlan", "Runs", "Selection", "byte_runs", "token_units", "tp_heads"]

I64 = np.int64


@dataclass(frozen=True)
class Runs:
    """Byte runs of a move: run ``i`` copies ``nbytes[i]`` bytes from offset ``src_off[i]`` of
    source buffer ``src_buf[i]`` to offset ``dst_off[i]`` of destination buffer
    ``dst_buf[i]`` (offsets from each buffer's base; buffer indices into
    :attr:`LayoutDims.buffers`). Runs of one buffer pair are consecutive; destination runs
    never overlap."""

    src_buf: NDArray[np.int64]
    dst_buf: NDArray[np.int64]
    src_off: NDArray[np.int64]
    dst_off: NDArray[np.int64]
    nbytes: NDArray[np.int64]

    def __len__(self) -> int:
        return int(self.nbytes.size)

    @property
    def total_bytes(self) -> int:
        """Bytes the runs move."""
        return int(self.nbytes.sum())

    def addresses(
        self, src: LayoutDims, dst: LayoutDims
    ) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """Absolute (source, destination) addresses of the runs."""
        sb = np.array([b.addr for b in src.buffers], dtype=np.uint64)
        db = np.array([b.addr for b in dst.buffers], dtype=np.uint64)
        return (
            sb[self.src_buf] + self.src_off.astype(np.uint64),
            db[self.dst_buf] + self.dst_off.astype(np.uint64),
        )

    @classmethod
    def empty(cls) -> Runs:
        """No run."""
        e = np.empty(0, dtype=I64)
        return cls(e, e, e, e, e)


@dataclass(frozen=True)
class Selection:
    """What a move takes: unit pairs (page slots; with ``granule`` > 0, ``granule``-token
    granules, :mod:`kvwire.index.paging`), the head slice (None: every head, the sides
    holding as many), a model layer range ``[lo, hi)`` (None: every layer both hold) and the
    K/V halves (``(0,)``, ``(1,)`` or ``(0, 1)``)."""

    src_units: NDArray[np.int64]
    dst_units: NDArray[np.int64]
    granule: int = 0
    heads: HeadSlice | None = None
    layers: tuple[int, int] | None = None
    kv: tuple[int, ...] = (0, 1)


def token_units(
    pages: object, page_size: int, start: int, end: int, granule: int = 1
) -> NDArray[np.int64]:
    """Units of tokens ``[start, end)`` of a request whose pages are the slots ``pages``
    (``page_size`` tokens each), in granules of ``granule`` tokens (``start`` and ``end`` on a
    granule; ``granule`` dividing ``page_size``): ``slot * (page_size / granule) + k``, the
    units of a :class:`Selection` with that ``granule``. Pair it with the other side's units
    of the same tokens (its own pages and page size) to move a token range, e.g. one side of
    a page-size conversion or the tail of a partly cached page."""
    if granule < 1 or page_size % granule or start % granule or end % granule:
        raise LayoutError(
            f"tokens [{start}, {end}) in granules of {granule} of pages of {page_size}: the "
            "granule must divide the page size and both ends"
        )
    p = np.asarray(pages, dtype=I64)
    if not 0 <= start <= end <= p.size * page_size:
        raise LayoutError(f"tokens [{start}, {end}) are not inside {p.size} pages of {page_size}")
    t = np.arange(start, end, granule, dtype=I64)
    return p[t // page_size] * (page_size // granule) + (t % page_size) // granule


def tp_heads(total_kv_heads: int, is_mla: bool, src: RankPosition, dst: RankPosition) -> HeadSlice:
    """The head slice a (prefill rank, decode rank) pair moves, with GQA replication; MLA: the
    one latent, sent by the first of the prefill ranks feeding a decode rank."""
    if is_mla:
        k = src.tp_size // dst.tp_size
        return HeadSlice(1, 1, 1, 0, 0, k <= 1 or src.tp_rank % k == 0)
    return head_slice(total_kv_heads, src.tp_size, dst.tp_size, src.tp_rank, dst.tp_rank)


@dataclass(frozen=True)
class _Axis:
    count: int
    src: int  # byte stride on the source side
    dst: int  # byte stride on the destination side


@dataclass(frozen=True)
class _Shape:
    """The folded axes of a buffer pair, outermost first; ``unit`` is the position of the
    indexed unit axis among them, ``run`` the bytes of one run."""

    axes: tuple[_Axis, ...]
    unit: int
    run: int


def _fold(axes: list[_Axis], unit_stride: int) -> _Shape:
    """Order ``axes`` (innermost is the byte axis) by source stride, with the unit axis at
    ``unit_stride``, and fold every axis contiguous on both sides into its inner neighbour."""
    kept = sorted((a for a in axes if a.count > 1), key=lambda a: -a.src)
    folded: list[_Axis] = []
    for a in reversed(kept):  # innermost first
        if (
            folded
            and a.src == folded[-1].count * folded[-1].src
            and (a.dst == folded[-1].count * folded[-1].dst)
        ):
            inner = folded.pop()
            a = _Axis(a.count * inner.count, inner.src, inner.dst)
        folded.append(a)
    run = 1
    if folded and folded[0].src == 1 and folded[0].dst == 1:
        run = folded.pop(0).count
    outer = folded[::-1]
    unit = sum(1 for a in outer if a.src > unit_stride)
    return _Shape(tuple(outer), unit, run)


def _overlap(a: range, b: range, lo: int, hi: int) -> range:
    return range(max(a.start, b.start, lo), min(a.stop, b.stop, hi))


@dataclass(frozen=True)
class _Group:
    """Buffer pairs of one shape, moved together."""

    shape: _Shape
    src_buf: NDArray[np.int64]
    dst_buf: NDArray[np.int64]
    src_base: NDArray[np.int64]
    dst_base: NDArray[np.int64]


class RunPlan:
    """The runs of a (source, destination) pair for every chunk of one selection's shape:
    built once per peer (prefill's handshake thread, or whoever moves), then :meth:`runs` per
    chunk (any thread; immutable)."""

    def __init__(
        self,
        src: LayoutDims,
        dst: LayoutDims,
        heads: HeadSlice | None = None,
        layers: tuple[int, int] | None = None,
        kv: tuple[int, ...] = (0, 1),
        granule: int = 0,
    ) -> None:
        if src.is_latent != dst.is_latent or src.head_bytes != dst.head_bytes:
            raise LayoutError(
                f"source and destination heads differ ({src.head_bytes} B"
                f"{' latent' if src.is_latent else ''} vs {dst.head_bytes} B"
                f"{' latent' if dst.is_latent else ''})"
            )
        ps, pd = src.page_size, dst.page_size
        g = granule or ps
        if (not granule and ps != pd) or ps % g or pd % g:
            raise LayoutError(
                f"pages of {ps} and {pd} tokens: a granule dividing both is needed, got {granule}"
            )
        if heads is None:
            if src.heads != dst.heads:
                raise LayoutError(
                    f"{src.heads} heads on the source and {dst.heads} on the destination: "
                    "give the head slice (kvwire.index.ranks.head_slice)"
                )
            heads = HeadSlice(src.heads, dst.heads, src.heads, 0, 0, True)
        n = heads.count
        if heads.src_start + n > src.heads or heads.dst_start + n > dst.heads or n < 1:
            raise LayoutError(
                f"head slice of {n} from {heads.src_start} into {heads.dst_start} does not fit "
                f"{src.heads} source and {dst.heads} destination heads"
            )
        if kv not in ((0,), (1,), (0, 1)):
            raise LayoutError(f"kv selection {kv}: (0,), (1,) or (0, 1)")
        self.src, self.dst, self.granule, self.sends = src, dst, g, heads.sends
        lo, hi = layers if layers is not None else (0, 1 << 62)
        shapes: dict[_Shape, list[tuple[int, int, int, int]]] = {}
        owner = {(la, k): j for j, d in enumerate(dst.buffers) for la in d.layers for k in d.kvs}
        for i, s in enumerate(src.buffers):
            near = {owner.get((la, k), -1) for la in s.layers for k in s.kvs} - {-1}
            for j in sorted(near):
                d = dst.buffers[j]
                lay = _overlap(s.layers, d.layers, lo, hi)
                kvr = _overlap(s.kvs, d.kvs, kv[0], kv[-1] + 1)
                if not lay or not kvr:
                    continue
                axes = [
                    _Axis(len(lay), s.stride("layer"), d.stride("layer")),
                    _Axis(len(kvr), s.stride("kv"), d.stride("kv")),
                    _Axis(g, s.stride("page"), d.stride("page")),
                    _Axis(n, s.stride("head"), d.stride("head")),
                    _Axis(s.head_bytes, 1, 1),
                ]
                base_s = _base(s, lay.start, kvr.start, heads.src_start)
                base_d = _base(d, lay.start, kvr.start, heads.dst_start)
                shape = _fold(axes, s.stride("slot"))
                shapes.setdefault(shape, []).append((i, j, base_s, base_d))
        self._groups = [
            _Group(shape, *(np.array(c, dtype=I64) for c in zip(*rows, strict=True)))
            for shape, rows in shapes.items()
        ]

    @property
    def is_empty(self) -> bool:
        """Nothing moves (no (layer, K/V) in common, or another rank sends these heads)."""
        return not self._groups or not self.sends

    def _unit_offsets(self, side: LayoutDims, units: object, what: str) -> NDArray[np.int64]:
        b = side.buffers[0]
        per = side.page_size // self.granule
        u = check_indices(units, side.num_slots * per, what, unit="units")
        return (u // per) * b.stride("slot") + (u % per) * (self.granule * b.stride("page"))

    def runs(self, src_units: object, dst_units: object) -> Runs:
        """The runs moving source unit ``src_units[i]`` into destination unit
        ``dst_units[i]`` (page slots, or granules with a granule below the page size), every
        pair of buffers, coalesced. Called per chunk, by the side that moves."""
        su = self._unit_offsets(self.src, src_units, "source units")
        du = self._unit_offsets(self.dst, dst_units, "destination units")
        if su.size != du.size:
            raise DescriptorError(f"{su.size} source units but {du.size} destination units")
        if self.is_empty or su.size == 0:
            return Runs.empty()
        parts = [_group_runs(grp, su, du) for grp in self._groups]
        cols = [np.concatenate(c) for c in zip(*parts, strict=True)]
        return _coalesce(*cols)


def _base(b: BufferDims, layer: int, kv: int, head: int) -> int:
    """Byte offset of (layer, kv, head) inside a slot of ``b``."""
    k = kv - b.kvs.start
    return (
        (layer - b.first_layer) * b.stride("layer") + k * b.stride("kv") + head * b.stride("head")
    )


def _group_runs(
    grp: _Group, su: NDArray[np.int64], du: NDArray[np.int64]
) -> tuple[NDArray[np.int64], ...]:
    """Runs of every pair of a group, pair-major, then in the folded axes' order."""
    axes, unit = grp.shape.axes, grp.shape.unit
    nd = len(axes) + 2  # pair axis, unit axis, folded axes

    def grid(base: NDArray[np.int64], units: NDArray[np.int64], side: str) -> NDArray[np.int64]:
        shape = [1] * nd
        shape[0] = base.size
        off = base.reshape(shape)
        shape = [1] * nd
        shape[1] = units.size
        off = off + units.reshape(shape)
        for k, a in enumerate(axes):
            shape = [1] * nd
            shape[k + 2] = a.count
            step = a.src if side == "src" else a.dst
            off = off + (np.arange(a.count, dtype=I64) * step).reshape(shape)
        # unit axis to its place among the folded axes (by source stride)
        return np.moveaxis(off, 1, unit + 1).ravel()

    s_off = grid(grp.src_base, su, "src")
    d_off = grid(grp.dst_base, du, "dst")
    per_pair = s_off.size // grp.src_buf.size
    return (
        np.repeat(grp.src_buf, per_pair),
        np.repeat(grp.dst_buf, per_pair),
        s_off,
        d_off,
        np.full(s_off.size, grp.shape.run, dtype=I64),
    )


def _coalesce(
    sb: NDArray[np.int64],
    db: NDArray[np.int64],
    so: NDArray[np.int64],
    do: NDArray[np.int64],
    nb: NDArray[np.int64],
) -> Runs:
    """Merge each run into the previous one where both sides continue it."""
    brk = np.ones(so.size, dtype=bool)
    brk[1:] = (
        (sb[1:] != sb[:-1])
        | (db[1:] != db[:-1])
        | (so[1:] != so[:-1] + nb[:-1])
        | (do[1:] != do[:-1] + nb[:-1])
    )
    first = np.flatnonzero(brk)
    return Runs(sb[first], db[first], so[first], do[first], np.add.reduceat(nb, first))


def byte_runs(src: LayoutDims, dst: LayoutDims, selection: Selection) -> Runs:
    """The byte runs moving ``selection`` from ``src`` to ``dst`` (see the module docstring):
    a one-off :class:`RunPlan`; a mover that moves many chunks keeps the plan."""
    plan = RunPlan(src, dst, selection.heads, selection.layers, selection.kv, selection.granule)
    return plan.runs(selection.src_units, selection.dst_units)
