"""The ``mooncake`` transfer backend: kvwire over the Mooncake Transfer Engine.

Design (one agent = one Mooncake ``TransferEngine`` in P2P-handshake mode, no metadata server):

* Registered regions go to the engine (``batch_register_memory``) and are published in the
  agent's metadata together with its segment name (``host:rpc_port``) and the endpoint of its
  notification socket. ``add_peer`` probes the peer (bounded, GIL released), opens its segment
  once (the handshake happens there, not on the first transfer) and connects the notification
  socket.
* ``prepare`` keeps the address columns of both tables as NumPy arrays; ``submit`` gathers the
  rows with the index arrays, merges rows contiguous on both sides and cuts the result into
  engine batches of at most ``max_batch_descs`` descriptors.
* Per peer, at most ``max_inflight_descs`` descriptors are handed to the engine at a time:
  Mooncake 0.3.13's TCP transport rejects work beyond its per-peer queue ("queue-full"), and
  after a rejection every batch to that peer times out. Batches that do not fit wait in a
  per-peer backlog and are submitted as earlier ones complete.
* Threads: ``submit`` runs with no template lock, from several workers at once. Each peer has
  one small lock (its condition), held only for bookkeeping: a batch is reserved under it
  (budget counted, backlog advanced), handed to the engine's ``batch_transfer_async_*``
  with no kvwire lock held (the batch API may be called from several threads), then
  recorded under it. Mooncake 0.3.13's Python binding keeps the GIL during that call
  (about 0.5 ms per 1024 descriptors), so submits still enter the engine one at a time, but
  kvwire adds no lock of its own around them, and neither the waiter thread nor another
  submitter waits on the peer's lock for an engine call. ``add_peer`` (probe, segment open)
  and (de)registration run under the template's control lock; notifications have their own
  I/O thread.
* ``get_batch_transfer_status`` blocks (and busy-polls) until a batch ends, so each peer with
  work in flight has a waiter thread that calls it for its batches in order (by default after
  sleeping through most of the batch's expected time); ``poll`` only reads state. A batch id
  is passed on only if the submit returned a valid one (0 or an invalid id would crash the
  process), exactly once (the engine frees it in that call).
* Notifications travel on kvwire's own channel (:mod:`kvwire_mooncake.notify`), sent after
  every batch of the transfer completed; the handle becomes DONE when the target acknowledged.
* ``remove_peer`` and ``close`` fail pending transfers at once; batches already in the engine
  are still drained by the waiter threads (the engine owns them until then), which hold their
  own reference to the engine, so ``close`` never waits for a dead peer's timeout.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel

from kvwire.backend import (
    BackendCapabilities,
    Notification,
    PreparedPair,
    TransferBackend,
    TransferHandle,
    XferOp,
    XferState,
)
from kvwire.backends.envelope import (
    pack_metadata,
    region_rows,
    regions_from_rows,
    unpack_metadata,
)
from kvwire.backends.memcopy import coalesce
from kvwire.control.reach import endpoint_host
from kvwire.descriptors import ADDR, DescTable
from kvwire.layout import MemKind, MemoryRegion
from kvwire_mooncake.engine import (
    EngineSettings,
    MooncakeEngineError,
    check_port_range,
    create_engine,
    import_engine,
    is_cuda_build,
    rdma_devices,
)
from kvwire_mooncake.notify import NotifyChannel
from kvwire_mooncake.options import MooncakeOptions

__all__ = ["METADATA_VERSION", "MooncakeBackend", "MooncakeOptions"]

logger = logging.getLogger(__name__)

METADATA_VERSION = 1
#: Seconds ``close`` waits for the waiter threads to drain batches still in the engine.
CLOSE_DRAIN_S = 2.0
#: Adaptive completion wait: sleep this share of a batch's expected time before spinning,
#: never longer than MAX_PRESLEEP_S, and not at all when less than MIN_PRESLEEP_S is left.
PRESLEEP_FRACTION = 0.7
MAX_PRESLEEP_S = 0.5
MIN_PRESLEEP_S = 0.001
U64 = NDArray[np.uint64]


@dataclass(eq=False)
class _Xfer:
    """Initiator-side state of one transfer."""

    xid: int
    peer: str
    op: XferOp
    #: Engine batches: (local addresses, remote addresses, lengths).
    parts: list[tuple[U64, U64, U64]]
    notification: bytes | None
    deadline: float
    submitted: int = 0
    finished: int = 0
    status: XferState = XferState.PENDING
    error: str | None = None


@dataclass(eq=False)
class _Batch:
    """One engine batch in flight."""

    bid: int
    xfer: _Xfer
    descs: int
    nbytes: int
    submitted_at: float


@dataclass(eq=False)
class _Peer:
    name: str
    segment: str
    notify_endpoint: str
    incarnation: str
    regions: list[MemoryRegion]
    cond: threading.Condition = field(default_factory=threading.Condition)
    #: Batches in the engine, oldest first.
    inflight: collections.deque[_Batch] = field(default_factory=collections.deque)
    inflight_descs: int = 0
    #: Recent observed rates (bytes/s) and the last completion time, for the adaptive wait.
    rates: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=16))
    last_done: float = 0.0
    #: Transfers with batches not yet handed to the engine, in submission order.
    backlog: collections.deque[_Xfer] = field(default_factory=collections.deque)
    removed: bool = False
    waiter: threading.Thread | None = None
    #: Transfers with a batch reserved (budget counted) and being handed to the engine
    #: outside ``cond`` right now; the waiter stays until this is empty.
    posting: list[_Xfer] = field(default_factory=list)


def _valid_batch_id(bid: object) -> bool:
    """Whether a submit returned a usable batch id (0 means failure; the engine's -1 arrives
    as 2**64-1 or -1 depending on the call)."""
    return type(bid) is int and 0 < bid < (1 << 63)


def _split(la: U64, ra: U64, lens: U64, size: int) -> list[tuple[U64, U64, U64]]:
    if la.size <= size:
        return [(la, ra, lens)]
    cuts = range(size, la.size, size)
    return list(zip(np.split(la, cuts), np.split(ra, cuts), np.split(lens, cuts), strict=True))


class MooncakeBackend(TransferBackend):
    """kvwire backend over the Mooncake Transfer Engine (TCP or RDMA; WRITE, READ,
    notifications; DRAM, and VRAM with Mooncake's CUDA build)."""

    name = "mooncake"
    capabilities = BackendCapabilities(
        write=True,
        read=True,
        notifications=True,
        dram=True,
        vram=is_cuda_build(),
        cross_host=True,
    )
    options_model = MooncakeOptions
    options: MooncakeOptions

    def __init__(self, agent_name: str, options: BaseModel | None = None) -> None:
        super().__init__(agent_name, options)
        opts = self.options
        advertise = opts.advertise_host or opts.host
        if opts.rpc_port_range is not None:  # fail before binding anything
            check_port_range(opts.rpc_port_range)
        try:
            self._notify = NotifyChannel(
                agent_name, opts.host, advertise, opts.notify_port, opts.rpc_port_range
            )
        except Exception as exc:
            raise MooncakeEngineError(
                f"cannot bind the notification socket of agent {agent_name!r} on "
                f"{opts.host}:{opts.notify_port or '*'} (host must be an address of this "
                f"machine): {exc}"
            ) from exc
        try:
            module = import_engine(opts.log_level, opts.rpc_port_range)
            created = create_engine(
                module,
                EngineSettings(
                    advertise_host=advertise,
                    bind_host=opts.host,
                    protocol=opts.protocol,
                    device_name=opts.device_name,
                    transfer_timeout_s=opts.transfer_timeout_s,
                ),
            )
        except BaseException:
            self._notify.close()
            raise
        if opts.protocol == "rdma" and not rdma_devices():
            logger.warning(
                "%s: protocol 'rdma' but this host has no RDMA device; Mooncake 0.3.13 then "
                "moves the data over TCP without saying so",
                agent_name,
            )
        self._engine: Any = created.engine
        self.segment = created.segment
        #: Descriptors in the engine per peer at most (the engine's queue bounds it).
        self.inflight_limit = min(opts.max_inflight_descs, created.queue_limit)
        self.incarnation = uuid.uuid4().hex
        self._peers: dict[str, _Peer] = {}
        self._xids = iter(range(1, 1 << 62))
        self._state_lock = threading.Lock()
        self._waiters: list[threading.Thread] = []
        logger.debug(
            "%s: mooncake engine %s (%s), notifications on %s",
            agent_name,
            self.segment,
            opts.protocol,
            self._notify.endpoint,
        )

    # ---------------------------------------------------------------- memory
    def _register(self, regions: list[MemoryRegion]) -> None:
        # One engine call per location: host memory is auto-detected ("*"), device memory
        # is named ("cuda:N"). A failure unregisters what this call registered.
        groups: dict[str, list[MemoryRegion]] = {}
        for r in regions:
            where = f"cuda:{r.device_id}" if r.kind == MemKind.VRAM else "*"
            groups.setdefault(where, []).append(r)
        done: list[int] = []
        for location, group in groups.items():
            addrs = [r.addr for r in group]
            rc = self._engine.batch_register_memory(addrs, [r.length for r in group], location)
            if rc != 0:
                self._engine.batch_unregister_memory(done + addrs)
                raise MooncakeEngineError(
                    f"agent {self.agent_name!r}: Mooncake could not register {len(group)} "
                    f"region(s) at location {location!r} (first at {addrs[0]:#x}, "
                    f"{group[0].length} B): engine returned {rc}"
                )
            done.extend(addrs)

    def _deregister(self, regions: list[MemoryRegion]) -> None:
        rc = self._engine.batch_unregister_memory([r.addr for r in regions])
        if rc != 0:
            logger.warning(
                "%s: Mooncake returned %s when deregistering %d region(s)",
                self.agent_name,
                rc,
                len(regions),
            )

    # ----------------------------------------------------------------- peers
    def local_metadata(self) -> bytes:
        """Name, segment, notification endpoint and registered regions, msgpack-encoded."""
        return pack_metadata(
            self.name,
            METADATA_VERSION,
            name=self.agent_name,
            segment=self.segment,
            notify=self._notify.endpoint,
            protocol=self.options.protocol,
            incarnation=self.incarnation,
            regions=region_rows(self.registered_regions),
        )

    def _decode_metadata(self, metadata: bytes) -> dict[str, Any]:
        meta = unpack_metadata(metadata, self.name, METADATA_VERSION, "kvwire-mooncake")
        for key in ("name", "segment", "notify", "protocol", "incarnation", "regions"):
            if not isinstance(meta.get(key), str if key != "regions" else list):
                raise ValueError(f"mooncake metadata lacks a valid {key!r}")
        if not meta["name"]:
            raise ValueError("mooncake metadata names no agent")
        if meta["protocol"] != self.options.protocol:
            raise ValueError(
                f"peer {meta['name']!r} uses Mooncake protocol {meta['protocol']!r}, agent "
                f"{self.agent_name!r} uses {self.options.protocol!r}; configure both alike"
            )
        if not meta["notify"].startswith("tcp://"):
            raise ValueError(f"notification endpoint {meta['notify']!r} is not tcp://host:port")
        return meta

    def _peer_name(self, metadata: bytes) -> str:
        return str(self._decode_metadata(metadata)["name"])

    def advertised_hosts(self, metadata: bytes) -> list[str]:
        """The hosts of the peer's Mooncake segment (``host:port``) and its notification
        endpoint."""
        meta = self._decode_metadata(metadata)
        return [endpoint_host(meta["segment"]), endpoint_host(meta["notify"])]

    def peers(self) -> list[str]:
        return list(self._peers)

    def _add_peer(self, name: str, metadata: bytes) -> None:
        meta = self._decode_metadata(metadata)
        regions = regions_from_rows(meta["regions"], "mooncake", name)
        self._open_segment(name, meta["segment"], bool(regions))
        peer = _Peer(name, meta["segment"], meta["notify"], meta["incarnation"], regions)
        peer.waiter = threading.Thread(
            target=self._wait_loop,
            args=(peer, self._engine),
            name=f"kvwire-mooncake-wait-{self.agent_name}-{name}",
            daemon=True,
        )
        self._notify.connect(name, peer.notify_endpoint)
        self._peers[name] = peer
        self._waiters = [t for t in self._waiters if t.is_alive()]
        self._waiters.append(peer.waiter)
        peer.waiter.start()

    def _open_segment(self, name: str, segment: str, has_regions: bool) -> None:
        """Handshake with the peer now, so that no submit waits for it.

        The engine's segment-opening call holds the GIL and waits ~60 s for a peer that
        accepts connections but does not answer (stopped, overloaded), freezing the process.
        So the peer is first probed with ``send_probe`` (GIL released) from a helper thread,
        bounded by ``connect_timeout_s``; only a peer that answered is then opened.
        """
        engine = self._engine
        result: list[int] = []
        probe = threading.Thread(
            target=lambda: result.append(int(engine.send_probe(segment))),
            name=f"kvwire-mooncake-probe-{name}",
            daemon=True,
        )
        probe.start()
        probe.join(self.options.connect_timeout_s)
        if not result:
            raise ValueError(
                f"agent {self.agent_name!r} cannot add peer {name!r}: its Mooncake engine at "
                f"{segment} did not answer a probe within {self.options.connect_timeout_s:g}s"
            )
        if result[0] != 0:
            raise ValueError(
                f"agent {self.agent_name!r} cannot reach peer {name!r}: Mooncake probe of "
                f"{segment} failed with code {result[0]} (peer down, or host unreachable)"
            )
        if has_regions and engine.get_first_buffer_address(segment) == 0:
            raise ValueError(
                f"agent {self.agent_name!r} cannot reach peer {name!r}: Mooncake found no "
                f"registered memory in segment {segment}"
            )

    def _remove_peer(self, peer: str) -> None:
        p = self._peers.pop(peer, None)
        if p is None:
            return
        self._retire(p, f"peer {peer!r} was removed")
        self._notify.disconnect(peer, f"peer {peer!r} was removed")

    def _retire(self, p: _Peer, why: str) -> None:
        """Stop submitting to ``p`` and fail its pending transfers; its waiter drains what
        is already in the engine, then exits."""
        with p.cond:
            p.removed = True
            for x in [*p.backlog, *(b.xfer for b in p.inflight), *p.posting]:
                self._finish(x, XferState.FAILED, why)
            p.backlog.clear()
            p.cond.notify_all()

    def _peer_regions(self, peer: str) -> list[MemoryRegion] | None:
        p = self._peers.get(peer)
        return None if p is None else p.regions

    # -------------------------------------------------------------- transfer
    def _prepare(self, pair: PreparedPair, local: DescTable, remote: DescTable) -> Any:
        return (
            np.ascontiguousarray(local[:, ADDR], dtype=np.uint64),
            np.ascontiguousarray(remote[:, ADDR], dtype=np.uint64),
        )

    def _submit(
        self,
        op: XferOp,
        pair: PreparedPair,
        local_idx: np.ndarray,
        remote_idx: np.ndarray,
        notification: bytes | None,
        handle: TransferHandle,
    ) -> Any:
        local_addr, remote_addr = pair.state
        la, ra, lens = coalesce(
            local_addr[local_idx], remote_addr[remote_idx], pair.local_lens[local_idx]
        )
        x = _Xfer(
            xid=next(self._xids),
            peer=pair.peer,
            op=op,
            parts=_split(la, ra, lens, self.options.max_batch_descs),
            notification=notification,
            deadline=time.monotonic() + self.options.transfer_timeout_s,
        )
        p = self._peers.get(pair.peer)
        if p is None:
            self._finish(x, XferState.FAILED, f"peer {pair.peer!r} was removed")
            return x
        with p.cond:
            if p.removed:
                self._finish(x, XferState.FAILED, f"peer {pair.peer!r} was removed")
                return x
            p.backlog.append(x)
        self._pump(p)
        return x

    def _pump(self, p: _Peer) -> None:
        """Hand backlog batches to the engine while the peer's in-flight budget allows.

        Called without ``p.cond``, by submitters and the waiter, possibly several at once:
        each batch is reserved under ``p.cond``, submitted with no lock held, and recorded
        under ``p.cond`` again.
        """
        engine = self._engine
        if engine is None:
            return
        while True:
            with p.cond:
                reserved = self._reserve(p)
            if reserved is None:
                return
            x, part = reserved
            la, ra, lens = x.parts[part]
            n = int(la.size)
            submit = (
                engine.batch_transfer_async_write
                if x.op is XferOp.WRITE
                else engine.batch_transfer_async_read
            )
            error = ""
            try:
                bid = submit(p.segment, la.tolist(), ra.tolist(), lens.tolist())
            except Exception as exc:  # the accounting below must run whatever happens
                bid, error = None, f": {type(exc).__name__}: {exc}"
            with p.cond:
                p.posting.remove(x)
                if _valid_batch_id(bid):
                    p.inflight.append(_Batch(bid, x, n, int(lens.sum()), time.monotonic()))
                else:
                    p.inflight_descs -= n
                    self._finish(
                        x,
                        XferState.FAILED,
                        f"Mooncake refused to start {x.op.value.upper()} batch {part + 1}/"
                        f"{len(x.parts)} ({n} descriptors) to peer {x.peer!r} at {p.segment} "
                        f"(batch id {bid}{error}): peer unreachable or engine queue full",
                    )
                p.cond.notify_all()

    def _reserve(self, p: _Peer) -> tuple[_Xfer, int] | None:
        """The next backlog batch that fits the in-flight budget, reserved: its descriptors
        counted in flight and the backlog advanced past it (``p.cond`` held)."""
        while p.backlog and not p.removed:
            x = p.backlog[0]
            if x.status is not XferState.PENDING:  # failed or abandoned: submit no more of it
                p.backlog.popleft()
                continue
            part = x.submitted
            n = int(x.parts[part][0].size)
            if p.inflight_descs and p.inflight_descs + n > self.inflight_limit:
                return None
            p.inflight_descs += n
            x.submitted += 1
            if x.submitted == len(x.parts):
                p.backlog.popleft()
            p.posting.append(x)
            return x, part
        return None

    def _wait_loop(self, p: _Peer, engine: Any) -> None:
        """Waiter thread of one peer: wait for its batches in order, complete transfers,
        submit backlog as room frees up.

        ``get_batch_transfer_status`` busy-polls a core until the batch ends (GIL released).
        With ``completion_wait="adaptive"`` the thread first sleeps for 70% of the time the
        batch should take at the fastest rate recently seen to this peer (at most
        ``MAX_PRESLEEP_S``), so it spins only near the end; an early finish raises the rate
        estimate, so the sleep never drifts long.
        """
        adaptive = self.options.completion_wait == "adaptive"
        while True:
            with p.cond:
                while not p.inflight:
                    if p.removed and not p.posting:  # nothing left that the engine owns
                        return
                    p.cond.wait()
                b = p.inflight[0]
                start = max(b.submitted_at, p.last_done)
                if adaptive and p.rates:
                    wake = start + min(PRESLEEP_FRACTION * b.nbytes / max(p.rates), MAX_PRESLEEP_S)
                    while not p.removed and (left := wake - time.monotonic()) > MIN_PRESLEEP_S:
                        p.cond.wait(left)
            try:
                rc = engine.get_batch_transfer_status([b.bid])
            except Exception as exc:  # never leave the peer stuck
                rc = -1
                logger.exception("%s: get_batch_transfer_status failed: %s", self.agent_name, exc)
            now = time.monotonic()
            x = b.xfer
            with p.cond:
                p.inflight.popleft()
                p.inflight_descs -= b.descs
                x.finished += 1
                if rc == 0 and now > start:
                    p.rates.append(b.nbytes / (now - start))
                p.last_done = now
                if rc != 0:
                    self._finish(
                        x,
                        XferState.FAILED,
                        f"Mooncake {x.op.value.upper()} to peer {x.peer!r} at {p.segment} "
                        f"failed (status {rc}) in batch {x.finished}/{len(x.parts)} of "
                        f"{b.descs} descriptors: peer dead or unreachable, rows outside its "
                        "registered memory, or the engine timed out",
                    )
                elif x.finished == len(x.parts):
                    self._complete(x)
            self._pump(p)

    def _complete(self, x: _Xfer) -> None:
        """Every batch of ``x`` completed: notify the target, or finish now."""
        if x.status is not XferState.PENDING:
            return
        if x.notification is None:
            self._finish(x, XferState.DONE)
            return

        def acked(ok: bool, error: str | None) -> None:
            if ok:
                self._finish(x, XferState.DONE)
            else:
                self._finish(x, XferState.FAILED, f"data landed but notification failed: {error}")

        self._notify.tell(x.peer, x.xid, x.notification, x.deadline, acked)

    def _finish(self, x: _Xfer, state: XferState, error: str | None = None) -> None:
        with self._state_lock:
            if x.status is XferState.PENDING:
                x.error = error
                x.status = state

    def _poll(self, handle: TransferHandle) -> XferState:
        x: _Xfer = handle.state
        if x.status is XferState.PENDING and time.monotonic() > x.deadline:
            self._finish(
                x,
                XferState.FAILED,
                f"{x.op.value.upper()} to peer {x.peer!r} timed out after "
                f"{self.options.transfer_timeout_s:g}s",
            )
        if x.status is XferState.FAILED and handle.error is None:
            handle.error = x.error
        return x.status

    def _release(self, handle: TransferHandle) -> None:
        # Abandoned while pending: submit no more of it and never send its notification.
        self._finish(handle.state, XferState.FAILED, "transfer handle released while pending")

    def get_notifications(self) -> list[Notification]:
        return self._notify.drain()

    def _close(self) -> None:
        for p in list(self._peers.values()):
            self._retire(p, f"agent {self.agent_name!r} was closed")
        self._notify.close()
        deadline = time.monotonic() + CLOSE_DRAIN_S
        for t in self._waiters:
            t.join(max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in self._waiters if t.is_alive()]
        self._peers.clear()
        self._waiters = []
        if busy:
            # Those threads keep their own reference: the engine is destroyed after they end.
            logger.warning(
                "%s: %d Mooncake batch(es) still in the engine at close; it is released when "
                "they end (%s)",
                self.agent_name,
                len(busy),
                ", ".join(busy),
            )
        # Destroying an engine takes ~1 s in Mooncake 0.3.13 (and holds the GIL meanwhile).
        self._engine = None

    @property
    def notify_endpoint(self) -> str:
        """Where this agent receives notifications (``tcp://host:port``)."""
        return self._notify.endpoint
