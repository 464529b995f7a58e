"""A chunk in *page form*: page lists and one geometry per link, instead of one row per run.

Where a link's mapping is regular -- equal page sizes, and either whole pages (equal TP, MLA
senders), the same byte slice of every token row (heterogeneous TP head slices) or one head
of every token at strides affine in token and head (head-major pages on a side) -- a
chunk's rows follow from a few numbers: for each buffer pair, the table row of piece 0 of
slot 0 on both sides, the rows (and bytes) from one slot to the next and from one piece to
the next, the bytes of a piece and how many pieces a page has. The mapper describes that
once per link (:class:`PageGeometry`, :meth:`kvwire.index.base.IndexMapper.page_chunk`);
a chunk is then the geometry and its two page lists (:class:`PageChunk`), never expanded.

A backend that declares :attr:`BackendCapabilities.page_writes
<kvwire.transfers.BackendCapabilities.page_writes>` takes a chunk so
(:meth:`kvwire.backend.TransferBackend.submit_pages`) and resolves the geometry's rows into
addresses through its prepared pair; every other consumer reads :meth:`PageChunk.rows`,
which are exactly the rows :meth:`~kvwire.index.base.IndexMapper.map_chunk` returns
(pair-major, then page, then piece). Cases the form cannot express (page-size conversion,
dummy senders, K and V as planes, groups) keep rows.

KV checksums read a chunk in page form too (:class:`PageSide`, :func:`page_sides`; a
geometry of pieces per head is summed as rows): each
side's rows are addresses computed from the side's per-pair base address and byte strides,
so prefill sums its source rows and decode its landed rows without expanding the chunk
(:meth:`kvwire.integrity.RowHasher.page_sums`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.descriptors import ADDR, LEN, DescTable, IndexArray, check_indices
from kvwire.errors import DescriptorError


@dataclass(frozen=True, eq=False)
class PageGeometry:
    """How every chunk of one link moves, page by page (built once per link by its mapper).

    Piece ``t`` of page ``p`` of buffer pair ``b`` is source table row
    ``src_rows[b] + p * src_page_rows + t * src_token_rows`` (and likewise on the
    destination); in bytes it lies at the address of row ``src_rows[b]`` plus
    ``p * src_slot + t * src_row``, and is ``n`` bytes long on both sides.

    With ``heads > 1`` a token's piece is ``heads`` pieces instead (head-major pages on a
    side: one head of one token is the longest run contiguous on both): piece ``(t, h)`` is
    row ``... + t * src_token_rows + h * src_head_rows`` at bytes ``... + t * src_row +
    h * src_head``, in the order ``t`` then ``h``."""

    src_rows: NDArray[np.int64]
    dst_rows: NDArray[np.int64]
    src_page_rows: int
    dst_page_rows: int
    src_token_rows: int
    dst_token_rows: int
    src_slot: int
    dst_slot: int
    src_row: int
    dst_row: int
    n: int
    tokens: int
    #: Page slots of each side's pool (page indices must be below them).
    src_slots: int
    dst_slots: int
    #: Pieces per token (1: a token's piece is one run on both sides).
    heads: int = 1
    src_head_rows: int = 0
    dst_head_rows: int = 0
    src_head: int = 0
    dst_head: int = 0

    @property
    def num_pairs(self) -> int:
        """Buffer pairs moved per page."""
        return int(self.src_rows.size)

    @property
    def pieces(self) -> int:
        """Pieces per page and buffer pair (tokens x heads)."""
        return self.tokens * self.heads


@dataclass(frozen=True, eq=False)
class PageChunk:
    """One chunk in page form: source page ``src_pages[i]`` goes to ``dst_pages[i]`` for
    every buffer pair of ``geometry`` (pages checked against the pools when built by
    :meth:`~kvwire.index.base.IndexMapper.page_chunk`, and again by ``submit_pages``)."""

    geometry: PageGeometry
    src_pages: NDArray[np.int64]
    dst_pages: NDArray[np.int64]
    #: The page lists are ``int64`` arrays of equal, nonzero length already checked against
    #: the geometry's slots (set by the mapper that built the chunk, which checked them):
    #: :func:`check_page_chunk` does not check them again.
    checked: bool = False

    @property
    def num_rows(self) -> int:
        """Rows the chunk stands for (pairs x pages x pieces)."""
        g = self.geometry
        return g.num_pairs * int(self.src_pages.size) * g.pieces

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes the chunk moves (computed once: a submit reads it several times)."""
        return self.num_rows * self.geometry.n

    def rows(self) -> tuple[IndexArray, IndexArray]:
        """The rows this chunk stands for, as ``map_chunk`` orders them (vectorised): for a
        consumer that needs rows (checksums, a backend without page writes, a split by
        memory kind, layer-wise cuts)."""
        g = self.geometry
        src = affine_pieces(
            g.src_rows, self.src_pages, g.src_page_rows, g.tokens, g.src_token_rows,
            g.heads, g.src_head_rows,
        )  # fmt: skip
        dst = affine_pieces(
            g.dst_rows, self.dst_pages, g.dst_page_rows, g.tokens, g.dst_token_rows,
            g.heads, g.dst_head_rows,
        )  # fmt: skip
        return src, dst


