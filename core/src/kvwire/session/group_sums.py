"""Checksums of buffer groups (state, sliding window, draft layers) on a checked link.

A request's buffer groups move after its last KV chunk, in one transfer per (prefill rank,
decode rank) whose note is ``ChunkNote(what="state")`` (:mod:`kvwire.session.prefill.groups`).
On a link where decode asked for checksums (``kv_checksum``) and prefill speaks protocol 1.14
(``HelloAck.group_checksum``), prefill sums the group rows it posts, with the same row hasher
as KV chunks (:func:`kvwire.session.checksums.hasher_for`: NumPy over host memory, one Triton
launch over GPU memory), and the state note carries the sums: summed before posting, or, for
host rows from the hasher's ``LATE_BYTES`` on (:meth:`SentGroupSums.late`), on a piece-sum
thread while the rows fly, the note then in two parts (the transfer's, without sums, and the
sums' own over the control channel once computed, as a whole KV chunk's late sums go:
:mod:`kvwire.session.prefill.late_sums`); decode waits for every part, then sums the rows
that landed, found from its own slots for the request the way prefill found them (the same
:class:`~kvwire.index.groups.GroupMapper`, built from both layouts), and fails the request on
a mismatch, naming the group and its layers. A decode rank that checks and meets a 1.13
prefill (no group sums) logs a warning per link and leaves that link's groups unchecked.

Sums are keyed per (group, layer): :class:`GroupBuffers` numbers them densely, groups in
the order of their names with each group's model-wide layer count (the fields both sides'
groups must agree on), so a key means the same on both sides whatever their layer ranges
(pipeline parallelism) or group order.

Threads: built on a handshake thread (prefill) or the thread that takes the acknowledgement
(decode); :meth:`SentGroupSums.sums` runs on a transfer worker, :meth:`LandedGroupSums.sums`
on a decode checker thread or the thread that took the note (GPU pools). Both only read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property

import numpy as np
from numpy.typing import NDArray

from kvwire.descriptors import ADDR, LEN, IndexArray
from kvwire.errors import HandshakeError
from kvwire.index.base import IndexMapper
from kvwire.index.tables import TablePair
from kvwire.integrity import LayerSums, RowHasher, layer_ranges
from kvwire.layout import KVLayout, MemoryRegion
from kvwire.session.checksums import hasher_for
from kvwire.session.groups import Indices

__all__ = ["GroupBuffers", "LandedGroupSums", "SentGroupSums", "describe_keys"]


class GroupBuffers:
    """A layout's buffer-group buffers as a :class:`~kvwire.integrity.SummedBuffers`: every
    buffer's rows are summed under the dense key of its (group, layer)."""

    def __init__(self, layout: KVLayout) -> None:
        self._layout = layout

    @cached_property
    def offsets(self) -> dict[str, int]:
        """The first key of each group (groups in the order of their names)."""
        out: dict[str, int] = {}
        at = 0
        for g in sorted(self._layout.groups, key=lambda g: g.name):
            out[g.name] = at
            at += g.num_layers
        return out

    @cached_property
    def buffers(self) -> Sequence[MemoryRegion]:
        """Every group's buffers, group by group in the layout's order."""
        return self._layout.group_regions

    @cached_property
    def buffer_keys(self) -> NDArray[np.int64]:
        """Column 0: the key of each buffer (its group's first key plus its layer)."""
        keys = [
            self.offsets[g.name] + g.buffer_keys[:, 0] for g in self._layout.groups if g.buffers
        ]
        col = np.concatenate(keys) if keys else np.empty(0, np.int64)
        return col.astype(np.int64).reshape(-1, 1)


def describe_keys(layout: KVLayout, keys: Sequence[int]) -> str:
    """Mismatching keys named as groups and layer ranges ("'conv' layers 2-3; 'ssm' layers
    0"), for an error message."""
    offsets = GroupBuffers(layout).offsets
    starts = sorted((at, name) for name, at in offsets.items())
    by_group: dict[str, list[int]] = {}
    for k in sorted(keys):
        at, name = max(((a, n) for a, n in starts if a <= k), default=(0, "?"))
        by_group.setdefault(name, []).append(k - at)
    return "; ".join(f"{name!r} layers {layer_ranges(ls)}" for name, ls in by_group.items())


class SentGroupSums:
    """Prefill side of one checked link: the sums of a request's group rows (rows of the
    link's group table pair), each keyed by where it lands on decode."""

    def __init__(self, layout: KVLayout, tables: TablePair) -> None:
        """``tables``: the link's group tables (:meth:`GroupMapper.build_tables
        <kvwire.index.groups.GroupMapper.build_tables>`, as prepared for its transfers)."""
        self.src = tables.src
        self._dst_addr = tables.dst[:, ADDR]
        self.hasher: RowHasher = hasher_for(GroupBuffers(layout))

    def late(self, src_rows: IndexArray) -> bool:
        """Transfer worker, before posting a request's group rows ``src_rows``: whether they
        are summed while they fly, their sums told after them as the state note's second
        part (from the hasher's ``LATE_BYTES`` on: host memory, 8 MiB; never on a GPU, whose
        sum costs less than the extra part), as a whole KV chunk's are
        (:mod:`kvwire.session.prefill.late_sums`)."""
        rows = np.asarray(src_rows, dtype=np.int64)
        return int(self.src[rows, LEN].sum()) >= self.hasher.LATE_BYTES

    def sums(self, src_rows: IndexArray, dst_rows: IndexArray) -> LayerSums:
        """Transfer worker (or a piece-sum thread, for late sums): the sums of source rows
        ``src_rows`` keyed by the destination rows ``dst_rows`` they go to."""
        dst = self._dst_addr[np.asarray(dst_rows, dtype=np.int64)]
        return self.hasher.sums(self.src, src_rows, dst)


class LandedGroupSums:
    """Decode side of one checked link: the sums of the group rows a request's group
    transfer from that prefill rank wrote."""

    #: Checked on a checker thread (host pools) or the noting thread (GPU pools), as the
    #: link's KV chunks are (:attr:`kvwire.session.checksums.LandedSums.inline`).
    inline: bool

    def __init__(self, mapper: IndexMapper, local: KVLayout) -> None:
        groups = mapper.group_mapper()
        if groups is None or not groups.sends:
            raise HandshakeError("it says it moves buffer groups, and the layouts give it none")
        self.groups = groups
        self.layout = local
        self.dst = groups.build_tables().dst
        self.hasher: RowHasher = hasher_for(GroupBuffers(local))
        self.inline = bool(self.hasher.INLINE_CHECK)

    def rows(
        self, group_dst: Mapping[str, NDArray[np.int64]], dst_pages: NDArray[np.int64]
    ) -> IndexArray:
        """The rows of this rank's group table the request's group transfer writes, from the
        request's group slots and destination pages (as prefill's worker maps them: source
        slots are placeholders, decode needs only its own side)."""
        dst: Indices = dict(group_dst)
        if "pages" in self.groups.index_names:
            dst["pages"] = np.asarray(dst_pages, dtype=np.int64)
        src = {name: np.zeros(idx.size, dtype=np.int64) for name, idx in dst.items()}
        return self.groups.map_request(src, dst)[1]

    def sums(self, rows: IndexArray) -> LayerSums:
        """The sums of the landed rows ``rows`` (:meth:`rows`), keyed by themselves."""
        idx = np.asarray(rows, dtype=np.int64)
        return self.hasher.sums(self.dst, idx, self.dst[idx, ADDR])
