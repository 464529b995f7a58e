"""Tile planning for the fused run mover, and the CPU reference movers.

A *run* is ``(src, dst, nbytes)``: copy ``nbytes`` bytes from address ``src`` to address
``dst``. Runs come as three equally long ``int64`` arrays; addresses may point into different
allocations (and, on a GPU, ``dst`` into a peer GPU's memory mapped through CUDA IPC). The
mover's contract: destination ranges do not overlap each other or any source range (the
result is undefined otherwise, as for ``memcpy``).

:func:`plan_tiles` turns runs into tiles of at most ``tile_bytes`` bytes -- one GPU program per
tile -- with NumPy only, and picks the widest element (up to 16 bytes) that divides every
address and length (:func:`element_width`), so the kernel can use the widest aligned vector
loads. :func:`copy_runs_reference` copies runs, :func:`copy_tiles_reference` executes a tile
plan exactly as the kernel does; both are vectorised (NumPy or torch fancy indexing over one
flat byte buffer whose offsets stand for addresses) and are the oracles of the property tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

#: Widest element a tile is copied in (a 16-byte vector load/store per thread).
MAX_WIDTH = 16
#: Default tile: 64 KiB, the most one GPU program copies (in steps of ``BLOCK_BYTES``); a run
#: of at most this size (a KV page of one layer) is one tile, planned without expansion.
DEFAULT_TILE_BYTES = 64 << 10
#: Bytes a GPU program copies per loop step: 4 warps x 32 threads x 4 16-byte vectors.
BLOCK_BYTES = 8 << 10

I64 = NDArray[np.int64]


@dataclass(frozen=True)
class TilePlan:
    """Tiles of a run list: each copies ``elems[i] * width`` bytes from ``src[i]`` to
    ``dst[i]``. Built by :func:`plan_tiles`; immutable."""

    src: I64
    dst: I64
    elems: I64
    width: int
    tile_bytes: int

    @property
    def num_tiles(self) -> int:
        """Number of tiles (GPU programs)."""
        return int(self.src.size)

    @property
    def total_bytes(self) -> int:
        """Bytes the plan copies."""
        return int(self.elems.sum()) * self.width

    @property
    def tile_elems(self) -> int:
        """Elements of a full tile (the kernel's block size)."""
        return self.tile_bytes // self.width


def _i64(x: ArrayLike) -> I64:
    """``x`` as a 1-D contiguous ``int64`` array (no copy when it already is one)."""
    if isinstance(x, np.ndarray) and x.dtype == np.int64 and x.ndim == 1 and x.flags.c_contiguous:
        return x
    return np.ascontiguousarray(np.asarray(x).astype(np.int64, copy=False).ravel())


def as_runs(src: ArrayLike, dst: ArrayLike, nbytes: ArrayLike) -> tuple[I64, I64, I64]:
    """Validate and coerce a run list to three 1-D ``int64`` arrays of one length.

    Raises ``ValueError`` for mismatched shapes, negative lengths or negative addresses.
    """
    s, d, n = _i64(src), _i64(dst), _i64(nbytes)
    if not (s.size == d.size == n.size):
        raise ValueError(f"run arrays differ in length ({s.size}, {d.size}, {n.size})")
    # One reduction: the OR of all values is negative iff one of them is.
    if s.size and int(np.bitwise_or.reduce(s | d | n)) < 0:
        raise ValueError("runs need non-negative addresses and lengths")
    return s, d, n


def element_width(src: I64, dst: I64, nbytes: I64, max_width: int = MAX_WIDTH) -> int:
    """The widest power of two (at most ``max_width``) dividing every address and length."""
    if max_width < 1 or max_width & (max_width - 1):
        raise ValueError(f"max_width must be a power of two, got {max_width}")
    acc = int(np.bitwise_or.reduce(src | dst | nbytes)) if src.size else 0
    acc |= max_width
    return acc & -acc


def merge_adjacent(src: I64, dst: I64, nbytes: I64) -> tuple[I64, I64, I64]:
    """Merge consecutive runs that continue each other on both sides into one run, and drop
    empty runs (fewer, longer runs: fewer partial tiles)."""
    keep = nbytes > 0
    if not keep.all():
        src, dst, nbytes = src[keep], dst[keep], nbytes[keep]
    if src.size < 2:
        return src, dst, nbytes
    cont = (src[1:] == src[:-1] + nbytes[:-1]) & (dst[1:] == dst[:-1] + nbytes[:-1])
    if not cont.any():
        return src, dst, nbytes
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return src[starts], dst[starts], np.add.reduceat(nbytes, starts)


def plan_tiles(
    src: ArrayLike,
    dst: ArrayLike,
    nbytes: ArrayLike,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    *,
    max_width: int = MAX_WIDTH,
    merge: bool = True,
) -> TilePlan:
    """Cut runs into tiles of at most ``tile_bytes`` bytes, vectorised.

    ``tile_bytes`` must be a power of two of at least ``max_width``. Runs are merged first
    where they continue each other (``merge``); the element width is then the widest power of
    two dividing every address and length, so every tile starts aligned to it.
    """
    if tile_bytes < max_width or tile_bytes & (tile_bytes - 1):
        raise ValueError(f"tile_bytes must be a power of two >= {max_width}, got {tile_bytes}")
    s, d, n = as_runs(src, dst, nbytes)
    if merge:
        s, d, n = merge_adjacent(s, d, n)
    else:
        keep = n > 0
        s, d, n = s[keep], d[keep], n[keep]
    width = element_width(s, d, n, max_width)
    if not s.size or int(n.max()) <= tile_bytes:  # every run is one tile: nothing to cut
        return TilePlan(src=s, dst=d, elems=n // width, width=width, tile_bytes=tile_bytes)
    per = (n + (tile_bytes - 1)) // tile_bytes
    total = int(per.sum())
    run = np.repeat(np.arange(s.size, dtype=np.int64), per)
    first = np.cumsum(per) - per
    off = (np.arange(total, dtype=np.int64) - first[run]) * tile_bytes
    length = np.minimum(n[run] - off, tile_bytes)
    return TilePlan(
        src=s[run] + off,
        dst=d[run] + off,
        elems=length // width,
        width=width,
        tile_bytes=tile_bytes,
    )


@dataclass(frozen=True)
class GroupPlan:
    """Runs of one length in groups of evenly spaced pieces: group ``g`` copies ``count[g]``
    pieces of ``n`` bytes, piece ``t`` from ``src[g] + t * src_stride`` to
    ``dst[g] + t * dst_stride`` (a head slice of every token row of a page is one group). One
    GPU program per group. Built by :func:`plan_groups`; immutable."""

    src: I64
    dst: I64
    count: I64
    n: int
    src_stride: int
    dst_stride: int
    width: int

    @property
    def num_groups(self) -> int:
        """Number of groups (GPU programs)."""
        return int(self.src.size)

    @property
    def total_bytes(self) -> int:
        """Bytes the plan copies."""
        return int(self.count.sum()) * self.n


def plan_groups(
    src: ArrayLike,
    dst: ArrayLike,
    nbytes: ArrayLike,
    *,
    max_piece: int = DEFAULT_TILE_BYTES,
    min_gain: int = 4,
    max_width: int = MAX_WIDTH,
) -> GroupPlan | None:
    """Group a run list whose runs all have one length (at most ``max_piece`` bytes) into
    evenly spaced pieces, vectorised: consecutive runs whose sources and destinations both
    advance by the list's stride (the first step, among the first 64, that the next step
    repeats) join one group. None when the runs differ in length, a stride is not positive or
    a destination stride is shorter than a run (pieces would overlap), or the groups are not
    at least ``min_gain`` times fewer than the runs (the tile plan is as good)."""
    s, d, n = as_runs(src, dst, nbytes)
    if s.size < 2 * min_gain or not 0 < int(n[0]) <= max_piece:
        return None  # few runs, or long ones (a tile each is as good): no scan
    piece = int(n[0])
    if int(n.min()) != piece or int(n.max()) != piece:
        return None
    ds, dd = s[1:] - s[:-1], d[1:] - d[:-1]
    # the stride: the first step that the next step repeats (among the first 64)
    h = min(ds.size, 65)
    same = (ds[: h - 1] == ds[1:h]) & (dd[: h - 1] == dd[1:h])
    k = int(np.argmax(same)) if same.any() else 0
    s_stride, d_stride = int(ds[k]), int(dd[k])
    if s_stride <= 0 or d_stride < piece:
        return None
    cont = (ds == s_stride) & (dd == d_stride)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    if starts.size * min_gain > s.size:
        return None
    count = np.diff(np.append(starts, s.size)).astype(np.int64)
    gs, gd = s[starts], d[starts]
    acc = int(np.bitwise_or.reduce(gs | gd)) | piece | s_stride | d_stride | max_width
    width = acc & -acc
    return GroupPlan(
        src=gs,
        dst=gd,
        count=count,
        n=piece,
        src_stride=s_stride,
        dst_stride=d_stride,
        width=width,
    )


def expand_groups(plan: GroupPlan) -> tuple[I64, I64, I64]:
    """The run list a group plan copies (the oracle's view of it), vectorised."""
    total = int(plan.count.sum())
    g = np.repeat(np.arange(plan.num_groups, dtype=np.int64), plan.count)
    t = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(plan.count) - plan.count, plan.count)
    return (
        plan.src[g] + t * plan.src_stride,
        plan.dst[g] + t * plan.dst_stride,
        np.full(total, plan.n, dtype=np.int64),
    )


def _byte_index(start: I64, lens: I64) -> I64:
    """Concatenated ``arange(start[i], start[i] + lens[i])`` for every i, vectorised."""
    total = int(lens.sum())
    first = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) - np.repeat(first - start, lens)


