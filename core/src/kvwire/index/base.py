"""The :class:`IndexMapper` seam.

A mapper is built by the *initiating* side (prefill for WRITE) once per peer, from the source
layout (where bytes come from) and the destination layout (where they go). It builds the pair of
descriptor tables the backend prepares once, and then turns each chunk's source and destination
page indices into index arrays into those tables: NumPy only, no per-descriptor Python loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel

from kvwire.backend import NoOptions
from kvwire.descriptors import IndexArray, check_indices
from kvwire.errors import DescriptorError, LayoutError
from kvwire.index.groups import GroupMapper
from kvwire.index.paging import PageConversion
from kvwire.index.planes import split_kv
from kvwire.index.tables import TablePair as TablePair  # re-exported: importers name it here
from kvwire.index.topology import Topology
from kvwire.layout import KVLayout, compatibility_problems
from kvwire.page_form import PageChunk, PageGeometry


def check_pages(pages: Any, num_slots: int, what: str) -> NDArray[np.int64]:
    """Coerce page indices to ``int64`` and check they address existing slots."""
    return check_indices(pages, num_slots, what, unit="page slots in the pool")


@dataclass(frozen=True)
class StagedSlice:
    """What a staging strategy gathers of each token row of a link (see
    :meth:`IndexMapper.staged_slice`): bytes ``[src_lo, src_lo + nbytes)`` of a source row go
    to bytes ``[dst_lo, dst_lo + nbytes)`` of the destination row. ``whole_rows``: the slice is
    the whole row on both sides (equal TP: pages move whole, staging only makes the
    descriptors larger)."""

    src_lo: int
    dst_lo: int
    nbytes: int
    whole_rows: bool


class IndexMapper(ABC):
    """Maps a (source layout, destination layout) pair to tables and chunks to index arrays."""

    name: ClassVar[str] = "abstract"
    options_model: ClassVar[type[BaseModel]] = NoOptions
    #: Model fields allowed to differ between the sides (e.g. ``page_size`` for a mapper that
    #: writes into a token-granular host pool).
    relaxed_fields: ClassVar[tuple[str, ...]] = ()
    #: Destination slots one source page fills (1 for KV pools; ``page_size / host page
    #: size`` for a mapper into a finer-grained host pool).
    units_per_page: int = 1
    #: Set (at construction) by a mapper that converts between different page sizes: chunks
    #: then move token ranges (:mod:`kvwire.index.paging`) through :meth:`_map_granules`.
    paging: PageConversion | None = None
    #: Who sends to whom for layouts this mapper serves (a mapper for another parallelism
    #: brings its own pairing rules; the session layer asks only the topology).
    topology: ClassVar[type[Topology]] = Topology
    #: The mapper's index arrays are *pair-major*: the same number of rows for every buffer
    #: pair, pairs in :attr:`src_buf` order (true of the core mappers). Declaring it lets
    #: :meth:`split_layers` cut chunks by layer; a mapper that does not is never cut (its
    #: layer-wise chunks move whole once every layer is computed).
    pair_major_rows: ClassVar[bool] = False

    def __init__(self, src: KVLayout, dst: KVLayout, options: BaseModel | None = None) -> None:
        problems = [
            p
            for p in compatibility_problems(src.model, dst.model)
            if p.split(":")[0] not in self.relaxed_fields
        ]
        if problems:
            hint = (
                f" (the {self.name} mapper does not convert page sizes; the core mappers do)"
                if any(p.startswith("page_size:") for p in problems)
                else ""
            )
            raise LayoutError(
                "source and destination layouts cannot work together: " + "; ".join(problems) + hint
            )
        #: One side keeps K and V side by side in its rows (``kv_fused``) and the other does
        #: not, or a side keeps K's and V's page in one slot (``kv_in_slot``): both are seen
        #: as K and V planes (:mod:`kvwire.index.planes`).
        self.splits_kv = src.kv_fused != dst.kv_fused or src.kv_in_slot or dst.kv_in_slot
        if self.splits_kv:
            src, dst = split_kv(src), split_kv(dst)
        #: A side's planes interleave K and V heads in each row (a fused side paired with an
        #: unfused one): heads move one by one; mappers that move longer runs refuse the pair.
        self.interleaved = src.elem_pitch != src.head_bytes or dst.elem_pitch != dst.head_bytes
        self.src = src
        self.dst = dst
        self.options = options if options is not None else self.options_model()
        self.src_buf, self.dst_buf = self._pair_buffers()

    def _pair_buffers(self) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Indices of source and destination buffers holding the same (layer, K/V)."""
        n = self.src.model.num_layers
        lookup = np.full(2 * n, -1, dtype=np.int64)
        dk = self.dst.buffer_keys
        lookup[dk[:, 0] * 2 + dk[:, 1]] = np.arange(len(dk))
        sk = self.src.buffer_keys
        dst = lookup[sk[:, 0] * 2 + sk[:, 1]]
        keep = dst >= 0  # none: pipeline stages with no layer in common (a dummy pair)
        return np.flatnonzero(keep).astype(np.int64), dst[keep]

    @property
    def num_pairs(self) -> int:
        """Buffer pairs (layer x K/V) moved per page."""
        return int(self.src_buf.size)

    @property
    def is_dummy(self) -> bool:
        """True when this source sends no KV to this destination: another source rank sends
        identical bytes (MLA, replicated heads; subclasses add those rules), or the two hold
        no layer in common (pipeline stages on both sides). It still reports completion."""
        return self.num_pairs == 0

    def staged_slice(self) -> StagedSlice | None:
        """Prefill (``link_tables``) and decode (``on_link``), at handshake: the part of each
        token row a staging strategy may gather into a contiguous block for this link, or None
        when the link moves by descriptors only. The default is None; a mapper whose chunks
        move the same byte range of every token row of every buffer pair overrides it. Never
        stageable: a dummy sender, K and V seen as planes (:attr:`splits_kv`):
        :meth:`_stageable` checks those. Different page sizes (:attr:`paging`) stage: the
        block is gathered in token order by granules and scattered into the other size."""
        return None

    def unstaged_reason(self) -> str:
        """Why :meth:`staged_slice` is None for this link, in words (logs, doctor)."""
        if self.is_dummy:
            return "a dummy sender (another prefill rank sends these bytes)"
        if self.splits_kv:
            return "K and V move as separate planes (kv_fused on one side, or kv_in_slot)"
        return f"the {self.name} mapper moves by descriptors only"

    def _stageable(self) -> bool:
        """The conditions every :meth:`staged_slice` override shares."""
        return not (self.is_dummy or self.splits_kv)

    def group_mapper(self) -> GroupMapper | None:
        """The mapper of the layouts' buffer groups (state, sliding window, draft layers), or
        None when neither side has groups. Prefill, handshake thread, once per decode rank.
        The default (:class:`~kvwire.index.groups.GroupMapper`) slices heads across TP like
        KV heads; a mapper for another parallelism may return its own."""
        if not self.src.groups and not self.dst.groups:
            return None
        return GroupMapper(self.src, self.dst)

    @abstractmethod
    def build_tables(self) -> TablePair:
        """Build both descriptor tables; called once per peer by the initiating side."""

    @abstractmethod
    def _map(
        self, src_pages: NDArray[np.int64], dst_pages: NDArray[np.int64]
    ) -> tuple[IndexArray, IndexArray]:
        """Index arrays for validated pages."""

    def _map_granules(
        self, src_granules: NDArray[np.int64], dst_granules: NDArray[np.int64]
    ) -> tuple[IndexArray, IndexArray]:
        """Index arrays moving source granule ``src_granules[i]`` into destination granule
        ``dst_granules[i]`` (see :mod:`kvwire.index.paging`); a mapper that sets
        :attr:`paging` implements it."""
        raise NotImplementedError(f"the {self.name} mapper does not convert page sizes")

    def map_chunk(self, src_pages: Any, dst_pages: Any) -> tuple[IndexArray, IndexArray]:
        """Index arrays into (src table, dst table) for a chunk; called per chunk by a
        transfer worker. ``src_pages[i]`` goes to ``dst_pages[i]``; with :attr:`paging` set
        (different page sizes), ``src_pages`` is the granule stream :meth:`chunk_slice`
        returned for ``dst_pages`` (:mod:`kvwire.index.paging`)."""
        if self.paging is not None:
            sg, dg = self.paging.stream_granules(
                src_pages, dst_pages, self.src.num_slots, self.dst.num_slots
            )
            if self.is_dummy or sg.size == 0:
                empty = np.empty(0, dtype=np.int64)
                return empty, empty
            return self._map_granules(sg, dg)
        sp = check_pages(src_pages, self.src.num_slots, "source page indices")
        dp = check_pages(dst_pages, self.dst.num_slots, "destination page indices")
        if sp.size != dp.size:
            raise DescriptorError(
                f"{sp.size} source pages but {dp.size} destination pages; pass equal counts"
            )
        if self.is_dummy or sp.size == 0:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        return self._map(sp, dp)

    def page_chunk(self, src_pages: Any, dst_pages: Any) -> PageChunk | None:
        """A transfer worker, per chunk (:meth:`ChunkPlan.direct
        <kvwire.staging.base.ChunkPlan.direct>`): the chunk in page form (pages checked as
        :meth:`map_chunk` checks them, rows never expanded), or None when this link's
        mapping is not regular (:attr:`page_geometry` is None: a dummy sender, K and V as
        planes, padded slots with page-size conversion, ...) or the chunk has no page: use
        :meth:`map_chunk` then. With :attr:`paging`, ``src_pages`` is the chunk's granule
        stream (as :meth:`map_chunk` takes it) and the chunk's pages are granules."""
        geometry = self.page_geometry
        if geometry is None:
            return None
        if self.paging is not None:  # granules are the pages (see _granule_geometry)
            sg, dg = self.paging.stream_granules(
                src_pages, dst_pages, self.src.num_slots, self.dst.num_slots
            )
            return PageChunk(geometry, sg, dg) if sg.size else None
        sp = check_pages(src_pages, self.src.num_slots, "source page indices")
        dp = check_pages(dst_pages, self.dst.num_slots, "destination page indices")
        if sp.size != dp.size:
            raise DescriptorError(
                f"{sp.size} source pages but {dp.size} destination pages; pass equal counts"
            )
        if not sp.size:
            return None
        same = (geometry.src_slots, geometry.dst_slots) == (self.src.num_slots, self.dst.num_slots)
        return PageChunk(geometry, sp, dp, checked=same)  # checked here: not again at submit

    @property
    def page_geometry(self) -> PageGeometry | None:
        """This link's :class:`~kvwire.page_form.PageGeometry` (computed once; any
        thread), or None when chunks must move as rows; with :attr:`paging` its "pages" are
        granules (:meth:`_granule_geometry`)."""
        if "_geometry" not in self.__dict__:
            found: PageGeometry | None = None
            if not (self.is_dummy or self.splits_kv):
                paged = self.paging is None
                found = self._page_geometry() if paged else self._granule_geometry()
            self.__dict__["_geometry"] = found
        geometry: PageGeometry | None = self.__dict__["_geometry"]
        return geometry

    def _page_geometry(self) -> PageGeometry | None:
        """The geometry of a mapper whose :meth:`_map` is regular (equal page sizes, no
        dummy, no planes: the base checked those), in its own tables' rows; None (the
        default) keeps rows. Its rows must equal :meth:`_map`'s (core/tests/test_page_form.py)."""
        return None

    def _granule_geometry(self) -> PageGeometry | None:
        """With :attr:`paging` (different page sizes): the geometry whose "pages" are
        granules (:mod:`kvwire.index.paging`: granule ``u`` of a side is its page ``u //
        per`` at granule ``u % per``), so that :meth:`page_chunk` gives the granule lists of
        :meth:`_map_granules` in page form; possible where a side's granules lie at one
        stride (:func:`granule_stride`). None (the default) keeps rows. Its rows must equal
        :meth:`_map_granules`' (core/tests/test_page_form.py)."""
        return None

    def split_layers(
        self, src_idx: IndexArray, dst_idx: IndexArray, edges: NDArray[np.int64]
    ) -> list[tuple[IndexArray, IndexArray]] | None:
        """Prefill, transfer worker, per layer-wise chunk (:mod:`kvwire.session.layers`): a
        chunk's index arrays (from :meth:`map_chunk`) cut into layer groups, group ``g``
        holding the rows of source layers ``[edges[g], edges[g+1])`` (model layer ids).

        The default cuts arrays of a mapper that declares :attr:`pair_major_rows`; it
        returns None otherwise (or when the sizes do not fit that order): the chunk then
        moves whole once every layer is computed (correct, without the overlap). A mapper
        with another row order may override it."""
        n = self.num_pairs
        if not self.pair_major_rows or n == 0 or src_idx.size != dst_idx.size or src_idx.size % n:
            return None
        layer = self.src.buffer_keys[self.src_buf, 0]  # model layer of each pair
        group = np.searchsorted(edges, layer, side="right") - 1
        s2, d2 = src_idx.reshape(n, -1), dst_idx.reshape(n, -1)
        return [(s2[group == g].ravel(), d2[group == g].ravel()) for g in range(edges.size - 1)]

    def chunk_slice(
        self,
        num_pages: int,
        dst_units: NDArray[np.int64],
        pages: NDArray[np.int64],
        start: int,
        end: int,
        cached_tokens: int | None = None,
    ) -> tuple[NDArray[np.int64], int, int]:
        """Prefill, engine thread, per chunk and destination: which of a chunk's source
        ``pages`` (request pages ``[start, end)`` of ``num_pages``) move, and the destination
        units ``dst_units[lo:hi]`` they go to, given the ``dst_units`` decode asked for.

        Default (KV pools): decode asks for the request's last ``len(dst_units)`` pages (a
        prefix may be cached there), one unit per page. A mapper with other unit rules (a
        finer-grained host pool) overrides it. With :attr:`paging` set (different page
        sizes), token ranges move and the returned source units are a granule stream
        (:meth:`PageConversion.chunk_stream <kvwire.index.paging.PageConversion.chunk_stream>`).
        ``cached_tokens`` is decode's word on its cached prefix (None when it gave none):
        required with different page sizes, where the counts alone cannot place the tokens.
        Raises :class:`DescriptorError` naming both counts when decode's count cannot fit the
        request."""
        if self.paging is not None:
            return self.paging.chunk_stream(num_pages, dst_units, pages, start, end, cached_tokens)
        skip = num_pages - dst_units.size
        if skip < 0:
            raise DescriptorError(
                f"decode asked for {dst_units.size} pages but the request has {num_pages}"
            )
        ps = self.src.model.page_size
        if cached_tokens is not None and cached_tokens != skip * ps:
            raise DescriptorError(
                f"decode says it keeps {cached_tokens} cached tokens but asks for the last "
                f"{dst_units.size} of {num_pages} pages of {ps} tokens ({skip * ps} cached)"
            )
        lo = max(start, skip)
        if end <= lo:
            return pages[:0], 0, 0
        return pages[lo - start :], lo - skip, end - skip