def affine_pieces(
    base: NDArray[np.int64],
    pages: NDArray[np.int64],
    page: int,
    tokens: int,
    token: int,
    heads: int,
    head: int,
) -> NDArray[np.int64]:
    """``base[b] + pages[i] * page + t * token + h * head`` for every (b, i, t, h), in that
    order, flattened (rows or addresses of a page geometry's pieces; vectorised)."""
    t = np.arange(tokens, dtype=np.int64)[:, None] * token
    if heads > 1:
        t = t + np.arange(heads, dtype=np.int64)[None, :] * head
    out: NDArray[np.int64] = (
        np.asarray(base, dtype=np.int64)[:, None, None]
        + np.asarray(pages, dtype=np.int64)[None, :, None] * page
        + t.ravel()[None, None, :]
    ).ravel()
    return out


def check_page_chunk(
    chunk: PageChunk,
    local_lens: NDArray[np.uint64],
    remote_lens: NDArray[np.uint64],
) -> int:
    """A page-form submit's checks (vectorised, cost independent of the chunk's rows): page
    indices 1-D integers inside both pools, equally many, at least one (unless the chunk's
    mapper checked them: :attr:`PageChunk.checked`); the geometry's rows
    of every buffer pair inside both tables (``local_lens``/``remote_lens``: the prepared
    pair's row lengths) for every slot and piece, and its slot-0 rows ``n`` bytes long on
    both sides (a mapper's table gives every row of a buffer one length).
    Returns the bytes moved; :class:`DescriptorError` naming the first problem. Called by
    :meth:`kvwire.backend.TransferBackend.submit_pages` on the submitting worker's thread."""
    g = chunk.geometry
    if not chunk.checked:
        sp = check_indices(chunk.src_pages, g.src_slots, "source page indices", unit="page slots")
        dp = check_indices(
            chunk.dst_pages, g.dst_slots, "destination page indices", unit="page slots"
        )
        if sp.size != dp.size:
            raise DescriptorError(f"{sp.size} source pages but {dp.size} destination pages")
        if sp.size == 0:
            raise DescriptorError("empty transfer: the page lists hold no page")
    seen = _CHECKED.get(g)
    if seen is not None and seen[0]() is local_lens and seen[1]() is remote_lens:
        return chunk.nbytes  # this link's geometry passed against these very tables
    _check_geometry(g, local_lens, remote_lens)
    _CHECKED[g] = (weakref.ref(local_lens), weakref.ref(remote_lens))
    return chunk.nbytes


