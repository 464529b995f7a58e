"""The nixl backend's bookkeeping records: a peer, a prepared pair's NIXL lists, a transfer.

Created and changed only by :class:`~kvwire_nixl.backend.NixlBackend`, under the locks its
docstring and the comment below name.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kvwire.backend import XferState
from kvwire.layout import MemoryRegion


# Locks, in the order they may be taken: a transfer's ``XferRecord.lock``, then the backend's
# bookkeeping lock (``NixlBackend._state``), then (with sync_mode="none" only) the engine
# lock around one NIXL call. The bookkeeping lock is never held across a NIXL call.
@dataclass(eq=False)
class PeerRecord:
    name: str
    regions: list[MemoryRegion]
    #: Transfers posted to this peer whose NIXL handle is not freed yet.
    xfers: set[XferRecord] = field(default_factory=set)
    #: Submits to this peer between their first check and publishing (or freeing) the handle.
    busy: int = 0
    #: Set (under the bookkeeping lock) when the peer is removed or the agent closes.
    removed: bool = False


@dataclass(eq=False)
class PairRecord:
    """Backend state of a :class:`PreparedPair`: the two prepared NIXL descriptor lists."""

    peer: PeerRecord
    local: Any  # None once freed
    remote: Any
    local_mem: str
    remote_mem: str
    #: Submits inside ``make_prepped_xfer`` with these lists right now.
    users: int = 0
    released: bool = False


@dataclass(eq=False)
class XferRecord:
    """Backend state of a :class:`TransferHandle`.

    ``lock`` is held by whichever thread posts, checks or frees ``nixl`` (and only then):
    state changes happen under it, so the handle is freed exactly once and never in use.
    """

    peer: PeerRecord
    nixl: Any  # nixl_xfer_handle; None once freed
    deadline: float | None
    state: XferState = XferState.PENDING
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def finish(self, state: XferState, error: str | None = None) -> None:
        if self.state is XferState.PENDING:
            self.state = state
            self.error = error