def default_mapper_name(src: KVLayout, dst: KVLayout) -> str:
    """The core mapper that fits a layout pair: ``mla``, ``equal_tp``, ``head_slice``, or
    ``head_rows`` when a side's pages are head-major and whole pages cannot move, or when one
    side keeps K and V side by side in its rows and the other does not."""
    name = core_mapper_name(src.model.is_mla, src.rank.tp_size, dst.rank.tp_size)
    if name == "mla":
        return name
    if src.kv_fused != dst.kv_fused:
        return "head_rows"
    if not (src.head_major or dst.head_major):
        return name
    same_pages = src.model.page_size == dst.model.page_size
    if name == "equal_tp" and src.head_major == dst.head_major and same_pages:
        return name  # the same page order and size on both sides: whole pages
    return "head_rows"


def core_mapper_name(is_mla: bool, tp_src: int, tp_dst: int) -> str:
    """The core mapper for a model kind and the two TP sizes (before any handshake)."""
    if is_mla:
        return "mla"
    return "equal_tp" if tp_src == tp_dst else "head_slice"


def granule_stride(layout: KVLayout, granule: int) -> int | None:
    """Bytes from one ``granule``-token granule of ``layout``'s pages to the next, granules
    numbered page-major (``page * per + k``, ``per`` granules a page), when that is one
    stride for the whole pool: the slot stride for one granule a page, else a granule's
    bytes where a slot is exactly its page's token rows. None otherwise (a padded slot)."""
    per = layout.model.page_size // granule
    if per == 1:
        return layout.slot_bytes
    unit = granule * layout.token_row_bytes
    return unit if layout.slot_bytes == per * unit else None
