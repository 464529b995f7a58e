"""The state :class:`~kvwire.backends.multi.MultiBackend` keeps per link, per prepared pair
and per transfer (split from :mod:`kvwire.backends.multi`; its lock contract applies)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kvwire.backend import PreparedPair, TransferHandle, XferOp
from kvwire.descriptors import DescTable


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
    notification: bytes | None
    member: int = -1
    inner: TransferHandle | None = None
    tried: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
