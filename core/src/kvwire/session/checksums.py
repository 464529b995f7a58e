"""KV checksums on a link (:mod:`kvwire.integrity`): what each side computes, and the check.

Prefill: a :class:`SentSums` per decode link that asked (``Hello.checksum``), built at
handshake. A whole chunk (not layer-wise, not cut in pieces) of a host pool from the hasher's
``LATE_BYTES`` on (8 MiB) is summed on a piece-sum thread while its rows are posted and fly,
and its sums go to decode as the chunk's last part, over the control channel
(:mod:`kvwire.session.prefill.late_sums`); a smaller one, any chunk of a GPU pool and a
layer-wise group are summed by the transfer worker before they are posted, their sums in
the first note. A
chunk posted in place as one set of rows (no staging, no layer groups), over a backend whose
own thread moves the bytes (``pushes_events``), is cut by layers into pieces first
(:meth:`SentSums.pieces`), each posted with a note carrying its layer range
(``ChunkNote.piece_layers``, protocol 1.12) and its own rows' sums (:meth:`SentSums.rows`)
computed just before it is posted: every piece after the first is summed while the pieces
before it are in flight, and decode checks each piece as its note arrives, while the later
ones are in flight, so only the first piece's sum and the last one's check are in the
request's path (a chunk of one piece is summed whole, as before, by :meth:`SentSums.chunk`).
A 1.11 decode adds the sums of a chunk's notes and checks it whole: the same total whichever
way the chunk was cut.

Decode: a :class:`LandedSums` per prefill link, built when the acknowledgement arrives; once
a chunk is complete (every part arrived, staged blocks scattered), or a piece's note arrived, a
checker thread (:mod:`kvwire.session.decode.checker`) asks it for the sums of the rows that
chunk (or the piece's layers of it) wrote, found the way prefill found them (the same mapper,
built from both layouts, and the chunk's page span from the note), and compares.

A link whose mapping has a page form (:mod:`kvwire.page_form`: whole pages, or head slices)
is summed from it on both sides (:meth:`RowHasher.page_sums`): prefill from the chunk's page
lists and the link's source and destination :class:`~kvwire.page_form.PageSide`, decode from
the chunk's destination pages and its own side; no row is mapped or listed, and the sums are
the row form's, bit for bit. Other links (page-size conversion, dummy senders, K and V as
planes, head-major pages) sum the mapped rows.

KV pools in host and in GPU memory alike (:func:`hasher_for`). Here the KV pool (``"kv"``);
buffer groups are summed with the same hashers by :mod:`kvwire.session.group_sums` (1.14);
aux rows carry their own room stamp, and a decode's extra pools (HiSparse's ``"host"``, say)
are not checksummed yet (docs/integrity.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.config import KVWireConfig
from kvwire.descriptors import ADDR, LEN, DescTable, IndexArray
from kvwire.errors import DescriptorError, KVWireError
from kvwire.index.base import IndexMapper
from kvwire.integrity import LayerSums, OrderedSums, RowHasher, SummedBuffers
from kvwire.layout import KVLayout, MemKind
from kvwire.page_form import PageSide, page_sides
from kvwire.session.handshake import build_mapper

logger = logging.getLogger(__name__)


def hasher_for(layout: SummedBuffers) -> RowHasher:
    """The row hasher for this rank's KV buffers, by their memory kind: NumPy over host
    memory, or one Triton launch per call over GPU memory (imported only then). Called at
    handshake, once per link, by either side."""
    if layout.buffers and all(MemKind(b.kind) is MemKind.VRAM for b in layout.buffers):
        try:
            from kvwire.integrity_device import DeviceRowHasher
        except ImportError as err:
            raise DescriptorError(
                f"KV checksums of GPU pools need torch and triton here ({err}); turn "
                "kv_checksum off or install them"
            ) from err
        return DeviceRowHasher(layout)
    return RowHasher(layout)


class SentSums:
    """Prefill side of one link: sums of source rows, keyed by where they land on decode.
    Built on a handshake thread; :meth:`chunk` is called by transfer workers (chunks summed
    before posting, layer-wise groups) and piece-sum threads (late sums,
    :mod:`kvwire.session.prefill.late_sums`),
    each keeping its own last chunk's mapped rows (thread-local: a layer-wise chunk asks once
    per group, for the same rows, and they are mapped once); it only reads."""

    def __init__(self, mapper: IndexMapper, local: KVLayout) -> None:
        self.mapper = mapper
        self.tables = mapper.build_tables()
        self.hasher = hasher_for(local)
        self._local = threading.local()
        #: The link's page geometry as byte addresses (source side, destination side), or
        #: None where chunks are summed as rows (:func:`_page_sides`).
        self.sides = _page_sides(mapper, self.tables.src, self.tables.dst)
        #: Bytes of one page slot of every buffer of this rank (:meth:`late`).
        self.page_bytes = sum(int(b.item_len) for b in local.buffers)

    def warm_up(self) -> Callable[[], None] | None:
        """Prefill's handshake: for sums computed in GPU memory, a warm-up (for a
        :class:`~kvwire.movers.warmup.Warmer`) that sums the link's first page as a chunk's
        sums are taken beside a write, so the hasher's kernel is compiled before the first
        chunk (a real launch that only reads the page; a first page that is not a chunk of
        the mapper is skipped, at debug level); None for host sums (nothing to compile)."""
        if self.hasher.KIND is not MemKind.VRAM:
            return None
        one = np.zeros(1, dtype=np.int64)
        return lambda: _quietly(lambda: self.chunk(one, one))

    def late(self, units: int) -> bool:
        """A transfer worker, before posting a whole chunk of ``units`` source pages: whether
        it is summed while its rows fly, its sums sent after them
        (:mod:`kvwire.session.prefill.late_sums`): from the hasher's ``LATE_BYTES`` on, the
        chunk counted as whole pages of every buffer (an upper bound of its bytes)."""
        return units * self.page_bytes >= self.hasher.LATE_BYTES

    @property
    def cuts(self) -> bool:
        """Whether :meth:`pieces` may cut a chunk (the hasher's ``PIECE_BYTES`` is not 0): a
        worker asks before reading a page-form segment's rows, which would expand them."""
        return self.hasher.PIECE_BYTES > 0

    def chunk(
        self,
        src_units: NDArray[np.int64],
        dst_units: NDArray[np.int64],
        layers: tuple[int, int] | None = None,
    ) -> LayerSums:
        """Per-layer sums of a chunk's rows (``src_units``/``dst_units`` as the job holds
        them), only of layers ``[a, b)`` when given (one layer-wise group). The same
        ``src_units`` and ``dst_units`` objects as this thread's last call reuse its mapped
        rows (and the hasher its located ones: the same objects are passed on). A link with a
        page form sums the chunk from its pages (:meth:`RowHasher.page_sums`), never
        mapping its rows."""
        only = None if layers is None else range(*layers)
        if self.sides is not None:
            pages = self.mapper.page_chunk(src_units, dst_units)
            if pages is None:
                return {}  # no page (checked as map_chunk checks them)
            src, dst = self.sides
            return self.hasher.page_sums(src, pages.src_pages, dst, pages.dst_pages, only)
        last: tuple[Any, ...] | None = getattr(self._local, "last", None)
        if last is not None and last[0] is src_units and last[1] is dst_units:
            src_idx, keys = last[2], last[3]
        else:
            src_idx, dst_idx = self.mapper.map_chunk(src_units, dst_units)
            keys = self.tables.dst[np.asarray(dst_idx, dtype=np.int64), ADDR]
            self._local.last = (src_units, dst_units, src_idx, keys)
        return self.hasher.sums(self.tables.src, src_idx, keys, only)

    def chunk_later(
        self,
        src_units: NDArray[np.int64],
        dst_units: NDArray[np.int64],
        layers: tuple[int, int] | None = None,
    ) -> OrderedSums | None:
        """:meth:`chunk` ordered now, computed beside the write or in it, and waited for
        later by whoever calls the result (prefill's first note of the chunk, made once its
        write ended): for a link with a page form whose hasher computes beside the caller
        (:meth:`RowHasher.sums_order`: a writer with ``summed_writes`` sums it in its own
        launch, any other starts it at submit); else None (call :meth:`chunk`). A transfer
        worker, before posting the chunk."""
        if self.sides is None:
            return None
        pages = self.mapper.page_chunk(src_units, dst_units)
        if pages is None:
            return None  # no page: chunk() gives {} at once
        src, dst = self.sides
        only = None if layers is None else range(*layers)
        return self.hasher.sums_order(src, pages.src_pages, dst, pages.dst_pages, only)

    def pieces(
        self, src_idx: IndexArray, dst_idx: IndexArray
    ) -> list[tuple[IndexArray, IndexArray, tuple[int, int]]]:
        """A transfer worker, before posting a chunk's rows (``src_idx``/``dst_idx`` in the
        mapper's KV tables, as :meth:`ChunkPlan.direct` gives them): the rows cut by layers
        into pieces to post one after another, each with its layer range ``[a, b)`` (every row
        of the chunk in those layers, in the chunk's row order). Each piece is summed just
        before it is posted (:meth:`rows`) and checked by decode as soon as its note arrives
        (``ChunkNote.piece_layers``). Piece sizes ramp up from about the hasher's
        ``PIECE_BYTES``, doubling, and down again to about it at the end: prefill's sum of the
        first piece and decode's check of the last are the only ones not overlapped by a
        write, and each piece's sum takes less time than the write of the one before it. Cuts
        fall on layer boundaries (the first half's after its byte bound, the second half's
        before it). A chunk of less than three first pieces, of one layer, or a hasher with
        ``PIECE_BYTES`` 0 is not cut (an empty list)."""
        first = self.hasher.PIECE_BYTES
        src = np.asarray(src_idx, dtype=np.int64)
        if first <= 0 or src.size < 2:
            return []
        lens = self.tables.src[src, LEN].astype(np.int64)
        total = int(lens.sum())
        if total < 3 * first:
            return []
        layers, inverse = np.unique(
            self.hasher.row_layers(self.tables.src, src), return_inverse=True
        )
        if layers.size < 2:
            return []
        ends = np.cumsum(np.bincount(inverse, minlength=layers.size, weights=lens))
        up = [first]  # byte bounds of the first half: first * (2**k - 1)
        while up[-1] * 2 + first < total / 2:
            up.append(up[-1] * 2 + first)
        after = np.searchsorted(ends, np.asarray(up, dtype=np.float64), side="left")
        before = np.searchsorted(ends, total - np.asarray(up, dtype=np.float64), side="right") - 1
        cuts = np.unique(np.concatenate((after, before)))  # pieces end after these layers
        cuts = cuts[(cuts >= 0) & (cuts < layers.size - 1)] + 1
        if not cuts.size:
            return []
        order = np.argsort(inverse, kind="stable")  # rows by layer, in row order within one
        at = np.searchsorted(inverse[order], cuts, side="left")
        dst = np.asarray(dst_idx, dtype=np.int64)
        lo = [0, *cuts.tolist()]
        hi = [*cuts.tolist(), layers.size]
        return [
            (src[rows], dst[rows], (int(layers[a]), int(layers[b - 1]) + 1))
            for rows, a, b in zip(map(np.sort, np.split(order, at)), lo, hi, strict=True)
        ]

    def rows(self, src_idx: IndexArray, dst_idx: IndexArray) -> LayerSums:
        """A transfer worker, just before posting rows ``src_idx`` of the mapper's source
        table to rows ``dst_idx`` of its destination table (one piece of :meth:`pieces`):
        their per-layer sums."""
        idx = np.asarray(src_idx, dtype=np.int64)
        keys = self.tables.dst[np.asarray(dst_idx, dtype=np.int64), ADDR]
        return self.hasher.sums(self.tables.src, idx, keys)


class LandedSums:
    """Decode side of one link: sums of the destination rows a chunk from that prefill rank
    wrote. Built on the thread that handles the acknowledgement; :meth:`chunk` is called by
    decode's checker threads, several at once (it only reads the mapper and the table)."""

    def __init__(self, config: KVWireConfig, remote: KVLayout, local: KVLayout) -> None:
        self.mapper = build_mapper(config, remote, local)
        tables = self.mapper.build_tables()
        self.dst = tables.dst
        self.hasher = hasher_for(local)
        #: This side of the link's page geometry in bytes, or None (chunks summed as rows).
        sides = _page_sides(self.mapper, tables.src, tables.dst)
        self.side = None if sides is None else sides[1]

    def warm_up(self) -> Callable[[], None] | None:
        """Decode's handshake: as :meth:`SentSums.warm_up`, summing its own first page as
        the check of a one-page chunk does (read only)."""
        if self.hasher.KIND is not MemKind.VRAM:
            return None
        return lambda: _quietly(lambda: self.chunk(1, np.zeros(1, dtype=np.int64), None, (0, 1)))

    @property
    def inline(self) -> bool:
        """Decode checks this link's chunks on the thread that saw them complete (its
        hasher's :attr:`~kvwire.integrity.RowHasher.INLINE_CHECK`), not on a checker
        thread."""
        return bool(self.hasher.INLINE_CHECK)

    def chunk(
        self,
        num_pages: int,
        dst_pages: NDArray[np.int64],
        cached_tokens: int | None,
        span: tuple[int, int],
        layers: tuple[int, int] | None = None,
    ) -> LayerSums:
        """Per-layer sums of what landed for request pages ``[start, end)`` of a request of
        ``num_pages`` pages, into ``dst_pages`` (the request's destination pages); only of
        layers ``[a, b)`` when given (one piece of the chunk, ``ChunkNote.piece_layers``).
        A link with a page form sums the landed pages (keyed by themselves) without mapping
        rows, as prefill summed them."""
        only = None if layers is None else range(*layers)
        if self.side is not None:  # the chunk's destination pages (granules: page sizes differ)
            pages = self._pages(num_pages, dst_pages, cached_tokens, span)
            if pages is None:
                return {}  # nothing of this chunk lands here
            return self.hasher.page_sums(self.side, pages, self.side, pages, only)
        src_units, dst = self._slice(num_pages, dst_pages, cached_tokens, span)
        _, dst_idx = self.mapper.map_chunk(src_units, dst)
        idx = np.asarray(dst_idx, dtype=np.int64)
        return self.hasher.sums(self.dst, idx, self.dst[idx, ADDR], only)

    def chunk_later(
        self,
        num_pages: int,
        dst_pages: NDArray[np.int64],
        cached_tokens: int | None,
        span: tuple[int, int],
        layers: tuple[int, int] | None = None,
    ) -> Callable[[], LayerSums] | None:
        """:meth:`chunk` launched now and waited for by calling the result (once, on the
        same thread), where the link has a page form and its hasher computes beside the
        caller (a GPU's: :meth:`RowHasher.page_sums_later`); None otherwise (call
        :meth:`chunk`). Decode's note handler launches every check a drain of notes
        completed (up to four) before it waits for the first
        (:meth:`~kvwire.session.decode.checker.ChunkChecker.run_deferred`)."""
        if self.side is None:
            return None
        pages = self._pages(num_pages, dst_pages, cached_tokens, span)
        if pages is None:
            return lambda: {}
        only = None if layers is None else range(*layers)
        return self.hasher.page_sums_later(self.side, pages, self.side, pages, only)

    def _pages(
        self,
        num_pages: int,
        dst_pages: NDArray[np.int64],
        cached_tokens: int | None,
        span: tuple[int, int],
    ) -> NDArray[np.int64] | None:
        """A link with a page form: the destination pages the chunk landed on (None: none
        here)."""
        chunk = self.mapper.page_chunk(*self._slice(num_pages, dst_pages, cached_tokens, span))
        return None if chunk is None else chunk.dst_pages

    def _slice(
        self,
        num_pages: int,
        dst_pages: NDArray[np.int64],
        cached_tokens: int | None,
        span: tuple[int, int],
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The chunk's source units (placeholders: decode needs none) and its part of
        ``dst_pages``, as prefill's worker sliced them."""
        start, end = span
        placeholder = np.zeros(end - start, dtype=np.int64)  # source slots are not needed
        src_units, lo, hi = self.mapper.chunk_slice(
            num_pages, dst_pages, placeholder, start, end, cached_tokens
        )
        return src_units, dst_pages[lo:hi]


def _page_sides(
    mapper: IndexMapper, src: DescTable, dst: DescTable
) -> tuple[PageSide, PageSide] | None:
    """A link's page geometry in bytes (:func:`kvwire.page_form.page_sides`), or None where
    its chunks have no page form (page-size conversion, dummy senders, K and V as planes,
    head-major rows: the mapper says) or its geometry does not match its tables (a mapper's
    bug: logged, and the link's chunks are summed as rows, which stay correct). Either side,
    once per link, at handshake. A geometry of several pieces per token (head-major pages)
    is summed as rows too: a page side has one piece per token."""
    geometry = mapper.page_geometry
    if geometry is None or geometry.heads > 1:
        return None
    try:
        return page_sides(geometry, src, dst)
    except DescriptorError as exc:
        logger.warning(
            "checksums: the %s mapper's page form is not its tables' (%s); summing rows",
            mapper.name,
            exc,
        )
        return None


def _quietly(sum_once: Callable[[], object]) -> None:
    """A warm-up's sums, their result dropped; a chunk the mapper refuses is skipped."""
    try:
        sum_once()
    except KVWireError as exc:
        logger.debug("no checksum warm-up: %s", exc)