def _assign(memory: Any, dst_idx: I64, src_idx: I64) -> None:
    if isinstance(memory, np.ndarray):
        memory[dst_idx] = memory[src_idx]
        return
    import torch

    di = torch.from_numpy(dst_idx).to(memory.device)
    si = torch.from_numpy(src_idx).to(memory.device)
    memory[di] = memory[si]


def copy_runs_reference(memory: Any, src: ArrayLike, dst: ArrayLike, nbytes: ArrayLike) -> int:
    """Copy runs inside ``memory`` (a 1-D ``uint8`` NumPy array or torch tensor; addresses are
    byte offsets into it), vectorised; returns the bytes copied. The CPU oracle of the movers.
    """
    s, d, n = as_runs(src, dst, nbytes)
    if s.size and int(max((s + n).max(), (d + n).max())) > int(memory.shape[0]):
        raise ValueError("a run ends past the end of memory")
    _assign(memory, _byte_index(d, n), _byte_index(s, n))
    return int(n.sum())


def copy_tiles_reference(memory: Any, plan: TilePlan) -> int:
    """Execute a tile plan inside ``memory`` as the kernel does (each tile copies
    ``elems * width`` bytes), vectorised; returns the bytes copied."""
    lens = plan.elems * plan.width
    if np.any(plan.src % plan.width) or np.any(plan.dst % plan.width):
        raise ValueError(f"a tile is not aligned to its element width {plan.width}")
    if np.any(lens > plan.tile_bytes):
        raise ValueError("a tile is longer than the plan's tile_bytes")
    _assign(memory, _byte_index(plan.dst, lens), _byte_index(plan.src, lens))
    return int(lens.sum())


