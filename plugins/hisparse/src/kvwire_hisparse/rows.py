"""Vectorised row planning for the row copier (:mod:`kvwire_hisparse.copier`): which source
region holds each row (:class:`Ranges`), per-thread reusable work arrays (:class:`Scratch`)
and the address span of one memory kind and device (:class:`Span`). Called on a transfer
worker's thread per chunk; nothing here is shared between threads except read-only tables."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import ConfigError
from kvwire.layout import MemKind

__all__ = [
    "I64_MAX",
    "Group",
    "Ranges",
    "Scratch",
    "Span",
    "consecutive_runs",
    "group_rows",
    "row_width",
]

I64_MAX = np.iinfo(np.int64).max


class Scratch(threading.local):
    """Per-thread work arrays reused across calls: planning makes a dozen passes over arrays
    of one entry per row, and fresh allocations of that size cost page faults each time (more
    than the arithmetic). Views handed out live until the same thread asks again."""

    #: Arrays larger than this many entries are not kept.
    KEEP_MAX = 1 << 22

    def __init__(self) -> None:
        self.bufs: dict[tuple[str, str], NDArray[Any]] = {}

    def get(self, name: str, n: int, dtype: Any) -> NDArray[Any]:
        dt = np.dtype(dtype)
        if n > self.KEEP_MAX:
            return np.empty(n, dtype=dt)
        key = (name, dt.str)
        buf = self.bufs.get(key)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 4096), dtype=dt)
            self.bufs[key] = buf
        return buf[:n]


class Ranges:
    """Which of a few sorted, non-overlapping address ranges holds each of many rows.

    Addresses are handled as int64 (user-space addresses are below 2**63; larger ones, negative
    here, are never inside a range). ``np.searchsorted`` with unsorted keys costs ~40 ns a row,
    more than the rest of a copy's planning together; when the ranges allow it, a bucket table
    is used instead: buckets no longer than the shortest range hold at most one range start
    each, so a row's range is its bucket's last range (``table``) or the next one, a few gathers
    and compares a row. Falls back to ``searchsorted`` when the table would exceed
    ``max_buckets`` entries.
    """

    def __init__(
        self, starts: Sequence[int], ends: Sequence[int], max_buckets: int = 1 << 22
    ) -> None:
        if int(ends[-1]) > I64_MAX:
            raise ConfigError(f"address range ending at {int(ends[-1]):#x} is above 2**63")
        n = len(starts)
        self.starts = np.array(starts, dtype=np.int64)
        self.ends = np.array(ends, dtype=np.int64)
        self.next_start = np.append(self.starts[1:], np.int64(I64_MAX))
        self.base = int(starts[0])
        shortest = min(int(e) - int(s) for s, e in zip(starts, ends, strict=True))
        self.shift = max(0, shortest.bit_length() - 1)  # 2**shift <= shortest
        self.nbuckets = ((int(ends[-1]) - self.base) >> self.shift) + 1
        self.table: NDArray[np.intp] | None = None
        if n > 1 and self.nbuckets <= max_buckets:
            firsts = self.base + (np.arange(self.nbuckets, dtype=np.int64) << self.shift)
            table = np.searchsorted(self.starts, firsts, side="right").astype(np.intp) - 1
            # one more bucket for every address outside [base, last end]: clamped there
            self.table = np.append(table, np.intp(n - 1))

    def locate(
        self, addr: NDArray[np.int64], row_len: int, sc: Scratch, tag: str
    ) -> tuple[NDArray[np.intp], NDArray[np.bool_]]:
        """(range index of each row, mask of rows entirely inside that range); both are
        scratch arrays of ``sc`` named after ``tag``."""
        n = addr.size
        lengths = self.ends - self.starts
        first = np.where(lengths >= row_len, self.starts, I64_MAX)  # too short: holds no row
        last = self.ends - row_len
        ok = sc.get(tag + "ok", n, np.bool_)
        ok2 = sc.get(tag + "ok2", n, np.bool_)
        pos = sc.get(tag + "pos", n, np.intp)
        if self.starts.size == 1:
            np.greater_equal(addr, first[0], out=ok)
            np.less_equal(addr, last[0], out=ok2)
            ok &= ok2
            pos.fill(0)
            return pos, ok
        tmp = sc.get(tag + "tmp", n, np.int64)
        if self.table is not None:
            np.subtract(addr, self.base, out=tmp)
            np.right_shift(tmp, self.shift, out=tmp)
            np.clip(tmp, 0, self.nbuckets, out=tmp)
            np.take(self.table, tmp, out=pos, mode="clip")
            np.take(self.next_start, pos, out=tmp, mode="clip")
            np.greater_equal(addr, tmp, out=ok)
            pos += ok
        else:
            pos[:] = np.searchsorted(self.starts, addr, side="right")
            pos -= 1
            np.maximum(pos, 0, out=pos)
        np.take(first, pos, out=tmp, mode="clip")
        np.greater_equal(addr, tmp, out=ok)
        np.take(last, pos, out=tmp, mode="clip")
        np.less_equal(addr, tmp, out=ok2)
        ok &= ok2
        return pos, ok


@dataclass(frozen=True)
class Span:
    """The source regions of one memory kind and device, as one address range."""

    kind: MemKind
    device: int
    base: int
    end: int
    #: (start, end) of each region in the span, sorted.
    regions: tuple[tuple[int, int], ...]

    def first_row(self, residue: int, row_len: int) -> int:
        """Lowest address ``base + residue + k * row_len`` inside a region (views start there,
        so that their base pointer is always valid memory)."""
        first = self.base + residue
        for start, end in self.regions:
            if end <= first:
                continue
            lo = max(start, first)
            q = first + -(-(lo - first) // row_len) * row_len
            if q + row_len <= end:
                return q
        return first


@dataclass
class Group:
    """Rows of one (span, pool, source residue, destination residue): a row's source is at
    ``span base + rs + src_rows[i] * row_len``, its destination ``rd + dst_rows[i] * row_len``
    into the pool."""

    span: int
    pool: int
    rs: int
    rd: int
    src_rows: NDArray[np.int64]
    dst_rows: NDArray[np.int64]


def group_rows(
    src: NDArray[np.int64],
    dst: NDArray[np.int64],
    pos_d: NDArray[np.integer],
    span: NDArray[np.integer] | None,
    row_len: int,
    *,
    src_base: NDArray[np.int64],
    pool_rstart: NDArray[np.int64],
    sc: Scratch,
) -> list[Group]:
    """Split validated rows into :class:`Group` s, vectorised (no per-row Python).

    ``pos_d``: each row's pool; ``span``: each row's span (None: one span); ``src_base``: each
    row's span base (length 1 when there is one span); ``pool_rstart``: each pool's remote
    start. The row arrays are scratch arrays of ``sc`` (valid until the thread plans again).
    """
    n = src.size
    npools = pool_rstart.size
    rows_s, rs = sc.get("rows_s", n, np.int64), sc.get("rs", n, np.int64)
    rows_d, rd = sc.get("rows_d", n, np.int64), sc.get("rd", n, np.int64)
    if src_base.size == 1:
        np.subtract(src, src_base[0], out=rows_s)
    else:
        np.subtract(src, src_base, out=rows_s)
    if npools == 1:
        np.subtract(dst, pool_rstart[0], out=rows_d)
    else:
        np.subtract(dst, np.take(pool_rstart, pos_d), out=rows_d)
    if row_len & (row_len - 1) == 0:  # the usual case: shifts and masks, no division
        shift, mask = row_len.bit_length() - 1, row_len - 1
        for rows, res in ((rows_s, rs), (rows_d, rd)):
            np.bitwise_and(rows, mask, out=res)
            np.right_shift(rows, shift, out=rows)
    else:
        for rows, res in ((rows_s, rs), (rows_d, rd)):
            np.divmod(rows, row_len, out=(rows, res))
    members: list[NDArray[np.intp] | slice] = [slice(None)]
    residues = bool(rs.any() or rd.any())
    if span is not None or npools > 1 or residues:
        key = pos_d.astype(np.int64)
        if span is not None:
            key += span.astype(np.int64) * npools
        if residues:
            cols = np.stack([key, rs, rd], axis=1)
            _, inverse = np.unique(cols, axis=0, return_inverse=True)
            key = inverse.reshape(-1)
        if key.min() != key.max():
            order = np.argsort(key, kind="stable")
            cuts = np.flatnonzero(np.diff(key[order])) + 1
            members = list(np.split(order, cuts))
    groups = []
    for m in members:
        first = 0 if isinstance(m, slice) else int(m[0])
        groups.append(
            Group(
                0 if span is None else int(span[first]),
                int(pos_d[first]),
                int(rs[first]),
                int(rd[first]),
                rows_s[m],
                rows_d[m],
            )
        )
    return groups


def consecutive_runs(
    g: Group, row_len: int, min_run_bytes: int, sc: Scratch
) -> NDArray[np.intp] | None:
    """Run boundaries (``[0, ..., n]``) of a group's consecutive rows (on both sides) if the
    runs average at least ``min_run_bytes``, else None."""
    n = g.src_rows.size
    if n * row_len < min_run_bytes:
        return None
    step = sc.get("step", n - 1, np.int64)
    brk, brk2 = sc.get("brk", n - 1, np.bool_), sc.get("brk2", n - 1, np.bool_)
    np.subtract(g.src_rows[1:], g.src_rows[:-1], out=step)
    np.not_equal(step, 1, out=brk)
    np.subtract(g.dst_rows[1:], g.dst_rows[:-1], out=step)
    np.not_equal(step, 1, out=brk2)
    brk |= brk2
    if n * row_len < (int(np.count_nonzero(brk)) + 1) * min_run_bytes:
        return None
    return np.concatenate(([0], np.flatnonzero(brk) + 1, [n])).astype(np.intp)


def row_width(row_len: int, src_base: int, dst_base: int) -> int:
    """The widest element (8, 4, 2 or 1 bytes) dividing the row length and both bases."""
    for w in (8, 4, 2):
        if row_len % w == 0 and src_base % w == 0 and dst_base % w == 0:
            return w
    return 1
