"""``cudaipc``'s lean lane (:mod:`kvwire.page_lane`): a prefill worker's turn of page writes
as one launch of the pool-to-pool page mover per ``batch_max_bytes``, each with one event,
and each write's note sent by the kernel watcher as soon as its launch ended.

Per turn, on the worker's thread: every write checked as ``submit_pages`` checks it (a write
that fails its check fails alone), its buffer pairs' addresses taken from its prepared pair
(gathered once per link), then, under the involved peers' locks (taken in one order), writes
to a removed peer refused and the others enqueued in groups that close once they reach
``batch_max_bytes`` (each chunk is under it; a group's writes complete when its kernel
does: large chunks are never batched together, :mod:`kvwire_cudaipc.batch` says why), each
group's event handed to the kernel watcher. On
the watcher's thread, as each group ended: its notes sent (a note after its data, as every
``cudaipc`` write), failures recorded; after the last group the launch is finished, which
wakes the worker. A peer removed after the launch: ``_close_peer`` waits for the stream
before it unmaps, and a note to a gone peer is failed to its write.

Lock contract: the peers' locks only while enqueueing (never across a wait); the launch's
own lock (:class:`~kvwire.page_lane.LaneLaunch`) for its errors; a turn's group count under
:attr:`_Turn.lock`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
from numpy.typing import NDArray

from kvwire.backend import BackendCapabilities, PreparedPair
from kvwire.movers.warmup import Warmer
from kvwire.page_form import PageChunk, PageGeometry
from kvwire.page_lane import LaneLaunch, LaneWrite, check_write
from kvwire_cudaipc.options import CudaIpcOptions
from kvwire_cudaipc.state import IpcPair, locked
from kvwire_cudaipc.watcher import KernelWatcher

logger = logging.getLogger(__name__)


class _Host(Protocol):
    """What the lane uses of its backend (:class:`~kvwire_cudaipc.backend.CudaIpcBackend`)."""

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]
    options: CudaIpcOptions
    _pages: Any
    _stream: Any

    def _kernel_watcher(self) -> KernelWatcher[Any]: ...

    def _queue_note(self, peer: str, notification: bytes) -> Any: ...

    def _ensure_gpu(self) -> None: ...


@dataclass(eq=False)
class _Group:
    """One launch of a turn (watched by the kernel watcher): its writes' indices, whether
    its end was handled (under the turn's lock: once, by the watcher or a worker's poll)."""

    indices: list[int]
    event: Any = None
    ended: bool = False
    handled: bool = False


@dataclass(eq=False)
class _Turn:
    """A turn's launch and how many of its groups the watcher has yet to pass."""

    launch: LaneLaunch
    left: int = 0
    sealed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    groups: list[_Group] = field(default_factory=list)

    def claim(self, g: _Group) -> bool:
        """Whether the caller handles group ``g``'s end (the first to ask; watcher or poll)."""
        with self.lock:
            first, g.handled = not g.handled, True
        return first

    def group_ended(self) -> None:
        """Watcher or poll, after handling a group's end: the launch finishes after the
        last one."""
        with self.lock:
            self.left -= 1
            last = self.sealed and self.left == 0
        if last:
            self.launch.finish()

    def seal(self) -> None:
        """Worker thread, after its last group was enqueued (or none was)."""
        with self.lock:
            self.sealed = True
            last = self.left == 0
        if last:
            self.launch.finish()


_Item = tuple[int, IpcPair, PageChunk, NDArray[np.int64], NDArray[np.int64]]


