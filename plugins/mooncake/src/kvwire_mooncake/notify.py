"""kvwire's own notification channel for the ``mooncake`` backend (ZeroMQ ROUTER/DEALER).

Mooncake's ``TransferNotify`` only rides on its *blocking* ``transfer_sync``/``batch_transfer_sync``
calls and attaches to one engine batch, while kvwire splits a transfer into several
asynchronous batches. So the backend sends each notification itself, once every batch of its
transfer completed (the data is in place), and the target acknowledges it:

* request, initiator DEALER -> target ROUTER: ``[b"N", header]`` with header
  ``{"v": 1, "f": sender agent, "x": transfer id, "n": payload bytes}``;
* reply: ``[b"A", {"v": 1, "x": transfer id}]``. The initiator's handle becomes DONE only on
  this acknowledgement, so DONE means the target holds the notification.

Each notification is sent once and queued once by the target, so it is delivered exactly once
to a live peer. One I/O thread owns every socket; other threads post commands to it
(:class:`kvwire.owner_loop.OwnerLoop`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from kvwire.backend import Notification
from kvwire.owner_loop import OwnerLoop

logger = logging.getLogger(__name__)

VERSION = 1
NOTIFY, ACK = b"N", b"A"
#: Largest inbound message the target accepts (payloads are small control records).
MAX_MESSAGE_BYTES = 1 << 20

#: Called on the I/O thread with (acknowledged, error text).
AckCallback = Callable[[bool, str | None], None]


@dataclass
class _Pending:
    peer: str
    deadline: float
    callback: AckCallback


def _pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def _unpack(data: bytes) -> dict[str, Any]:
    obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES)
    if not isinstance(obj, dict) or obj.get("v") != VERSION:
        raise ValueError("not a version-1 notification header")
    return obj


def _tcp_address(host: str) -> str:
    return f"tcp://[{host}]" if ":" in host else f"tcp://{host}"


class NotifyChannel:
    """Inbound notifications for one agent, and outbound ones to its peers."""

    def __init__(
        self,
        agent_name: str,
        bind_host: str,
        advertise_host: str,
        port: int = 0,
        port_range: tuple[int, int] | None = None,
    ) -> None:
        self.agent_name = agent_name
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 4096)
        if ":" in bind_host:
            self._router.setsockopt(zmq.IPV6, 1)
        address = _tcp_address(bind_host)
        try:
            if port:
                self._router.bind(f"{address}:{port}")
            elif port_range is not None:
                port = self._router.bind_to_random_port(
                    address, min_port=port_range[0], max_port=port_range[1] + 1
                )
            else:
                port = self._router.bind_to_random_port(address)
        except zmq.ZMQError:
            self._router.close(linger=0)
            self._ctx.term()
            raise
        self.port = port
        self.endpoint = f"{_tcp_address(advertise_host)}:{port}"
        self._dealers: dict[str, zmq.Socket[Any]] = {}
        self._pending: dict[int, _Pending] = {}
        self._inbox: collections.deque[Notification] = collections.deque()
        #: Inbound messages dropped as malformed.
        self.refused_messages = 0
        self._loop = OwnerLoop(f"kvwire-mooncake-notify-{agent_name}", self._loop_once)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._loop.wake_fd, zmq.POLLIN)
        self._loop.start()

    # ------------------------------------------------------------ other threads
    def _post(self, job: Callable[[], None]) -> None:
        self._loop.post(job)

    def connect(self, peer: str, endpoint: str) -> None:
        """Open (or replace) the outbound socket to ``peer``."""
        self._post(lambda: self._connect(peer, endpoint))

    def disconnect(self, peer: str, reason: str) -> None:
        """Close the socket to ``peer``; its unacknowledged notifications fail with ``reason``."""
        self._post(lambda: self._disconnect(peer, reason))

    def tell(
        self, peer: str, xid: int, payload: bytes, deadline: float, callback: AckCallback
    ) -> None:
        """Tell ``peer`` a notification (a control frame of its own, after the data);
        ``callback`` reports its acknowledgement or failure. Any thread."""
        self._post(lambda: self._tell(peer, xid, payload, deadline, callback))

    def drain(self) -> list[Notification]:
        """Notifications received since the last call, each exactly once."""
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def close(self, timeout: float = 2.0) -> None:
        """Stop the I/O thread, fail pending notifications and close every socket."""

        self._loop.stop(timeout)
        for xid in list(self._pending):
            self._fail(xid, "agent closed before the notification was acknowledged")
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._dealers.clear()
        self._router.close(linger=0)
        self._ctx.term()

    # --------------------------------------------------------------- I/O thread
    def _connect(self, peer: str, endpoint: str) -> None:
        self._disconnect(peer, f"peer {peer!r} was replaced")
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            logger.warning(
                "%s: cannot connect to %s of %r: %s", self.agent_name, endpoint, peer, exc
            )
            return
        self._dealers[peer] = sock
        self._poller.register(sock, zmq.POLLIN)

    def _disconnect(self, peer: str, reason: str) -> None:
        sock = self._dealers.pop(peer, None)
        if sock is not None:
            self._poller.unregister(sock)
            sock.close(linger=0)
        for xid in [x for x, p in self._pending.items() if p.peer == peer]:
            self._fail(xid, reason)

    def _fail(self, xid: int, reason: str) -> None:
        pending = self._pending.pop(xid, None)
        if pending is not None:
            pending.callback(False, reason)

    def _tell(
        self, peer: str, xid: int, payload: bytes, deadline: float, callback: AckCallback
    ) -> None:
        sock = self._dealers.get(peer)
        if sock is None:
            callback(False, f"peer {peer!r} was removed before its notification was sent")
            return
        header = _pack({"v": VERSION, "f": self.agent_name, "x": xid, "n": payload})
        try:
            sock.send_multipart([NOTIFY, header], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            callback(False, f"could not queue the notification to {peer!r}: {exc}")
            return
        self._pending[xid] = _Pending(peer, deadline, callback)

    def _loop_once(self) -> None:
        """One step of the owner loop (commands already ran): wait up to 0.1 s for inbound
        messages, acknowledgements or a command, serve them, expire overdue notifications."""
        dealers = list(self._dealers.items())
        events = dict(self._poller.poll(100))
        if self._loop.wake_fd in events:
            self._loop.drain_wake()
        if events.get(self._router):
            self._serve()
        for peer, sock in dealers:
            if events.get(sock):
                self._on_acks(peer, sock)
        self._expire()

    def _serve(self) -> None:
        for _ in range(256):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(frames) != 3 or frames[1] != NOTIFY:
                    raise ValueError("expected [identity, N, header]")
                h = _unpack(frames[2])
                sender, xid, payload = h.get("f"), h.get("x"), h.get("n")
                if not isinstance(sender, str) or not sender:
                    raise ValueError("notification names no sender")
                if type(xid) is not int or not isinstance(payload, bytes):
                    raise ValueError("notification lacks an int id or a bytes payload")
            except Exception as exc:
                self.refused_messages += 1
                logger.warning("%s: refused a notification message: %s", self.agent_name, exc)
                continue
            self._inbox.append(Notification(sender, payload))
            try:
                self._router.send_multipart(
                    [frames[0], ACK, _pack({"v": VERSION, "x": xid})], zmq.NOBLOCK
                )
            except zmq.ZMQError as exc:  # sender gone: it fails the transfer on its side
                logger.info("%s: could not acknowledge a notification: %s", self.agent_name, exc)

    def _on_acks(self, peer: str, sock: zmq.Socket[Any]) -> None:
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(frames) != 2 or frames[0] != ACK:
                    raise ValueError("expected [A, header]")
                xid = _unpack(frames[1]).get("x")
            except Exception as exc:
                self.refused_messages += 1
                logger.warning("%s: bad acknowledgement from %r: %s", self.agent_name, peer, exc)
                continue
            if type(xid) is not int:
                continue
            pending = self._pending.get(xid)
            if pending is not None and pending.peer == peer:
                del self._pending[xid]
                pending.callback(True, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for xid in [x for x, p in self._pending.items() if p.deadline < now]:
            p = self._pending[xid]
            self._fail(xid, f"peer {p.peer!r} did not acknowledge the notification in time")
