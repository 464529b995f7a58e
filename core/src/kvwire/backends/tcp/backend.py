"""The ``tcp`` reference backend: moves bytes between processes and hosts over ZeroMQ.

Design (one agent per process/rank):

* One I/O thread owns every socket: a ROUTER bound on ``host:port`` that serves inbound
  requests, and one DEALER per peer for outbound transfers. Other threads hand it work as
  commands (:class:`~kvwire.owner_loop.OwnerLoop`: a queue and a wake-up pipe), so no socket
  is ever touched by two threads.
* A transfer is cut into parts of at most ``max_part_bytes``; parts are gathered lazily when
  the peer's socket can take them, so memory in flight stays bounded by the socket's
  high-water mark. Rows contiguous on both sides are merged before cutting.
* The target checks every row against the regions it registered and refuses anything else
  (the initiator's transfer then ends FAILED with the target's reason). A notification is
  queued only after the last part's bytes are in place, so data always precedes it.
* Every transfer has a deadline; a removed peer or a closed agent fails its pending transfers.
* A note (a notification alone, which a subclass sends once its data moved another way) to a
  peer on this host goes over a UNIX datagram socket from the thread that queues it
  (:mod:`~kvwire.backends.tcp.local_notes`), else over the peer's notes socket.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
import zmq
from pydantic import BaseModel

from kvwire.backend import (
    BackendCapabilities,
    Notification,
    PeerFacts,
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
from kvwire.backends.memcopy import HostMemory, coalesce
from kvwire.backends.tcp import wire
from kvwire.backends.tcp.auth import DataPlaneAuth
from kvwire.backends.tcp.local_notes import LocalNotes, peer_notes_path
from kvwire.backends.tcp.options import TcpOptions
from kvwire.backends.tcp.outbound import OutboundPeer, OutboundTransfer, open_dealer, split_rows
from kvwire.control.reach import (
    POLLIN,
    POLLOUT,
    connect_problem,
    endpoint_host,
    keep_alive,
    readable,
)
from kvwire.descriptors import ADDR, DescTable
from kvwire.layout import MemoryRegion
from kvwire.link_choice import host_identity
from kvwire.owner_loop import OwnerLoop
from kvwire.security import warn_if_exposed

logger = logging.getLogger(__name__)

T = TypeVar("T")

METADATA_VERSION = 2


class TcpBackend(TransferBackend):
    """Pure-Python reference backend over ZeroMQ (DRAM only, WRITE and READ, notifications)."""

    name = "tcp"
    capabilities = BackendCapabilities(
        write=True, read=True, notifications=True, dram=True, vram=False, cross_host=True
    )
    options_model = TcpOptions
    options: TcpOptions
    #: Completions and notifications happen on the I/O thread, which wakes their owners.
    pushes_events = True
    link_rule = "any peer whose data endpoint accepts a TCP connection from here"
    #: A class that sends notes alone (:meth:`_queue_note`) opens a local notes socket; ``tcp``
    #: carries a notification in a transfer's last part, so it opens none.
    sends_notes = False

    def __init__(self, agent_name: str, options: BaseModel | None = None) -> None:
        super().__init__(agent_name, options)
        opts = self.options
        self._ctx = zmq.Context()
        secret = opts.secret.get_secret_value().encode() if opts.secret else b""
        #: CURVE authentication of the data plane (None without a secret: open, see
        #: docs/security.md).
        self.auth = DataPlaneAuth(self._ctx, secret, agent_name) if secret else None
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDTIMEO, 1000)
        keep_alive(self._router)  # a peer's connection left open by a partition is closed
        try:
            if self.auth is not None:
                self.auth.secure_server(self._router)
            if opts.port:
                self._router.bind(f"tcp://{opts.host}:{opts.port}")
                port = opts.port
            else:
                port = self._router.bind_to_random_port(f"tcp://{opts.host}")
        except zmq.ZMQError:
            self._router.close(linger=0)
            if self.auth is not None:
                self.auth.close()
            self._ctx.term()
            raise
        warn_if_exposed("tcp data endpoint", opts.host, self.auth is not None)
        self.endpoint = f"tcp://{opts.advertise_host or opts.host}:{port}"
        self.incarnation = uuid.uuid4().hex
        self._memory = HostMemory([])
        self._peers: dict[str, OutboundPeer] = {}
        self._xfer_ids = iter(range(1, 1 << 62))
        self._notifs: collections.deque[Notification] = collections.deque()
        self._failed_inbound: collections.OrderedDict[tuple[bytes, int], str] = (
            collections.OrderedDict()
        )
        #: Inbound messages dropped as malformed or refused (out-of-region rows, bad sizes).
        self.refused_messages = 0
        #: The I/O thread: runs the commands other threads post, then one turn of the loop.
        self._loop = OwnerLoop(f"kvwire-tcp-{agent_name}", self._loop_once)
        #: The I/O thread's poller: the ROUTER and the loop's wake-up pipe, and each peer's
        #: DEALER with the flags it is watched for (kept across turns; changed only when they
        #: change).
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._loop.wake_fd, zmq.POLLIN)
        self._watched: dict[zmq.Socket[Any], int] = {}
        #: This host's identity: a peer with the same one takes notes over ``_local``.
        self.host = host_identity()
        #: Notes from and to peers on this host (None: off, or this class sends none alone).
        wanted = opts.local_notes and self.sends_notes
        self._local = LocalNotes(agent_name, self._on_local_note) if wanted else None
        self._loop.start()

    # ------------------------------------------------------------ thread glue
    def _call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run ``fn`` on the I/O thread and wait for its result."""
        if self._loop.on_owner_thread():
            return fn()
        fut: Future[T] = Future()

        def job() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self._post(job)
        return fut.result(timeout=timeout)

    def _post(self, job: Callable[[], None]) -> None:
        """Hand ``job`` to the I/O thread (any thread; it runs before the loop's next turn)."""
        self._loop.post(job)

    # ---------------------------------------------------------------- memory
    def _register(self, regions: list[MemoryRegion]) -> None:
        self._memory = HostMemory([*self._regions, *regions])

    def _deregister(self, regions: list[MemoryRegion]) -> None:
        self._memory = HostMemory([r for r in self._regions if r not in regions])

    # ----------------------------------------------------------------- peers
    def local_metadata(self) -> bytes:
        """Name, endpoint, regions, host identity and local notes socket, msgpack-encoded."""
        return pack_metadata(
            self.name,
            METADATA_VERSION,
            name=self.agent_name,
            endpoint=self.endpoint,
            incarnation=self.incarnation,
            regions=region_rows(self._memory.regions),
            host=self.host,
            **self._note_fields(),
        )

    def _note_fields(self) -> dict[str, Any]:
        """The fields offering the local notes socket (a subclass's metadata adds them too)."""
        address = self._local.address if self._local is not None else None
        return {"notes_path": address} if address else {}

    def _decode_metadata(self, metadata: bytes) -> dict[str, Any]:
        meta = unpack_metadata(metadata, self.name, METADATA_VERSION, "kvwire")
        for key in ("name", "endpoint", "regions"):
            if key not in meta:
                raise ValueError(f"tcp metadata lacks {key!r}")
        if not isinstance(meta["name"], str) or not meta["name"]:
            raise ValueError(f"tcp metadata names no agent (name {meta['name']!r})")
        endpoint = meta["endpoint"]
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            raise ValueError(f"tcp metadata endpoint {endpoint!r} is not a tcp://host:port address")
        return meta

    def _peer_name(self, metadata: bytes) -> str:
        return str(self._decode_metadata(metadata)["name"])

    def advertised_hosts(self, metadata: bytes) -> list[str]:
        """The host of the peer's data endpoint (``tcp://host:port``)."""
        return [endpoint_host(self._decode_metadata(metadata)["endpoint"])]

    def link_problem(self, peer: PeerFacts) -> str | None:
        """The peer's data endpoint must accept a TCP connection from here (opened and
        closed at once; nothing is sent): asked by prefill at handshake, and by
        :class:`~kvwire.backends.multi.MultiBackend` before it reconnects this backend after
        a failover, so a link whose network is down is not taken back too early (ZeroMQ's
        own connect never fails: it retries in the background). Blocks up to 2 s when the
        endpoint is silent. Handshake and probe threads; no lock."""
        try:
            endpoint = self._decode_metadata(peer.metadata)["endpoint"]
        except ValueError as exc:
            return f"unreadable tcp metadata: {exc}"
        return connect_problem(endpoint)

    def peers(self) -> list[str]:
        return list(self._peers)

    def _add_peer(self, name: str, metadata: bytes) -> None:
        meta = self._decode_metadata(metadata)
        regions = regions_from_rows(meta["regions"], "tcp", name)
        local_notes = peer_notes_path(meta, self.host) if self._local is not None else None

        def dealer() -> zmq.Socket[Any]:
            return open_dealer(self._ctx, meta["endpoint"], name, self.options.send_hwm, self.auth)

        def open_socket() -> None:
            peer = OutboundPeer(name, meta["endpoint"], regions, dealer(), local_notes=local_notes)
            try:
                peer.notes = dealer()
            except ValueError:
                peer.close()
                raise
            self._peers[name] = peer

        self._call(open_socket)

    def _remove_peer(self, peer: str) -> None:
        def close_socket() -> None:
            p = self._peers.pop(peer, None)
            if p is None:
                return
            why = f"peer {peer!r} was removed"
            for x in [*p.outq, *p.inflight.values()]:
                self._finish(x, XferState.FAILED, why)
            if p.sock is not None and self._watched.pop(p.sock, None) is not None:
                self._poller.unregister(p.sock)
            p.close()

        self._call(close_socket)

    def _peer_regions(self, peer: str) -> list[MemoryRegion] | None:
        p = self._peers.get(peer)
        return None if p is None else p.regions

    # -------------------------------------------------------------- transfer
    def _prepare(self, pair: PreparedPair, local: DescTable, remote: DescTable) -> Any:
        return (local[:, ADDR].copy(), remote[:, ADDR].copy())

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
        la, ra = local_addr[local_idx], remote_addr[remote_idx]
        lens = pair.local_lens[local_idx]
        return self._queue(op, pair.peer, la, ra, lens, notification, handle.wake)

    def _queue(
        self,
        op: XferOp,
        peer: str,
        la: np.ndarray,
        ra: np.ndarray,
        lens: np.ndarray,
        notification: bytes | None,
        wake: Callable[[], None] | None = None,
    ) -> OutboundTransfer:
        """Queue a transfer of rows ``la`` -> ``ra`` (``lens`` bytes each) to ``peer`` on the
        I/O thread; returns its state (read by :meth:`_poll`). Called by :meth:`_submit` and
        by subclasses that send over this data plane (the ``cudaipc`` side channel); any
        thread. A write's parts carry the wall-clock time by which they must land."""
        la, ra, lens = coalesce(la, ra, lens)
        timeout = self.options.transfer_timeout_s
        x = OutboundTransfer(
            xid=next(self._xfer_ids),
            peer=peer,
            op=op,
            parts=split_rows(la, ra, lens, self.options.max_part_bytes),
            notification=notification,
            deadline=time.monotonic() + timeout,
            write_by=time.time() + timeout - self.options.write_guard_s,
            wake=wake,
        )
        return self._enqueue(x)

    def _queue_note(self, peer: str, notification: bytes) -> OutboundTransfer:
        """Queue a note to ``peer``: the notification alone (no rows), delivered by the
        target at once and not answered, so the transfer is DONE once its frame is handed
        to the socket. For a subclass whose data moved another way and whose peer said it
        takes notes (an older target refuses the kind: it would never see the
        notification). Any thread: the note goes out from this thread over the peer's local
        notes socket (a peer on this host) or its notes socket when either takes it at once,
        else through the I/O thread's queue."""
        xid = next(self._xfer_ids)
        p = self._peers.get(peer)
        sent = False
        if p is not None:
            frames = self._note_frames(xid, notification)
            local, address = self._local, p.local_notes
            sent = local is not None and address is not None and local.send(address, frames[1])
            sent = sent or p.send_note(frames)
        deadline = 0.0 if sent else time.monotonic() + self.options.transfer_timeout_s
        x = OutboundTransfer(xid, peer, XferOp.WRITE, [], notification, deadline, note_only=True)
        if sent:
            x.status = XferState.DONE
            return x
        return self._enqueue(x)

    def _enqueue(self, x: OutboundTransfer) -> OutboundTransfer:
        """Hand ``x`` to the I/O thread: queued for its peer (awaiting replies unless it is
        a note, which nothing answers), or FAILED when the peer is gone. Any thread."""

        def enqueue() -> None:
            p = self._peers.get(x.peer)
            if p is None:
                self._finish(x, XferState.FAILED, f"peer {x.peer!r} was removed")
                return
            p.outq.append(x)
            if not x.note_only:
                p.inflight[x.xid] = x

        self._post(enqueue)
        return x

    def _poll(self, handle: TransferHandle) -> XferState:
        x: OutboundTransfer = handle.state
        if x.status is XferState.FAILED and handle.error is None:
            handle.error = x.error
        return x.status

    def get_notifications(self) -> list[Notification]:
        out = []
        while self._notifs:
            out.append(self._notifs.popleft())
        return out

    def _close(self) -> None:
        if self._local is not None:
            self._local.close()
        self._loop.stop(timeout=10)
        for p in self._peers.values():
            for x in [*p.outq, *p.inflight.values()]:
                self._finish(x, XferState.FAILED, "agent closed")
            p.close()
        self._peers.clear()
        self._router.close(linger=0)
        if self.auth is not None:
            self.auth.close()
        self._ctx.term()

    # -------------------------------------------------------------- I/O loop
    @staticmethod
    def _finish(x: OutboundTransfer, state: XferState, error: str | None = None) -> None:
        if x.status is XferState.PENDING:
            x.error = error
            x.status = state
            if x.wake is not None:
                x.wake()

    def _loop_once(self) -> None:
        """One turn of the I/O thread, after the posted commands ran: send what the peers'
        sockets take, wait up to 50 ms for sockets or a posted command, serve what arrived,
        expire overdue transfers."""
        for p in self._peers.values():
            self._pump(p)
        poller = self._poller
        watched = self._watched
        for p in self._peers.values():  # only what changed: a new peer, POLLOUT on or off
            assert p.sock is not None
            flags = POLLIN | (POLLOUT if p.outq else 0)
            old = watched.get(p.sock)
            if old is None:
                poller.register(p.sock, flags)
            elif old != flags:
                poller.modify(p.sock, flags)
            watched[p.sock] = flags
        events = dict(poller.poll(timeout=50))
        if self._loop.wake_fd in events:
            self._loop.drain_wake()
        if self._router in events:
            for _ in range(64):
                if not readable(self._router):  # cheaper than the zmq.Again of an empty recv
                    break
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._serve(frames)
        for p in list(self._peers.values()):
            if p.sock is not None and p.sock in events and events[p.sock] & POLLIN:
                for _ in range(64):
                    if not readable(p.sock):
                        break
                    try:
                        frames = p.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_reply(p, frames)
        self._expire()

    def _pump(self, p: OutboundPeer) -> None:
        """Send as many queued parts to ``p`` as its socket takes without blocking."""
        assert p.sock is not None
        while p.outq:
            x = p.outq[0]
            if x.status is not XferState.PENDING:
                p.outq.popleft()
                continue
            if x.pending_frames is None:
                try:
                    x.pending_frames = self._build_part(x)
                except Exception as exc:
                    p.outq.popleft()
                    p.inflight.pop(x.xid, None)
                    self._finish(x, XferState.FAILED, f"could not read local rows: {exc}")
                    continue
            try:
                p.sock.send_multipart(x.pending_frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            x.pending_frames = None
            x.next_part += 1
            if x.note_only:  # nothing answers a note: handed to the socket is its end
                p.outq.popleft()
                self._finish(x, XferState.DONE, None)
            elif x.next_part == len(x.parts):
                p.outq.popleft()

    def _note_frames(self, xid: int, notification: bytes) -> list[Any]:
        """The frames of a note (kind ``N``: the notification alone). Any thread."""
        note = {"v": wire.VERSION, "x": xid, "f": self.agent_name, "n": notification}
        return [wire.NOTE, wire.pack(note)]

    def _build_part(self, x: OutboundTransfer) -> list[Any]:
        if x.note_only:
            assert x.notification is not None
            return self._note_frames(x.xid, x.notification)
        local, remote, lens = x.parts[x.next_part]
        last = x.next_part == len(x.parts) - 1
        header = {
            "v": wire.VERSION,
            "x": x.xid,
            "f": self.agent_name,
            "d": wire.rows_to_bytes(remote, lens),
            "p": x.next_part,
            "np": len(x.parts),
            "n": x.notification if last else None,
        }
        if x.op is XferOp.WRITE:
            if x.write_by is not None:
                header["t"] = x.write_by
            return [wire.WRITE, wire.pack(header), self._memory.gather(local, lens)]
        return [wire.READ, wire.pack(header)]

    def _on_reply(self, p: OutboundPeer, frames: list[zmq.Frame]) -> None:
        try:
            if len(frames) < 2 or frames[0].bytes != wire.ACK:
                raise wire.MalformedMessageError("reply is not an ACK")
            h = wire.unpack(frames[1].buffer)
            x = p.inflight.get(int(h["x"]))
            if x is None:
                return  # late reply for a transfer already failed or removed
            if not h.get("ok"):
                p.inflight.pop(x.xid, None)
                self._finish(x, XferState.FAILED, f"peer refused: {h.get('e')}")
                return
            if x.op is XferOp.READ:
                local, _remote, lens = x.parts[int(h["p"])]
                if len(frames) < 3:
                    raise wire.MalformedMessageError("read reply without payload")
                self._memory.scatter(local, lens, frames[2].buffer)
            x.replies += 1
            if (x.op is XferOp.WRITE and h.get("p") == len(x.parts) - 1) or (
                x.op is XferOp.READ and x.replies == len(x.parts)
            ):
                p.inflight.pop(x.xid, None)
                self._finish(x, XferState.DONE)
        except Exception as exc:
            self.refused_messages += 1
            logger.warning("%s: bad reply from %s dropped: %s", self.agent_name, p.name, exc)

    def _serve(self, frames: list[zmq.Frame]) -> None:
        """Handle one inbound request on the ROUTER (target side)."""
        ident = frames[0].bytes
        xid: int | None = None
        part = 0
        try:
            if len(frames) < 3:
                raise wire.MalformedMessageError("request has too few frames")
            kind = frames[1].bytes
            h = wire.unpack(frames[2].buffer)
            if kind == wire.NOTE:  # a notification alone: delivered, never answered
                self._deliver(str(h["f"]), h.get("n"))
                return
            xid, part, nparts = int(h["x"]), int(h["p"]), int(h["np"])
            sender = str(h["f"])
            addr, lens = wire.rows_from_bytes(h["d"])
            key = (ident, xid)
            if key in self._failed_inbound:
                if part == nparts - 1:
                    self._failed_inbound.pop(key, None)
                return
            mem = self._memory
            bad = mem.locate(addr, lens) < 0
            if bad.any():
                i = int(np.argmax(bad))
                raise wire.RefusedRowsError(
                    f"{int(bad.sum())} of {bad.size} rows from {sender!r} outside the regions "
                    f"agent {self.agent_name!r} registered (first addr {int(addr[i]):#x} "
                    f"len {int(lens[i])})"
                )
            if kind == wire.WRITE:
                if len(frames) != 4:
                    raise wire.MalformedMessageError("write request without payload")
                wire.check_write_by(h, time.time(), sender, xid)
                mem.scatter(addr, lens, frames[3].buffer)
                last = part == nparts - 1
                if last:
                    self._deliver(sender, h.get("n"))
                    self._reply(ident, {"x": xid, "p": part, "ok": True})
            elif kind == wire.READ:
                data = mem.gather(addr, lens)
                if part == nparts - 1:
                    self._deliver(sender, h.get("n"))
                self._reply(ident, {"x": xid, "p": part, "ok": True}, data)
            else:
                raise wire.MalformedMessageError(f"unknown request kind {kind!r}")
        except Exception as exc:
            self.refused_messages += 1
            # Details (addresses, counts) stay in this rank's log; the peer learns the category
            # only, so a prober cannot map the registered regions from the answers.
            public = wire.public_reason(exc)
            logger.warning("%s: refused inbound request: %s", self.agent_name, exc)
            if xid is not None:
                self._failed_inbound[(ident, xid)] = public
                while len(self._failed_inbound) > 10_000:
                    self._failed_inbound.popitem(last=False)
                self._reply(ident, {"x": xid, "p": part, "ok": False, "e": public})

    def _on_local_note(self, datagram: bytes) -> None:
        """Local notes' receiver thread: a note from a peer on this host (bad ones counted)."""
        try:
            h = wire.unpack(datagram)
            self._deliver(str(h["f"]), h.get("n"))
        except Exception as exc:
            self.refused_messages += 1
            logger.warning("%s: refused a local note: %s", self.agent_name, exc)

    def _deliver(self, sender: str, payload: object) -> None:
        if payload is None:
            return
        if not isinstance(payload, bytes):
            raise wire.MalformedMessageError("notification payload must be bytes")
        self._notifs.append(Notification(sender, payload))
        self._notified()

    def _reply(self, ident: bytes, header: dict[str, Any], data: Any = None) -> None:
        header["v"] = wire.VERSION
        frames: list[Any] = [ident, wire.ACK, wire.pack(header)]
        if data is not None:
            frames.append(data)
        try:
            self._router.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or stuck: it will time out
            logger.warning("%s: could not reply to a peer: %s", self.agent_name, exc)

    def _expire(self) -> None:
        now, timeout = time.monotonic(), self.options.transfer_timeout_s
        for p in self._peers.values():
            for x in [x for x in p.inflight.values() if x.deadline < now]:
                p.inflight.pop(x.xid, None)
                why = f"transfer to {p.name!r} timed out after {timeout:g}s"
                self._finish(x, XferState.FAILED, why)