#: Each link's geometry, once it passed against its prepared pair's row lengths (the arrays
#: themselves, held weakly: a pair prepared anew is checked anew). Both live as long as the
#: link, so a chunk checks only its page indices: on the GPU hosts the geometry's NumPy
#: checks were ~7% of a cudaipc worker's time at 16 MiB C=8 (session 21, py-spy).
_CHECKED: weakref.WeakKeyDictionary[PageGeometry, tuple[weakref.ref[Any], weakref.ref[Any]]] = (
    weakref.WeakKeyDictionary()
)


def _check_geometry(
    g: PageGeometry, local_lens: NDArray[np.uint64], remote_lens: NDArray[np.uint64]
) -> None:
    """The geometry part of :func:`check_page_chunk` (independent of the chunk's pages)."""
    if g.num_pairs == 0 or g.dst_rows.size != g.num_pairs or g.tokens < 1 or g.heads < 1 or g.n < 1:
        raise DescriptorError("page geometry holds no buffer pair, piece or byte")
    for side, rows, page_rows, tok_rows, head_rows, slots, lens in (
        ("local", g.src_rows, g.src_page_rows, g.src_token_rows, g.src_head_rows, g.src_slots,
         local_lens),
        ("remote", g.dst_rows, g.dst_page_rows, g.dst_token_rows, g.dst_head_rows, g.dst_slots,
         remote_lens),
    ):  # fmt: skip
        if min(page_rows, tok_rows, head_rows) < 0:
            raise DescriptorError(f"page geometry has a negative {side} row step")
        last = rows + (slots - 1) * page_rows + (g.tokens - 1) * tok_rows
        last = last + (g.heads - 1) * head_rows
        if int(rows.min()) < 0 or int(last.max()) >= lens.size:
            raise DescriptorError(
                f"page geometry reaches {side} table rows [{int(rows.min())}, "
                f"{int(last.max())}] but the table has {lens.size} rows"
            )
        bad = lens[rows] != np.uint64(g.n)
        if bad.any():
            b = int(np.argmax(bad))
            raise DescriptorError(
                f"page geometry moves {g.n}-byte pieces but {side} table row {int(rows[b])} "
                f"has {int(lens[rows[b]])} bytes"
            )


def check_geometry_addresses(
    geometry: PageGeometry, local_addr: NDArray[np.int64], remote_addr: NDArray[np.int64]
) -> None:
    """A page-writing backend, once per (prepared pair, geometry) before its first page
    write: the geometry's byte strides are its tables' own (``local_addr``/``remote_addr``:
    the prepared tables' row addresses), checked for every buffer pair at the next slot, the
    next piece and the last piece of the last slot, so a kernel that computes addresses from
    the geometry writes exactly the rows :meth:`PageChunk.rows` names (rows that
    :func:`check_page_chunk` found inside the tables). :class:`DescriptorError` otherwise.
    Vectorised; the cost is per pair, not per chunk."""
    g = geometry
    for side, addr, rows, page_rows, tok_rows, head_rows, slot, row, head, slots in (
        ("local", local_addr, g.src_rows, g.src_page_rows, g.src_token_rows, g.src_head_rows,
         g.src_slot, g.src_row, g.src_head, g.src_slots),
        ("remote", remote_addr, g.dst_rows, g.dst_page_rows, g.dst_token_rows, g.dst_head_rows,
         g.dst_slot, g.dst_row, g.dst_head, g.dst_slots),
    ):  # fmt: skip
        steps = [((slots - 1) * page_rows + (g.tokens - 1) * tok_rows + (g.heads - 1) * head_rows,
                  (slots - 1) * slot + (g.tokens - 1) * row + (g.heads - 1) * head)]  # fmt: skip
        if slots > 1:
            steps.append((page_rows, slot))
        if g.tokens > 1:
            steps.append((tok_rows, row))
        if g.heads > 1:
            steps.append((head_rows, head))
        if int(rows.min()) < 0 or int(rows.max()) + max(d for d, _ in steps) >= addr.size:
            raise DescriptorError(f"page geometry reaches past the {side} table's rows")
        base = addr[rows]
        for drow, dbytes in steps:
            bad = addr[rows + drow] - base != dbytes
            if bad.any():
                b = int(np.argmax(bad))
                raise DescriptorError(
                    f"page geometry puts {side} table row {int(rows[b] + drow)} {dbytes} bytes "
                    f"after row {int(rows[b])}, the table "
                    f"{int(addr[rows[b] + drow] - base[b])}: not this pair's tables"
                )


