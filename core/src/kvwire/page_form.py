"""A chunk in *page form*: page lists and one geometry per link, instead of one row per run.

Where a link's mapping is regular -- equal page sizes, and either whole pages (equal TP, MLA
senders) or the same byte slice of every token row (heterogeneous TP head slices) -- a
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
dummy senders, K and V as planes, head-major rows, groups) keep rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kvwire.descriptors import IndexArray, check_indices
from kvwire.errors import DescriptorError


@dataclass(frozen=True, eq=False)
class PageGeometry:
    """How every chunk of one link moves, page by page (built once per link by its mapper).

    Piece ``t`` of page ``p`` of buffer pair ``b`` is source table row
    ``src_rows[b] + p * src_page_rows + t * src_token_rows`` (and likewise on the
    destination); in bytes it lies at the address of row ``src_rows[b]`` plus
    ``p * src_slot + t * src_row``, and is ``n`` bytes long on both sides."""

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

    @property
    def num_pairs(self) -> int:
        """Buffer pairs moved per page."""
        return int(self.src_rows.size)


@dataclass(frozen=True, eq=False)
class PageChunk:
    """One chunk in page form: source page ``src_pages[i]`` goes to ``dst_pages[i]`` for
    every buffer pair of ``geometry`` (pages checked against the pools when built by
    :meth:`~kvwire.index.base.IndexMapper.page_chunk`, and again by ``submit_pages``)."""

    geometry: PageGeometry
    src_pages: NDArray[np.int64]
    dst_pages: NDArray[np.int64]

    @property
    def num_rows(self) -> int:
        """Rows the chunk stands for (pairs x pages x pieces)."""
        g = self.geometry
        return g.num_pairs * int(self.src_pages.size) * g.tokens

    @property
    def nbytes(self) -> int:
        """Bytes the chunk moves."""
        return self.num_rows * self.geometry.n

    def rows(self) -> tuple[IndexArray, IndexArray]:
        """The rows this chunk stands for, as ``map_chunk`` orders them (vectorised): for a
        consumer that needs rows (checksums, a backend without page writes, a split by
        memory kind, layer-wise cuts)."""
        g = self.geometry
        t = np.arange(g.tokens, dtype=np.int64)[None, None, :]
        src = (
            g.src_rows[:, None, None]
            + self.src_pages[None, :, None] * g.src_page_rows
            + t * g.src_token_rows
        ).ravel()
        dst = (
            g.dst_rows[:, None, None]
            + self.dst_pages[None, :, None] * g.dst_page_rows
            + t * g.dst_token_rows
        ).ravel()
        return src, dst


def check_page_chunk(
    chunk: PageChunk,
    local_lens: NDArray[np.uint64],
    remote_lens: NDArray[np.uint64],
) -> int:
    """A page-form submit's checks (vectorised, cost independent of the chunk's rows): page
    indices 1-D integers inside both pools, equally many, at least one; the geometry's rows
    of every buffer pair inside both tables (``local_lens``/``remote_lens``: the prepared
    pair's row lengths) for every slot and piece, and its slot-0 rows ``n`` bytes long on
    both sides (a mapper's table gives every row of a buffer one length).
    Returns the bytes moved; :class:`DescriptorError` naming the first problem. Called by
    :meth:`kvwire.backend.TransferBackend.submit_pages` on the submitting worker's thread."""
    g = chunk.geometry
    sp = check_indices(chunk.src_pages, g.src_slots, "source page indices", unit="page slots")
    dp = check_indices(chunk.dst_pages, g.dst_slots, "destination page indices", unit="page slots")
    if sp.size != dp.size:
        raise DescriptorError(f"{sp.size} source pages but {dp.size} destination pages")
    if sp.size == 0:
        raise DescriptorError("empty transfer: the page lists hold no page")
    if g.num_pairs == 0 or g.dst_rows.size != g.num_pairs or g.tokens < 1 or g.n < 1:
        raise DescriptorError("page geometry holds no buffer pair, piece or byte")
    for side, rows, page_rows, tok_rows, slots, lens in (
        ("local", g.src_rows, g.src_page_rows, g.src_token_rows, g.src_slots, local_lens),
        ("remote", g.dst_rows, g.dst_page_rows, g.dst_token_rows, g.dst_slots, remote_lens),
    ):
        last = rows + (slots - 1) * page_rows + (g.tokens - 1) * tok_rows
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
    return chunk.nbytes


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
    for side, addr, rows, page_rows, tok_rows, slot, row, slots in (
        ("local", local_addr, g.src_rows, g.src_page_rows, g.src_token_rows, g.src_slot,
         g.src_row, g.src_slots),
        ("remote", remote_addr, g.dst_rows, g.dst_page_rows, g.dst_token_rows, g.dst_slot,
         g.dst_row, g.dst_slots),
    ):  # fmt: skip
        steps = [((slots - 1) * page_rows + (g.tokens - 1) * tok_rows,
                  (slots - 1) * slot + (g.tokens - 1) * row)]  # fmt: skip
        if slots > 1:
            steps.append((page_rows, slot))
        if g.tokens > 1:
            steps.append((tok_rows, row))
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
