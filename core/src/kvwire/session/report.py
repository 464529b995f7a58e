"""What a failed request still holds on one decode rank: :class:`FailureReport`.

When part of a request's KV cannot arrive (a prefill rank died mid-request, a chunk failed
its checksum, a link broke, the waiting timeout fired), the engine can keep what landed and
recompute only the rest. ``KVReceiver.failure_report()`` (engine thread, once ``poll()`` says
``Failed``) returns this rank's report; the engine merges its ranks' reports (a page is good
for the request only if it is good on every rank).

How a page is judged (conservative: "good" is proven, "missing" is the default):

* The progress thread records, per sender (prefill rank), the request's token range each
  *complete* chunk wrote: every part of it arrived, staged blocks were placed and, when
  checksums are on, the chunk's sums matched (:class:`LandedChunks`). A chunk that failed
  its checksum, or of which only some parts (layer groups, segments) arrived, counts for
  nothing. A sender that completed (every chunk it announced landed) covers the whole request.
* A destination page is good when every token it holds (clipped to the request's length)
  lies in a landed range of *every* source rank that writes to this rank (heterogeneous TP:
  each source writes its heads; PP: each writes its layers). Dummy sources (which write
  nothing here) do not count.
* Chunk notes carry the chunk's page span, the request's page count and prefill's page size
  (protocol 1.7 peers send them on every KV note); a sender whose notes lack them (an older
  kvwire) proves nothing: every page it writes to stays missing.
* Only the KV pool is judged: a request sent to an extra pool (``pool=name``) reports every
  page missing, and so does a request failed for a protocol violation (an aux row written by
  the wrong sender or stamped for another room, more chunks than announced, a staging error):
  the notes of a peer that broke the protocol prove nothing.
* Buffer groups (state, window, draft) and the aux row are reported as landed or not
  (``groups_landed``, ``aux_landed``); an engine whose model needs its state groups must
  recompute the whole request when ``groups_landed`` is False.

Lock contract: :class:`LandedChunks` is part of a room's state (``RecvRoom.landed``), updated
under the room lock by the progress thread; :func:`build_report` runs under that lock
(engine thread) and returns an immutable report.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import NDArray

#: Why a request failed on this rank, as far as recovery cares.
FailureCause = Literal[
    "sender_lost",  # a prefill rank died or left (heartbeats, goodbye)
    "checksum_mismatch",  # a chunk's bytes differ from what prefill summed
    "prefill_failed",  # prefill reported a failure (a broken link, a refused post, bad input)
    "prefill_aborted",  # prefill aborted the request
    "timeout",  # the waiting timeout (no progress)
    "aborted",  # this side aborted it
    "bad_input",  # send_metadata() refused the engine's input
    "bootstrap",  # lookup or handshake failed: nothing was asked for
    "closed",  # the manager closed
    "protocol",  # a peer broke the protocol (aux row, chunk counts, staging)
]

_Ranges = list[tuple[int, int]]


@dataclass(frozen=True)
class ChunkFault:
    """The chunk a checksum mismatch names."""

    peer: str
    sender_id: int
    chunk_id: int
    #: Request pages (prefill's pages) ``[start, end)`` of the chunk.
    pages: tuple[int, int]
    #: The layers whose sums differ, as ranges ("1, 3-5").
    layers: str


@dataclass
class LandedChunks:
    """Per sender, the request token ranges its complete chunks wrote (progress thread,
    under the room lock)."""

    #: sender id -> token ranges ``[a, b)`` (request token positions), unmerged.
    ranges: dict[int, _Ranges] = field(default_factory=dict)
    #: The request's length bound in tokens (prefill pages x prefill page size), once a note
    #: said it.
    bound: int | None = None
    #: The request's page count on prefill (for the cached prefix when decode gave none).
    num_pages: int | None = None
    src_page: int | None = None

    def add(
        self, sender_id: int, span: tuple[int, int] | None, num_pages: int | None, page: int | None
    ) -> None:
        """A complete chunk of ``sender_id`` covering request pages ``span`` of ``num_pages``
        (prefill pages of ``page`` tokens); a note without them adds nothing."""
        if span is None or num_pages is None or page is None or page < 1:
            return
        self.bound, self.num_pages, self.src_page = num_pages * page, num_pages, page
        a, b = span[0] * page, min(span[1], num_pages) * page
        if b > a:
            self.ranges.setdefault(sender_id, []).append((a, b))


def merge(ranges: Iterable[tuple[int, int]]) -> _Ranges:
    """Sorted, disjoint, non-adjacent ranges covering the same tokens."""
    out: _Ranges = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(x: Sequence[tuple[int, int]], y: Sequence[tuple[int, int]]) -> _Ranges:
    """Tokens in both merged range lists."""
    out: _Ranges = []
    i = j = 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True)
class FailureReport:
    """Which of a failed request's pages on this decode rank are known good, and which
    must be recomputed. Built by ``KVReceiver.failure_report()`` (engine thread, after
    ``poll()`` returned ``Failed``); immutable.

    Page positions index the ``dst_page_indices`` given to ``send_metadata`` (0 = the first
    page sent, which holds the tokens right after the cached prefix); ``missing_slots`` are
    the pool slots of the missing pages. Token positions count from the prompt's first token.
    """

    room: int
    cause: FailureCause
    reason: str
    #: The destination slots the engine gave (``send_metadata``), in order.
    slots: NDArray[np.int64]
    #: Positions (into ``slots``) of the pages known good, ascending.
    good_pages: NDArray[np.int64]
    #: Tokens per destination page (this rank's pool page size).
    page_size: int
    #: Prompt tokens before ``slots[0]`` (the cached prefix on this rank).
    first_token: int
    #: Token ranges ``[a, b)`` of the prompt that landed from every source (merged).
    good_tokens: tuple[tuple[int, int], ...]
    aux_landed: bool
    #: Every source's buffer groups landed (True when the layout has none).
    groups_landed: bool
    #: The prefill agent named by the failure (lost peer, or the chunk's sender), if one is.
    peer: str | None = None
    #: The chunk a checksum mismatch names.
    chunk: ChunkFault | None = None

    @property
    def missing_pages(self) -> NDArray[np.int64]:
        """Positions (into ``slots``) of the pages to recompute, ascending."""
        return np.setdiff1d(np.arange(self.slots.size, dtype=np.int64), self.good_pages)

    @property
    def missing_slots(self) -> NDArray[np.int64]:
        """Pool slots of the pages to recompute."""
        return self.slots[self.missing_pages]

    @property
    def good_prefix_pages(self) -> int:
        """How many leading pages are good (an engine that recomputes from the first
        missing page on keeps these)."""
        missing = self.missing_pages
        return int(missing[0]) if missing.size else int(self.slots.size)

    @property
    def good_prefix_tokens(self) -> int:
        """Prompt tokens known good from the first (the cached prefix included)."""
        return self.first_token + self.good_prefix_pages * self.page_size

    def summary(self) -> str:
        """One line for logs and error messages (the reason is :attr:`reason`): cause, good
        and missing pages."""
        n, good = int(self.slots.size), int(self.good_pages.size)
        return (
            f"{self.cause}; {good} of {n} pages landed (good prefix {self.good_prefix_pages}), "
            f"{n - good} to recompute; aux {'landed' if self.aux_landed else 'missing'}"
        )


@dataclass(frozen=True)
class SourceState:
    """What one source rank of the room delivered (built by the decode side)."""

    sender_id: int
    dummy: bool
    complete: bool
    groups_landed: bool


def good_page_mask(
    landed: LandedChunks,
    sources: Sequence[SourceState],
    num_slots: int,
    page_size: int,
    cached_tokens: int | None,
) -> tuple[NDArray[np.bool_], int, _Ranges]:
    """Which of ``num_slots`` destination pages every writing source covered; also the
    first token of page 0 and the token ranges covered. Pure (see the module docstring)."""
    writers = [s for s in sources if not s.dummy]
    if all(s.complete for s in writers):  # nothing of this rank's KV is missing
        first = cached_tokens if cached_tokens is not None else 0
        if cached_tokens is None and landed.num_pages is not None and landed.src_page:
            first = max(landed.num_pages * landed.src_page - num_slots * page_size, 0)
        end = first + num_slots * page_size
        return np.ones(num_slots, dtype=bool), first, [(0, end)]
    bound = landed.bound
    if bound is None:  # no chunk said where it goes: nothing is proven
        return np.zeros(num_slots, dtype=bool), cached_tokens or 0, []
    # without cached_tokens the page sizes are equal: decode asked for the last num_slots pages
    first = cached_tokens if cached_tokens is not None else max(bound - num_slots * page_size, 0)
    good: _Ranges | None = None
    for s in writers:
        mine = [(0, bound)] if s.complete else merge(landed.ranges.get(s.sender_id, []))
        good = mine if good is None else intersect(good, mine)
    covered = good or []
    starts = first + np.arange(num_slots, dtype=np.int64) * page_size
    ends = np.minimum(starts + page_size, bound)
    mask = np.zeros(num_slots, dtype=bool)
    for a, b in covered:  # a page is good when one covered range holds all its tokens
        mask |= (starts >= a) & (ends <= b) & (ends > starts)
    return mask, first, covered


def build_report(
    room: int,
    cause: FailureCause,
    reason: str,
    slots: NDArray[np.int64] | None,
    landed: LandedChunks,
    sources: Sequence[SourceState],
    page_size: int,
    cached_tokens: int | None,
    aux_landed: bool,
    judged: bool,
    peer: str | None = None,
    chunk: ChunkFault | None = None,
) -> FailureReport:
    """The report of a failed room (decode side, under the room lock). ``judged`` False
    (a request into an extra pool), or a peer that broke the protocol (its notes are not trusted),
    reports every page missing."""
    dst = np.zeros(0, dtype=np.int64) if slots is None else np.asarray(slots, dtype=np.int64)
    if judged and sources and cause != "protocol":
        mask, first, covered = good_page_mask(
            landed, sources, int(dst.size), page_size, cached_tokens
        )
    else:
        mask, first, covered = np.zeros(dst.size, dtype=bool), cached_tokens or 0, []
    return FailureReport(
        room=room,
        cause=cause,
        reason=reason,
        slots=dst.copy(),
        good_pages=np.flatnonzero(mask).astype(np.int64),
        page_size=page_size,
        first_token=first,
        good_tokens=tuple(covered),
        aux_landed=aux_landed,
        groups_landed=all(s.groups_landed for s in sources) if sources else False,
        peer=peer,
        chunk=chunk,
    )