@dataclass(frozen=True, eq=False)
class PageSide:
    """One side of a link's page geometry in bytes (built once per link and side by
    :func:`page_sides`): piece ``t`` of page ``p`` of buffer pair ``b`` lies at
    ``base[b] + p * slot + t * row`` and is ``n`` bytes long; page indices are below
    ``slots``. Read, never changed, by any thread."""

    base: NDArray[np.uint64]
    slot: int
    row: int
    n: int
    tokens: int
    slots: int

    @property
    def num_pairs(self) -> int:
        """Buffer pairs of the geometry."""
        return int(self.base.size)

    def addresses(
        self, pages: NDArray[np.int64], pairs: NDArray[np.int64] | None = None
    ) -> NDArray[np.uint64]:
        """The rows' addresses for ``pages`` (of buffer pairs ``pairs``, default all), in
        :meth:`PageChunk.rows` order (pair-major, then page, then piece); vectorised."""
        base = self.base if pairs is None else self.base[pairs]
        t = np.arange(self.tokens, dtype=np.int64)[None, None, :] * self.row
        p = np.asarray(pages, dtype=np.int64)[None, :, None] * self.slot
        out: NDArray[np.uint64] = (
            (base.view(np.int64)[:, None, None] + p + t).ravel().view(np.uint64)
        )
        return out

    def corners(self) -> NDArray[np.uint64]:
        """``[4, pairs]``: the addresses of the first and last piece of the first and last
        page slot of every pair (the extremes of its rows, the addresses being affine in page
        and piece): every row of a pair lies in one buffer when these do."""
        last_p, last_t = (self.slots - 1) * self.slot, (self.tokens - 1) * self.row
        base = self.base.view(np.int64)
        out: NDArray[np.uint64] = np.stack(
            [base, base + last_t, base + last_p, base + last_p + last_t]
        ).view(np.uint64)
        return out


def page_sides(geometry: PageGeometry, src: DescTable, dst: DescTable) -> tuple[PageSide, PageSide]:
    """A link's page geometry as byte addresses on both sides (``src``/``dst``: the mapper's
    own descriptor tables, whose rows the geometry names), for sums computed from a chunk's
    page form. Checks the geometry's byte strides against the tables
    (:func:`check_geometry_addresses`: :class:`DescriptorError` otherwise), so its addresses
    are exactly those of :meth:`PageChunk.rows`'s table rows. Called once per link by
    :class:`kvwire.session.checksums.SentSums` (prefill) and ``LandedSums`` (decode)."""
    g = geometry
    if g.heads > 1:
        raise DescriptorError("a page side has one piece per token: this geometry has heads")
    one = np.zeros(1, dtype=np.int64)
    check_page_chunk(PageChunk(g, one, one), src[:, LEN], dst[:, LEN])  # rows in the tables
    src_addr = src[:, ADDR].astype(np.int64)
    dst_addr = dst[:, ADDR].astype(np.int64)
    check_geometry_addresses(g, src_addr, dst_addr)
    return (
        PageSide(
            np.ascontiguousarray(src[g.src_rows, ADDR]),
            g.src_slot,
            g.src_row,
            g.n,
            g.tokens,
            g.src_slots,
        ),
        PageSide(
            np.ascontiguousarray(dst[g.dst_rows, ADDR]),
            g.dst_slot,
            g.dst_row,
            g.n,
            g.tokens,
            g.dst_slots,
        ),
    )
