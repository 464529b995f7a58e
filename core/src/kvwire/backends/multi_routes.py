"""The state :class:`~kvwire.backends.multi.MultiBackend` keeps per link, per prepared pair
and per transfer (split from :mod:`kvwire.backends.multi`; its lock contract applies)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvwire.backend import Note, PreparedPair, TransferBackend, TransferHandle, XferOp
from kvwire.descriptors import DescTable
from kvwire.page_form import PageChunk


@dataclass
class Route:
    """One peer's link: its members (indices into ``MultiBackend.members``, in order), the
    peer's name in each, the metadata it announced for each (to reconnect), and health."""

    peer: str
    order: list[int]
    names: dict[int, str]
    metadata: dict[int, bytes]
    healthy: dict[int, bool]
    host: dict[str, str] = field(default_factory=dict)
    next_probe: dict[int, float] = field(default_factory=dict)
    backoff: dict[int, float] = field(default_factory=dict)
    recovered_at: dict[int, float] = field(default_factory=dict)
    pairs: list[PreparedPair] = field(default_factory=list)


@dataclass(eq=False)
class Pair:
    """Backend state of a composite prepared pair: the inner pair per member, and the tables
    (to prepare again after a reconnection)."""

    route: Route
    inner: dict[int, PreparedPair]
    local: DescTable
    remote: DescTable


@dataclass(eq=False)
class Xfer:
    """Backend state of a composite handle: what to post again, and where it is now."""

    op: XferOp
    pair: Pair
    local_idx: Any
    remote_idx: Any
    notification: Note | None
    member: int = -1
    inner: TransferHandle | None = None
    tried: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: A chunk submitted in page form (``submit_pages``): posted so on a member that takes
    #: pages, as its rows on one that does not (``local_idx``/``remote_idx`` filled then).
    chunk: PageChunk | None = None
    #: The submitter's wake-up, handed to every member the transfer is posted on (a member
    #: that pushes events calls it; the composite handle's ``pushes`` follows the member).
    wake: Callable[[], None] | None = None

    def post_on(self, member: TransferBackend, inner: PreparedPair) -> TransferHandle:
        """Post this transfer on ``member`` (``inner``: its prepared pair of the link; the
        tables, so the rows and the chunk's geometry, are the same on every member)."""
        op, note, wake = self.op, self.notification, self.wake
        if self.chunk is not None and member.capabilities.page_writes:
            return member.submit_pages(op, inner, self.chunk, note, wake)
        if self.chunk is not None and self.local_idx is None:
            self.local_idx, self.remote_idx = self.chunk.rows()
        return member.submit(op, inner, self.local_idx, self.remote_idx, note, wake)


@contextlib.contextmanager
def members_batch(members: Sequence[TransferBackend]) -> Iterator[None]:
    """Every member's :meth:`~kvwire.backend.TransferBackend.post_batch` at once
    (:meth:`MultiBackend.post_batch <kvwire.backends.multi.MultiBackend.post_batch>`): a
    transfer held by the member it went to is posted when the block ends."""
    with contextlib.ExitStack() as stack:
        for m in members:
            stack.enter_context(m.post_batch())
        yield