class CudaIpcLane:
    """The lane of one :class:`~kvwire_cudaipc.backend.CudaIpcBackend` (its ``page_lane``)."""

    def __init__(self, backend: _Host) -> None:
        self._b = backend
        #: Compiles each link's kernels at its handshake, off the request path.
        self._warmer = Warmer("cudaipc")

    def warm(self, pair: PreparedPair, geometry: PageGeometry) -> None:
        """Prefill's handshake thread, once a link's page geometry is known: its pair's
        addresses gathered (and checked) now, and the page mover's kernels for its writes
        compiled on the lane's warm-up thread (:class:`kvwire.movers.warmup.Warmer`), so the
        link's first writes do not wait for Triton's compile (1.1-1.5 s on a host whose
        Triton cache lacks it). A pair whose rows are not all VRAM is written by other
        launches; a geometry the tables refuse is left for the first write to report."""
        st: IpcPair = pair.state
        pages = self._b._pages
        if not st.all_vram or pages is None:
            return
        try:
            src, dst = st.addresses(geometry)
        except Exception as exc:  # the first write fails with it, naming its request
            logger.debug("cudaipc: no warm-up for %s: %s", pair.peer, exc)
            return
        self._warmer.submit(
            f"cudaipc's page mover for {pair.peer}", lambda: int(pages.warm(geometry, src, dst))
        )

    def warm_ahead(
        self, geometry: PageGeometry, src_addrs: NDArray[np.int64], dst_addrs: NDArray[np.int64]
    ) -> None:
        """Prefill, at its start: the page mover (made now, on the writing GPU) compiles the
        kernels of writes of ``geometry`` between buffers aligned as these (this rank's own,
        standing in for a decode rank of its layout) on the warm-up thread. Nothing on a
        rank without a VRAM pool."""
        self._b._ensure_gpu()
        pages = self._b._pages
        if pages is None:
            return
        self._warmer.submit(
            "cudaipc's page mover for decode ranks of this layout",
            lambda: int(pages.warm(geometry, src_addrs, dst_addrs)),
        )

    def close(self) -> None:
        """The backend's close: a compile under way finishes on its own; none starts."""
        self._warmer.close()

    def takes(self, pair: PreparedPair, nbytes: int) -> bool:
        """Prefill worker: a chunk of ``nbytes`` on ``pair`` goes through the lane when the
        pair is VRAM in every row, its peer takes notes, and the chunk is under
        ``batch_max_bytes`` (a larger one is launched alone, as a transfer of its own)."""
        st: IpcPair = pair.state
        if not st.all_vram or not st.peer.info.notes:
            return False
        return 0 < nbytes < self._b.options.batch_max_bytes

    def launch(self, writes: Sequence[LaneWrite], wake: Callable[[], None]) -> LaneLaunch:
        """Prefill worker, at the end of its turn: check, group and launch ``writes``."""
        turn = _Turn(LaneLaunch(writes, wake))
        turn.launch.poll = lambda: self._poll(turn)
        items: list[_Item] = []
        for i, w in enumerate(writes):
            try:
                check_write(self._b.name, self._b.capabilities, w)
                st: IpcPair = w.pair.state
                src, dst = st.addresses(w.chunk.geometry)
            except Exception as exc:  # the write's own problem, not the link's
                turn.launch.fail([i], f"{type(exc).__name__}: {exc}", link=False)
                continue
            items.append((i, st, w.chunk, src, dst))
        try:
            self._enqueue(turn, items)
        finally:
            turn.seal()
        return turn.launch

    def _enqueue(self, turn: _Turn, items: list[_Item]) -> None:
        """Under the items' peers' locks: refuse writes to removed peers, enqueue the others
        in groups, each recorded and watched. A failed enqueue fails the writes not launched
        (the groups watched already finish as they end)."""
        if not items:
            return
        b, launch = self._b, turn.launch
        with locked(it[1].peer for it in items):
            gone = [it[0] for it in items if it[1].peer.closed]
            if gone:
                launch.fail(gone, "cudaipc: the peer was removed before the write was launched")
            live = [it for it in items if not it[1].peer.closed]
            watcher, pages, stream = b._kernel_watcher(), b._pages, b._stream
            groups = _groups(live, b.options.batch_max_bytes)
            for n, group in enumerate(groups):
                try:
                    pages.copy_batch([(c, s, d) for _, _, c, s, d in group], stream=stream)
                    g = _Group([it[0] for it in group], watcher.record(stream))
                except Exception as exc:
                    rest = [it[0] for grp in groups[n:] for it in grp]
                    launch.fail(rest, f"cudaipc: the lane's mover launch failed: {exc}")
                    return
                with turn.lock:
                    turn.left += 1
                    turn.groups.append(g)
                watcher.watch(g, True, lambda g, err: self._ended(turn, g, err))

    def _poll(self, turn: _Turn) -> None:
        """A worker's poll of its launch: handle each group whose event completed and that
        the watcher has not passed (a passed group's event may be reused: never read)."""
        for g in list(turn.groups):
            if g.handled or g.ended:
                continue
            try:
                done = g.event.query()
            except Exception:  # the watcher's wait reports the failed kernel
                return
            if not done:
                return  # one stream: later groups end later
            self._ended(turn, g, None)

    def _ended(self, turn: _Turn, g: _Group, error: str | None) -> None:
        """Kernel watcher or a worker's poll: group ``g`` ended (``error``: its wait
        failed). Once per group: send its notes (after its data) and count it."""
        if not turn.claim(g):
            return
        launch = turn.launch
        try:
            if error is not None:
                launch.fail(g.indices, error)
                return
            for i in g.indices:
                w = launch.writes[i]
                st: IpcPair = w.pair.state
                if st.peer.closed:
                    launch.fail([i], f"cudaipc: peer {w.pair.peer!r} was removed")
                    continue
                try:
                    self._b._queue_note(w.pair.peer, w.note)
                except Exception as exc:
                    launch.fail([i], f"cudaipc: the note could not be sent: {exc}")
        finally:
            turn.group_ended()


def _groups(items: list[_Item], limit: int) -> list[list[_Item]]:
    """``items`` in order, cut so that a group's bytes stay under ``limit`` (a group closes
    once it reaches it)."""
    out: list[list[_Item]] = []
    cur: list[_Item] = []
    size = 0
    for it in items:
        cur.append(it)
        size += it[2].nbytes
        if size >= limit:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out
