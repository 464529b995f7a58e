"""The ``cudaipc`` backend: prefill and decode on GPUs of one host, over CUDA IPC.

* **Regions.** Every registered VRAM region is exported at registration as the CUDA IPC
  handle of the allocation that holds it plus its offset inside (``cuMemGetAddressRange``,
  ``cuIpcGetMemHandle``); :meth:`CudaIpcBackend.local_metadata` publishes them with the host's
  identity (boot id and hostname), the process id and the UUID of each GPU.
* **Peers.** :meth:`~kvwire.backend.TransferBackend.add_peer` refuses a peer on another host, a
  peer GPU this process cannot see or reach peer to peer, or handles that do not open
  (:class:`~kvwire.errors.ConfigError` naming the reason); otherwise it enables peer access
  from the writing GPU (the one holding this rank's VRAM regions) to the peer's GPU and opens
  the handles on the writing GPU (``cuIpcOpenMemHandle``, lazy peer access), once per
  allocation per process.
* **Transfers (WRITE only).** ``prepare`` translates the remote table's VRAM rows into this
  process's mapping of the peer's memory, once. ``submit`` turns the two index arrays into a
  run list with NumPy fancy indexing (three gathers for a pair that is VRAM in every row)
  and enqueues **one** fused mover launch (:meth:`kvwire.movers.triton_copy.RunCopier.move`:
  one program per group of evenly spaced pieces, e.g. a head slice of a page's token rows,
  or per tile) on the backend's private stream, then records an event. A KV chunk of a
  regular link comes as pages instead (``page_writes``: :meth:`_submit_pages`): one launch
  of the pool-to-pool page mover, whose table is the page lists and each buffer pair's two
  addresses, with no row expanded; page writes a prefill worker submits in one turn of its
  loop are held and launched together at its end (:meth:`post_batch`,
  :mod:`kvwire_cudaipc.batch`: one launch per shape, one event). Host-memory rows
  (an engine's aux rows) and the notification travel over the built-in ``tcp`` backend's
  side channel (ZeroMQ, CURVE-authenticated with a secret), which this class extends: they
  are posted only once the kernel's event completed, so a notification always reaches the
  peer after the data. A transfer with VRAM rows only is
  DONE when its event is (its data has landed): its notification, if any, is then on its way
  (handed to the side channel; the peer's ACK is not awaited, as with NIXL's notifications).
  A transfer with host rows is DONE when the peer acknowledged them (they land there).
* **Events pushed.** Like ``tcp``, this backend
  :attr:`~kvwire.backend.TransferBackend.pushes_events` (its owners sleep until woken
  rather than poll on a timer), so it must say when a kernel ends: a watcher thread of its
  own (:class:`~kvwire_cudaipc.watcher.KernelWatcher`, started at the first launch) waits
  for each launch's event in launch order (one stream: they complete in that order), posts
  the follow-up (host rows, notification) at once, and calls the transfer's ``wake`` when it
  is DONE (VRAM rows only) -- the side channel's write calls it for the others. So neither
  the notification nor the submitter waits for a poll.

Locks: the template's contract (kvwire.backend). Besides, each peer has a lock held while a
kernel that stores into its mappings is enqueued and while the mappings are closed (after
the stream is synchronised), so a removal never unmaps memory under a launch. Each
transfer's lock is held while its follow-up is posted (by the watcher or by ``poll``,
whichever comes first: it is posted once).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel

from kvwire.backend import (
    BackendCapabilities,
    Note,
    PeerFacts,
    PreparedPair,
    TransferHandle,
    XferOp,
    XferState,
)
from kvwire.backends.envelope import pack_metadata, region_rows
from kvwire.backends.memcopy import HostMemory
from kvwire.backends.tcp import TcpBackend
from kvwire.descriptors import ADDR, LEN, DescTable, locate_rows
from kvwire.errors import ConfigError, DescriptorError, PeerError
from kvwire.layout import MemKind, MemoryRegion
from kvwire.movers.plan import merge_adjacent
from kvwire.page_form import PageChunk
from kvwire.transfers import note_bytes, note_sums, start_sums
from kvwire_cudaipc import _cuda
from kvwire_cudaipc.batch import Held, HeldWrites, launch_held
from kvwire_cudaipc.copies import copy_runs, takes_copy_engine
from kvwire_cudaipc.lane import CudaIpcLane
from kvwire_cudaipc.meta import IpcExport, PeerInfo, parse_peer
from kvwire_cudaipc.options import CudaIpcOptions
from kvwire_cudaipc.state import IpcPair, IpcPeer, IpcXfer, one_row
from kvwire_cudaipc.sums import page_enqueue
from kvwire_cudaipc.watcher import KernelWatcher

logger = logging.getLogger(__name__)

METADATA_VERSION = 1
SCRATCH_BYTES = 8


class CudaIpcBackend(TcpBackend):
    """Same-host VRAM -> VRAM WRITEs through CUDA IPC and one fused kernel per transfer."""

    name = "cudaipc"
    capabilities = BackendCapabilities(
        write=True, read=False, notifications=True, dram=True, vram=True, cross_host=False,
        page_writes=True, later_notes=True,  # later notes: made by _post_follow, after the kernel
        summed_writes=True,  # a page write's sums in its launch (kvwire_cudaipc.sums)
    )  # fmt: skip
    options_model = CudaIpcOptions
    options: CudaIpcOptions
    #: Its notification follows the kernel as a note alone (local notes socket on one host).
    sends_notes = True
    #: A submit enqueues one launch and returns: one worker keeps the GPU fed, and more only
    #: take turns on the GIL (2 x H200, C=8: 1.2-1.8x the GB/s of 4 workers; benchmarks.md).
    suggested_workers = 1
    link_rule = (
        "peers on this host (boot id and hostname match) whose GPU this process sees and "
        "reaches peer to peer, from a rank with CUDA and a VRAM pool; other links take the "
        "next backend"
    )

    def __init__(self, agent_name: str, options: BaseModel | None = None) -> None:
        super().__init__(agent_name, options)
        self._host = _cuda.host_identity()
        self._exports: dict[int, IpcExport] = {}  # region addr -> export
        self._ipc_peers: dict[str, IpcPeer] = {}
        self._gpu_lock = threading.Lock()
        self._writer: int | None = None
        self._stream: Any = None
        self._copier: Any = None
        self._pages: Any = None
        self._watcher: KernelWatcher[IpcXfer] | None = None
        #: Page writes a worker's turn holds (post_batch), per thread.
        self._held = HeldWrites(self._flush_held)
        #: 8 bytes a notification-only message writes on the target (the side channel's
        #: messages carry at least one row); in every HostMemory, never in ``_regions``.
        self._scratch = np.zeros(SCRATCH_BYTES, dtype=np.uint8)
        self._scratch_region = MemoryRegion.from_tensor(self._scratch, item_len=SCRATCH_BYTES)
        self._memory = HostMemory([self._scratch_region])
        #: A worker's turn of page writes as one launch (kvwire.page_lane).
        self._lane = self.page_lane = CudaIpcLane(self)

    # ---------------------------------------------------------------- memory
    def _register(self, regions: list[MemoryRegion]) -> None:
        vram = [r for r in regions if r.kind == MemKind.VRAM]
        devices = {r.device_id for r in vram} | {
            r.device_id for r in self._regions if r.kind == MemKind.VRAM
        }
        if len(devices) > 1:
            raise ConfigError(
                f"cudaipc: a rank's VRAM regions must be on one GPU, got devices {sorted(devices)}"
            )
        exports = {r.addr: self._export(r) for r in vram}
        self._memory = HostMemory(
            [self._scratch_region]
            + [r for r in [*self._regions, *regions] if r.kind == MemKind.DRAM]
        )
        self._exports.update(exports)

    def _deregister(self, regions: list[MemoryRegion]) -> None:
        self._memory = HostMemory(
            [self._scratch_region]
            + [r for r in self._regions if r not in regions and r.kind == MemKind.DRAM]
        )
        for r in regions:
            self._exports.pop(r.addr, None)

    def _export(self, region: MemoryRegion) -> IpcExport:
        handle, offset, size = _cuda.export(region.device_id, region.addr)
        if offset + region.length > size:
            raise ConfigError(
                f"cudaipc: VRAM region at {region.addr:#x} (+{region.length}) spans more than "
                "one CUDA allocation; register each allocation as its own region"
            )
        return IpcExport(
            addr=region.addr,
            handle=handle,
            offset=offset,
            uuid=_cuda.device_uuid(region.device_id),
        )

    # ----------------------------------------------------------------- peers
    def local_metadata(self) -> bytes:
        """Name, side-channel endpoint, regions, host identity and the IPC exports of every
        VRAM region. Any thread; takes the control lock (registrations must not change under
        it)."""
        with self._lock:
            regions = list(self._regions)
            exports = [self._exports[r.addr].to_row() for r in regions if r.kind == MemKind.VRAM]
        return pack_metadata(
            self.name,
            METADATA_VERSION,
            name=self.agent_name,
            endpoint=self.endpoint,
            incarnation=self.incarnation,
            regions=region_rows(regions),
            host=self._host,
            pid=_cuda.pid(),
            exports=exports,
            scratch=self._scratch_region.addr,
            notes=True,
            **self._note_fields(),
        )

    @classmethod
    def rank_problem(cls, kinds: frozenset[MemKind]) -> str | None:
        """``auto`` offers cudaipc only on a rank with a VRAM pool and a usable CUDA device."""
        if MemKind.VRAM not in kinds:
            return "no VRAM pool on this rank (CUDA IPC moves GPU memory)"
        return _cuda.cuda_problem()

    def link_problem(self, peer: PeerFacts) -> str | None:
        """Prefill, at handshake: cudaipc serves a link only to a peer on this host (the
        handshake's host identity, else the metadata's), from a rank with CUDA and VRAM, to
        GPUs this process sees and reaches peer to peer. The first reason that applies, in
        that order."""
        try:
            info = parse_peer(peer.metadata, self.name, METADATA_VERSION)
        except ValueError as exc:
            return f"unreadable cudaipc metadata: {exc}"
        host = peer.host or info.host
        if host != self._host:
            return (
                f"different hosts (peer on {host.get('hostname')!r} boot "
                f"{host.get('boot_id', '')[:8]!r}, this rank on {self._host.get('hostname')!r} "
                f"boot {self._host.get('boot_id', '')[:8]!r}): CUDA IPC works within one host"
            )
        why = _cuda.cuda_problem()
        if why is not None:
            return why
        writer = self._writer_device()
        if writer is None:
            return "this rank registered no VRAM (CUDA IPC moves GPU memory)"
        if not info.exports:
            return "the peer registered no VRAM"
        if info.pid == _cuda.pid():
            return None
        uuids = _cuda.visible_uuids()
        for e in info.exports:
            owner = uuids.get(e.uuid)
            if owner is None:
                return f"the peer's GPU {e.uuid} is not visible here (CUDA_VISIBLE_DEVICES)"
            why = _cuda.p2p_problem(writer, owner)
            if why is not None:
                return why
        return None

    def _decode_metadata(self, metadata: bytes) -> dict[str, Any]:
        return parse_peer(metadata, self.name, METADATA_VERSION).raw

    def _add_peer(self, name: str, metadata: bytes) -> None:
        info = parse_peer(metadata, self.name, METADATA_VERSION)
        info.check_same_host(self._host)
        peer = self._open_peer(info)
        try:
            super()._add_peer(name, metadata)
        except BaseException:
            self._close_peer(peer)
            raise
        self._ipc_peers[name] = peer

    def _open_peer(self, info: PeerInfo) -> IpcPeer:
        """Enable peer access and open the peer's handles on the writing GPU (control lock
        held). Nothing is opened for a peer without VRAM regions, or by a rank without any
        (its VRAM rows are then refused at prepare)."""
        delta: list[int | None] = [None] * len(info.regions)
        peer = IpcPeer(info=info, delta=delta, opened=[])
        writer = self._writer_device()
        if not info.exports or writer is None:
            return peer
        same_process = info.pid == _cuda.pid()
        uuids = _cuda.visible_uuids()
        by_addr = {e.addr: e for e in info.exports}
        try:
            for i, r in enumerate(info.regions):
                if r.kind != MemKind.VRAM:
                    continue
                e = by_addr[r.addr]
                if same_process:
                    delta[i] = 0
                    continue
                owner = uuids.get(e.uuid)
                if owner is None:
                    raise ConfigError(
                        f"cudaipc: peer {info.name!r} holds its KV on GPU {e.uuid}, which this "
                        "process cannot see (CUDA_VISIBLE_DEVICES must list both GPUs of a "
                        "link); use another backend or make the GPU visible"
                    )
                _cuda.enable_peer_access(writer, owner)
                base = _cuda.OPENED.open(e.handle, writer)
                peer.opened.append((e.handle, writer))
                delta[i] = base + e.offset - r.addr
        except BaseException:
            self._close_peer(peer)
            raise
        return peer

    def _close_peer(self, peer: IpcPeer) -> None:
        """Fail the peer's pending transfers, wait for kernels that may store into its
        mappings, then unmap them."""
        with peer.lock:
            peer.closed = True
            for x in list(peer.pending):
                x.failed = x.failed or f"peer {peer.info.name!r} was removed"
            if peer.opened and self._stream is not None:
                self._stream.synchronize()
            for raw, dev in peer.opened:
                try:
                    _cuda.OPENED.close(raw, dev)
                except ConfigError as exc:
                    logger.warning("%s: %s", self.agent_name, exc)
            peer.opened.clear()

    def _remove_peer(self, peer: str) -> None:
        p = self._ipc_peers.pop(peer, None)
        if p is not None:
            self._close_peer(p)
        super()._remove_peer(peer)

    def _peer_regions(self, peer: str) -> list[MemoryRegion] | None:
        p = self._ipc_peers.get(peer)
        return None if p is None else list(p.info.regions)

    # -------------------------------------------------------------- transfer
    def _writer_device(self) -> int | None:
        devs = [r.device_id for r in self._regions if r.kind == MemKind.VRAM]
        return devs[0] if devs else None

    def _kinds(self, table: DescTable, regions: Sequence[MemoryRegion]) -> NDArray[np.int64]:
        order = sorted(range(len(regions)), key=lambda i: regions[i].addr)
        starts = np.array([regions[i].addr for i in order], dtype=np.uint64)
        ends = np.array([regions[i].end for i in order], dtype=np.uint64)
        pos = locate_rows(starts, ends, table[:, ADDR], table[:, LEN])
        return np.asarray(order, dtype=np.int64)[pos]  # inside: checked by the template

    def _prepare(self, pair: PreparedPair, local: DescTable, remote: DescTable) -> Any:
        peer = self._ipc_peers[pair.peer]
        lregions = list(self._regions)
        lk = np.array([r.kind == MemKind.VRAM for r in lregions])[self._kinds(local, lregions)]
        rregions = peer.info.regions
        ridx = self._kinds(remote, rregions)
        rk = np.array([r.kind == MemKind.VRAM for r in rregions])[ridx]
        mapped = np.zeros(remote.shape[0], dtype=np.int64)
        if rk.any():
            if self._writer_device() is None:
                raise DescriptorError(
                    "cudaipc: the remote table has VRAM rows but this rank registered no VRAM; "
                    "a kernel on a GPU of this rank writes them"
                )
            delta = np.array([d if d is not None else 0 for d in peer.delta], dtype=np.int64)
            mapped = np.where(rk, remote[:, ADDR].astype(np.int64) + delta[ridx], 0)
        self._ensure_gpu()
        return IpcPair(
            peer=peer,
            local_addr=local[:, ADDR].copy(),
            remote_addr=remote[:, ADDR].copy(),
            local_vram=lk,
            remote_vram=rk,
            remote_mapped=mapped,
            local_i64=local[:, ADDR].astype(np.int64),
            lens_i64=local[:, LEN].astype(np.int64),
            all_vram=bool(lk.all() and rk.all()),
            note_follow=one_row(self._scratch_region.addr, peer.info.scratch, SCRATCH_BYTES),
        )

    def _ensure_gpu(self) -> None:
        """The private stream and the mover, on the writing GPU (first prepare with VRAM)."""
        writer = self._writer_device()
        if writer is None or self._copier is not None:
            return
        from kvwire.movers.triton_copy import RunCopier
        from kvwire.movers.triton_pool_pages import PoolPageCopier

        torch = _cuda._torch()

        with self._gpu_lock:
            if self._copier is None:
                self._stream = torch.cuda.Stream(device=writer)
                self._writer = writer
                self._pages = PoolPageCopier(writer, num_warps=self.options.num_warps)
                self._copier = RunCopier(
                    writer, self.options.tile_bytes, num_warps=self.options.num_warps
                )

    def _submit(
        self,
        op: XferOp,
        pair: PreparedPair,
        local_idx: np.ndarray,
        remote_idx: np.ndarray,
        notification: Note | None,
        handle: TransferHandle,
    ) -> Any:
        st: IpcPair = pair.state
        start_sums(notification)  # rows are not summed in the launch
        x = IpcXfer(peer=st.peer, notification=notification, peer_name=pair.peer, wake=handle.wake)
        if st.all_vram:  # the KV pool's pair: three gathers, one launch
            if notification is not None:
                self._notify_only(x, st)
            src, dst = st.local_i64[local_idx], st.remote_mapped[remote_idx]
            self._launch(x, st, self._runs(src, dst, st.lens_i64[local_idx]))
            return x
        lv, rv = st.local_vram[local_idx], st.remote_vram[remote_idx]
        if not np.array_equal(lv, rv):
            i = int(np.argmax(lv != rv))
            raise DescriptorError(
                f"cudaipc moves VRAM->VRAM and DRAM->DRAM rows; position {i} pairs local row "
                f"{int(local_idx[i])} ({'VRAM' if lv[i] else 'DRAM'}) with remote row "
                f"{int(remote_idx[i])} ({'VRAM' if rv[i] else 'DRAM'})"
            )
        lens = pair.local_lens[local_idx]
        host = ~lv
        if host.any():
            x.follow = (
                st.local_addr[local_idx[host]],
                st.remote_addr[remote_idx[host]],
                lens[host],
            )
        elif notification is not None:
            self._notify_only(x, st)
        if lv.any():
            li, ri = local_idx[lv], remote_idx[lv]
            runs = self._runs(st.local_i64[li], st.remote_mapped[ri], st.lens_i64[li])
            self._launch(x, st, runs)
        if x.event is None and x.follow is not None:
            self._post_follow(x)
        return x

    def _notify_only(self, x: IpcXfer, st: IpcPair) -> None:
        """The follow-up of a transfer without host rows: the notification alone, as a
        message that writes the peer's scratch word (the side channel carries rows)."""
        x.notify_only = True
        x.follow = st.note_follow  # the same three numbers for every write of the pair

    def _submit_pages(
        self,
        op: XferOp,
        pair: PreparedPair,
        chunk: PageChunk,
        notification: Note | None,
        handle: TransferHandle,
    ) -> Any:
        """A chunk in page form (checked by the template): on a pair that is VRAM in every
        row, one launch of the pool-to-pool page mover, whose table is the two page lists
        and each buffer pair's two addresses (two gathers of ``pairs`` numbers); otherwise
        its rows, as :meth:`_submit` moves them."""
        st: IpcPair = pair.state
        if not st.all_vram:
            return self._submit(op, pair, *chunk.rows(), notification, handle)
        x = IpcXfer(peer=st.peer, notification=notification, peer_name=pair.peer, wake=handle.wake)
        if notification is not None:
            self._notify_only(x, st)
        src, dst = st.addresses(chunk.geometry)
        limit, sums = self.options.batch_max_bytes, note_sums(notification)
        if sums is None and chunk.nbytes < limit and self._held.holding():  # with the turn's
            self._held.add(Held(x, st, chunk, src, dst), limit)
            return x
        try:
            self._launch(x, st, page_enqueue(self._pages, chunk, src, dst, self._stream, sums))
        except BaseException:
            if sums is not None:  # taken, never launched: a fallback starts it
                sums.abandon()
            raise
        return x

    def post_batch(self) -> AbstractContextManager[None]:
        """Prefill worker, around a turn of its loop: the turn's page writes under
        ``batch_max_bytes`` on pairs that are VRAM in every row are held and launched
        together, at most that many bytes at once (:mod:`kvwire_cudaipc.batch`)."""
        return self._held.hold() if self.options.batch_max_bytes else contextlib.nullcontext()

    def _flush_held(self, items: list[Held]) -> None:
        """The end of a worker's turn (its thread): one launch per shape for the held page
        writes and one event they all wait for, under their peers' locks."""
        watcher = self._kernel_watcher()
        pages, stream = self._pages, self._stream

        def enqueue(live: list[Held]) -> Any:
            pages.copy_batch([(h.chunk, h.src, h.dst) for h in live], stream=stream)
            return watcher.record(stream)

        def watch(x: IpcXfer, ev: Any, last: bool) -> None:
            x.event = ev  # before ``held`` goes: a poll then sees the event, never neither
            x.held = False
            x.peer.pending.add(x)
            watcher.watch(x, last)

        launch_held(items, enqueue, watch)

    def _runs(
        self, src: NDArray[np.int64], dst: NDArray[np.int64], n: NDArray[np.int64]
    ) -> Callable[[], None]:
        """The enqueue of VRAM runs ``(src, dst, n)`` (``dst`` in this process's mapping of
        the peer), to run under :meth:`_launch`: the copy engines for a few large runs once
        runs that continue each other are merged (:mod:`kvwire_cudaipc.copies`: bulk
        staging's blocks, a layer group of contiguous pages), else one launch of the run
        mover."""
        copier, stream, o = self._copier, self._stream, self.options
        if o.copy_engine_min_bytes:  # runs that continue each other are one copy
            src, dst, n = merge_adjacent(src, dst, n)
            if takes_copy_engine(n, o.copy_engine_min_bytes, o.copy_engine_max_runs):
                return lambda: copy_runs(src, dst, n, stream.cuda_stream)
        return lambda: copier.move(src, dst, n, stream=stream)

    def _launch(self, x: IpcXfer, st: IpcPair, enqueue: Callable[[], None]) -> None:
        """Enqueue one fused mover launch (``enqueue``: the run mover's or the page
        mover's) on the private stream, record its event and hand it to the kernel watcher.
        Holds the peer's lock only while enqueueing (never waits for the GPU)."""
        watcher = self._kernel_watcher()
        with st.peer.lock:
            if st.peer.closed:
                raise PeerError(f"peer {st.peer.info.name!r} was removed")
            enqueue()
            x.event = watcher.record(self._stream)
            st.peer.pending.add(x)
            watcher.watch(x)  # under the lock: the watcher sees launches in stream order

    def _kernel_watcher(self) -> KernelWatcher[IpcXfer]:
        """The watcher thread, started at the first launch (any submitting thread)."""
        if self._watcher is None:
            with self._gpu_lock:
                if self._watcher is None:
                    torch = _cuda._torch()
                    self._watcher = KernelWatcher(
                        self.agent_name,
                        self._kernel_done,
                        lambda: torch.cuda.Event(blocking=True),  # no spinning wait
                    )
        return self._watcher

    def _kernel_done(self, x: IpcXfer, error: str | None) -> None:
        """Kernel watcher: ``x``'s kernel ended. Post its follow-up now (unless ``poll`` did
        already), and wake its submitter when the transfer is DONE (VRAM rows only) or
        failed; a follow-up with host rows wakes it when the side channel's write ends."""
        with x.lock:
            if error is not None:
                x.failed = x.failed or error
            elif x.follow is not None and x.tcp is None and x.failed is None:
                self._post_follow(x)
            terminal = x.failed is not None or x.follow is None or x.notify_only
        if terminal and x.wake is not None:
            x.wake()

    def _post_follow(self, x: IpcXfer) -> bool:
        """Post the host rows and notification (a later note made now) over the side channel
        (after the data); it wakes the submitter when a write with host rows ends. A note
        alone goes as a note to a peer that takes them (its metadata's ``notes``), else as a
        write of the peer's scratch word. False (``x`` failed) if the note cannot be made."""
        assert x.follow is not None
        try:
            note = note_bytes(x.notification)
        except Exception as exc:
            x.failed = x.failed or f"cudaipc: the notification could not be made: {exc}"
            return False
        if x.notify_only and note is not None and x.peer.info.notes:
            x.tcp = self._queue_note(x.peer_name, note)  # no write, no answer
            return True
        la, ra, lens = x.follow
        wake = None if x.notify_only else x.wake
        x.tcp = self._queue(XferOp.WRITE, x.peer_name, la, ra, lens, note, wake)
        return True

    def _poll(self, handle: TransferHandle) -> XferState:
        x: IpcXfer = handle.state
        if x.failed is not None:
            handle.error = handle.error or x.failed
            return XferState.FAILED
        if x.held:  # its worker's turn has not ended: not launched yet
            return XferState.PENDING
        ev = x.event
        if x.tcp is None and ev is not None:
            # ended: the watcher saw the kernel end (and ev may be recorded again by now)
            try:
                done = x.ended or ev.query()
            except Exception as exc:  # a failed kernel (sticky CUDA error): fail the transfer
                with x.lock:
                    x.failed = x.failed or f"cudaipc: the mover kernel failed: {exc}"
                handle.error = handle.error or x.failed
                return XferState.FAILED
            if not done:
                return XferState.PENDING
            with x.lock:  # the watcher posts it; here if this poll saw the end first, or
                # if the watcher's handling failed
                posted = x.follow is None or x.tcp is not None or x.failed is not None
                if not posted and not self._post_follow(x):  # its note could not be made
                    handle.error = handle.error or x.failed
                    return XferState.FAILED
        if x.tcp is not None and not x.notify_only:
            if x.tcp.status is XferState.FAILED and handle.error is None:
                handle.error = x.tcp.error
            return x.tcp.status
        return XferState.DONE

    def _close(self) -> None:
        for p in list(self._ipc_peers.values()):
            self._close_peer(p)
        self._ipc_peers.clear()
        if self._watcher is not None:
            self._watcher.stop()
        self._lane.close()
        super()._close()