def unit_runs(
    addrs: ArrayLike,
    units: ArrayLike,
    block: int,
    *,
    slot_bytes: int,
    per_page: int,
    unit_bytes: int,
    lo: int,
    row: int,
    n: int,
    tokens: int,
) -> tuple[I64, I64, I64]:
    """The byte runs the token-run mover (:class:`kvwire.movers.triton_units.UnitCopier`)
    copies, as (pool addresses, block addresses, lengths): for every buffer at ``addrs[b]``
    and unit ``units[i]`` (page ``u // per_page``, ``(u % per_page) * unit_bytes`` into its
    slot), ``tokens`` pieces of ``n`` bytes at ``lo + t * row``, laid out in the block at
    ``block`` as ``[buffer, unit, token, n]``. NumPy only; with :func:`copy_runs_reference`
    it is the oracle of the mover's tests (and the CPU path's)."""
    a, u = _i64(addrs), _i64(units)
    page, k = u // per_page, u % per_page
    start = a[:, None] + (page * slot_bytes + k * unit_bytes + lo)[None, :]  # [buffer, unit]
    pool = (start[:, :, None] + (np.arange(tokens, dtype=np.int64) * row)[None, None, :]).ravel()
    blk = block + np.arange(pool.size, dtype=np.int64) * n
    return pool, blk, np.full(pool.size, n, dtype=np.int64)


def head_runs(
    addrs: ArrayLike,
    units: ArrayLike,
    block: int,
    *,
    slot_bytes: int,
    per_page: int,
    unit_bytes: int,
    lo: int,
    head_stride: int,
    token_stride: int,
    n: int,
    heads: int,
    tokens: int,
) -> tuple[I64, I64, I64]:
    """The byte runs the head-major mover (:class:`kvwire.movers.triton_heads.HeadCopier`)
    copies, as (pool addresses, block addresses, lengths): for every buffer at ``addrs[b]``,
    unit ``units[i]`` (page ``u // per_page``, ``(u % per_page) * unit_bytes`` into each
    head's run of its slot), token ``t < tokens`` and head ``h < heads``, one piece of ``n``
    bytes at ``lo + h * head_stride + t * token_stride`` past the unit, laid out in the block
    at ``block`` as ``[buffer, unit, token, head, n]`` (token order: a token's heads side by
    side). A head-major slot ``[heads, page, head bytes]`` has ``head_stride = page * head
    bytes`` and ``token_stride = n = head bytes``. NumPy only (broadcasting, no loop); with
    :func:`copy_runs_reference` it is the oracle of the mover's tests."""
    a, u = _i64(addrs), _i64(units)
    page, k = u // per_page, u % per_page
    start = a[:, None] + (page * slot_bytes + k * unit_bytes + lo)[None, :]  # [buffer, unit]
    th = (
        np.arange(tokens, dtype=np.int64)[:, None] * token_stride
        + np.arange(heads, dtype=np.int64)[None, :] * head_stride
    ).ravel()  # [token, head]
    pool = (start[:, :, None] + th[None, None, :]).ravel()
    blk = block + np.arange(pool.size, dtype=np.int64) * n
    return pool, blk, np.full(pool.size, n, dtype=np.int64)
