"""Page-size conversion: moving token ranges when prefill and decode pages differ.

Prefill pages hold ``pp`` tokens, decode pages ``pd`` (any two sizes >= 1; ``pd = 1`` is token
granularity). When they differ, a core mapper (``equal_tp``, ``mla``, ``head_slice``) maps
*tokens*, not pages. Everything here is pure index arithmetic, shared by those mappers (and by
any mapper that sets :attr:`PageConversion.granule` to its own row granule); the session layer
does not know about it.

The mapping rule, in request token positions:

* prefill page ``i`` of the request (``pages[i]``) holds tokens ``[i*pp, (i+1)*pp)``;
* decode keeps a prefix of ``c`` tokens (possibly 0) and asks for ``m`` pages; its page ``j``
  (``dst_units[j]``) holds tokens ``[c + j*pd, c + (j+1)*pd)``;
* tokens ``[c, min(n*pp, c + m*pd))`` move (``n`` = the request's prefill pages). Token
  positions past the end of the prompt inside a last, partial page are moved too (as with equal
  pages, where the whole last page moves); they are overwritten by decode before being read.

Decode says how many prompt tokens it keeps cached (``send_metadata(..., cached_tokens=c)``,
``TransferRequest.cached_tokens``): the page counts alone cannot place the tokens (a prefix
that is not a multiple of both page sizes would look like a shorter prompt), so a converting
link refuses a request without it, naming the option, and checks the value against both page
counts and the granule (:meth:`PageConversion.prefix_of`).

Chunked prefill: a chunk is request pages ``[start, end)``, so tokens ``[start*pp, end*pp)``.
It moves its tokens that fall in the moved range, into the decode pages ``dst_units[lo:hi]``
that hold them. When a chunk boundary falls inside a decode page (``pd`` does not divide the
boundary), that decode page is filled by two (or more) chunks, each writing its own tokens:
the writes are byte-disjoint and every token is written exactly once.

Because the session passes a chunk to :meth:`IndexMapper.map_chunk
<kvwire.index.base.IndexMapper.map_chunk>` as ``(source units, dst_units[lo:hi])``, a
converting mapper's source units are a *granule stream*: one entry per ``g``-token granule of
the destination pages ``dst_units[lo:hi]`` in order, holding the source granule id
(``page * (pp/g) + k``) that fills it, or ``-1`` where this chunk does not write (the head of a
decode page the previous chunk filled). ``g`` (:attr:`PageConversion.granule`) divides both page
sizes: ``gcd(pp, pd)`` for whole token rows, 1 for per-token head slices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kvwire.descriptors import check_indices
from kvwire.errors import DescriptorError, LayoutError

__all__ = ["PageConversion"]


@dataclass(frozen=True)
class PageConversion:
    """Token-range mapping between prefill pages of ``src_page`` tokens and decode pages of
    ``dst_page`` tokens, in granules of ``granule`` tokens (table rows). Built by a mapper at
    handshake (prefill, handshake thread); its methods run per chunk on the prefill engine
    thread (:meth:`chunk_stream`) and on transfer workers (:meth:`stream_granules`)."""

    src_page: int
    dst_page: int
    granule: int

    def __post_init__(self) -> None:
        if self.src_page < 1 or self.dst_page < 1:
            raise LayoutError(
                f"page sizes must be >= 1 (prefill {self.src_page}, decode {self.dst_page})"
            )
        if self.granule < 1 or math.gcd(self.src_page, self.dst_page) % self.granule:
            raise LayoutError(
                f"granule {self.granule} must divide both page sizes (prefill {self.src_page}, "
                f"decode {self.dst_page})"
            )

    @property
    def lcm(self) -> int:
        """Tokens of the shortest span made of whole pages on both sides."""
        return math.lcm(self.src_page, self.dst_page)

    @property
    def src_granules(self) -> int:
        """Granules per prefill page."""
        return self.src_page // self.granule

    @property
    def dst_granules(self) -> int:
        """Granules per decode page."""
        return self.dst_page // self.granule

    def _fits(self, n: int, m: int, c: int) -> bool:
        """Some prompt of ``n`` prefill pages leaves ``m`` decode pages after a ``c`` prefix."""
        pp, pd = self.src_page, self.dst_page
        return max((n - 1) * pp, c + (m - 1) * pd) < min(n * pp, c + m * pd)

    def prefix_of(self, num_pages: int, num_dst: int, cached_tokens: int | None) -> int:
        """Prefill: decode's cached prefix ``c``, as decode declared it, checked: it must fit
        both page counts and fall on a granule. Without a declaration, refused (a prefix
        that is not a multiple of both page sizes would be placed wrong, silently)."""
        pp, pd, n, m = self.src_page, self.dst_page, num_pages, num_dst
        if cached_tokens is None:
            raise DescriptorError(
                f"prefill pages hold {pp} tokens and decode pages {pd}: decode must say how "
                "many prompt tokens it keeps cached, send_metadata(..., cached_tokens=N) "
                "(0 when none), or the tokens cannot be placed"
            )
        c = cached_tokens
        if c % self.granule:
            raise DescriptorError(
                f"decode keeps {c} cached tokens, not a multiple of {self.granule} (the common "
                f"granule of pages of {pp} and {pd} tokens this mapper moves)"
            )
        if not self._fits(n, m, c):
            raise DescriptorError(
                f"decode keeps {c} cached tokens and asks for {m} pages of {pd} tokens, which "
                f"no prompt of {n} prefill pages of {pp} tokens fits"
            )
        return c

    def chunk_stream(
        self,
        num_pages: int,
        dst_units: NDArray[np.int64],
        pages: NDArray[np.int64],
        start: int,
        end: int,
        cached_tokens: int | None = None,
    ) -> tuple[NDArray[np.int64], int, int]:
        """Prefill, engine thread, per chunk and destination: the granule stream of a chunk
        (request pages ``[start, end)`` in slots ``pages``) and the range ``[lo, hi)`` of
        ``dst_units`` it writes (see the module docstring). ``cached_tokens`` is decode's
        cached prefix ``c``: required (the page counts alone cannot place the tokens), and
        checked against the counts and the granule."""
        pp, pd, g = self.src_page, self.dst_page, self.granule
        m = int(dst_units.size)
        # Checked before anything else, also when decode asks for no page at all: a decode
        # keeping too short a prefix in zero pages must be refused, not "complete" with no KV.
        c = self.prefix_of(num_pages, m, cached_tokens)
        if m == 0:
            return pages[:0], 0, 0
        s = max(start * pp, c)
        e = min(end * pp, num_pages * pp, c + m * pd)
        if e <= s:
            return pages[:0], 0, 0
        lo, hi = (s - c) // pd, -(-(e - c) // pd)
        lead = (s - c - lo * pd) // g
        toks = np.arange(s, e, g, dtype=np.int64)
        gid = pages[toks // pp - start] * self.src_granules + (toks % pp) // g
        stream = np.concatenate([np.full(lead, -1, dtype=np.int64), gid])
        return stream, lo, hi

    def stream_granules(
        self, stream: object, dst_pages: object, src_slots: int, dst_slots: int
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Transfer worker, per chunk: (source granule ids, destination granule ids) of a
        granule ``stream`` from :meth:`chunk_stream` into ``dst_pages``; checked, NumPy only."""
        # -1 marks a granule this chunk does not write: check the shifted stream
        sg = (
            check_indices(
                np.asarray(stream) + 1,
                src_slots * self.src_granules + 1,
                "source granule stream (+1)",
                unit="granules + 1",
            )
            - 1
        )
        dp = check_indices(dst_pages, dst_slots, "destination page indices", unit="page slots")
        r = self.dst_granules
        if not (dp.size - 1) * r < sg.size <= dp.size * r and (sg.size or dp.size):
            raise DescriptorError(
                f"a stream of {sg.size} granules of {self.granule} tokens does not fill "
                f"{dp.size} decode pages of {self.dst_page} tokens (it must end in the last)"
            )
        dg = (dp[:, None] * r + np.arange(r, dtype=np.int64)[None, :]).ravel()[: sg.size]
        keep = sg >= 0
        return sg[keep], dg[keep]
