"""The ``cudaipc`` backend's state records: what it opened of a peer, a prepared table pair,
and one transfer. Owned by :class:`~kvwire_cudaipc.backend.CudaIpcBackend` (its control path
builds peers and pairs; its submit path builds transfers, which its kernel watcher and polls
finish); the locks they carry are described on each."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.backend import Note
from kvwire.backends.tcp.outbound import OutboundTransfer
from kvwire.page_form import PageGeometry, check_geometry_addresses
from kvwire_cudaipc.meta import PeerInfo

#: Rows moved over the side channel after a launch: local addresses, remote addresses, lengths.
Follow = tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64]]


def one_row(local_addr: int, remote_addr: int, nbytes: int) -> Follow:
    """A follow-up of one row (the control path, once per prepared pair: its note-only one)."""
    local, remote, n = (np.array([v], dtype=np.uint64) for v in (local_addr, remote_addr, nbytes))
    return local, remote, n


@dataclass(eq=False)
class IpcPeer:
    """What this side opened of one peer (owned by the control path)."""

    info: PeerInfo
    #: Per remote region (in ``info.regions`` order): address delta to this process's mapping
    #: (VRAM regions), or None (host regions, which travel over the side channel).
    delta: list[int | None]
    opened: list[tuple[bytes, int]]
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    pending: weakref.WeakSet[IpcXfer] = field(default_factory=weakref.WeakSet)


@contextlib.contextmanager
def locked(peers: Iterable[IpcPeer]) -> Iterator[None]:
    """Every one of ``peers``' locks (each once), taken in one order (by identity), so two
    threads launching into overlapping peers never wait on each other crosswise; released
    when the block ends. A launch path, around its enqueue."""
    with contextlib.ExitStack() as stack:
        for _, peer in sorted({id(p): p for p in peers}.items()):
            stack.enter_context(peer.lock)
        yield


@dataclass(eq=False)
class IpcPair:
    """Prepared state: per-row addresses and kinds of both tables."""

    peer: IpcPeer
    local_addr: NDArray[np.uint64]
    remote_addr: NDArray[np.uint64]
    local_vram: NDArray[np.bool_]
    remote_vram: NDArray[np.bool_]
    #: Remote VRAM rows translated into this process's mapping (0 for host rows).
    remote_mapped: NDArray[np.int64]
    #: Local addresses and row lengths as the mover takes them (int64).
    local_i64: NDArray[np.int64]
    lens_i64: NDArray[np.int64]
    #: Every row of both tables is VRAM (a KV pool pair): a submit gathers three arrays and
    #: launches, with no per-row kind checks or masks.
    all_vram: bool
    #: The follow-up of a write without host rows (its note alone, or the scratch word):
    #: this side's scratch address, the peer's, the length (built at prepare, never changed).
    note_follow: Follow
    #: Page geometries already checked against these tables (``check_geometry_addresses``),
    #: each with its buffer pairs' two addresses as the page mover takes them (gathered once).
    geometries: weakref.WeakKeyDictionary[
        PageGeometry, tuple[NDArray[np.int64], NDArray[np.int64]]
    ] = field(default_factory=weakref.WeakKeyDictionary)

    def addresses(self, g: PageGeometry) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Each buffer pair's two addresses of geometry ``g`` as the page mover takes them
        (checked against these tables and gathered at the link's first page write). Any
        submitting thread; two that race both check and store the same arrays."""
        addrs = self.geometries.get(g)
        if addrs is None:
            check_geometry_addresses(g, self.local_i64, self.remote_addr.astype(np.int64))
            addrs = (self.local_i64[g.src_rows], self.remote_mapped[g.dst_rows])
            self.geometries[g] = addrs
        return addrs


@dataclass(eq=False)
class IpcXfer:
    """Initiator-side state of one transfer."""

    peer: IpcPeer
    event: Any = None
    #: Host rows and notification, posted over the side channel once ``event`` completed.
    follow: Follow | None = None
    notification: Note | None = None
    #: The follow-up carries the notification alone (VRAM rows only): the transfer is DONE
    #: once the kernel's event completed and the message was handed to the side channel.
    notify_only: bool = False
    tcp: OutboundTransfer | None = None
    failed: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: The peer's name (the side channel's address) and the submitter's wake-up (the
    #: handle's ``wake``), called once the transfer is terminal.
    peer_name: str = ""
    wake: Callable[[], None] | None = None
    #: Held by a worker's turn (:mod:`kvwire_cudaipc.batch`): not launched yet, PENDING.
    held: bool = False
    #: The kernel watcher passed this launch (it ended): ``event`` may be reused now.
    ended: bool = False
