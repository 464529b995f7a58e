"""The control channel: framed messages between managers over ZeroMQ.

Each manager binds one PULL socket (its *endpoint*, published through bootstrap and the
handshake) and keeps one PUSH socket per peer endpoint for what it sends. Every send is
non-blocking and bounded by the socket's high-water mark: a dead or slow peer costs a dropped
message (counted), never a blocked thread. Sockets to an evicted peer are closed with linger 0.

Threads: :meth:`ControlChannel.receive` is called only by the manager's control thread (it owns
the PULL socket); :meth:`ControlChannel.send` may be called from any thread (the PUSH sockets are
serialised by a lock, which is what ZeroMQ asks of sockets shared between threads).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

import zmq

from kvwire.control.wire import Codec, Message
from kvwire.errors import ConfigError, ProtocolError

logger = logging.getLogger(__name__)


class ControlChannel:
    """One manager's control endpoint and its connections to peers."""

    def __init__(self, codec: Codec, host: str = "127.0.0.1", send_hwm: int = 1000) -> None:
        self.codec = codec
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        try:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ConfigError(
                f"cannot bind the control endpoint on {host!r}: {exc}; set control_host to an "
                "address of this machine"
            ) from exc
        self.endpoint = f"tcp://{host}:{port}"
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._hwm = send_hwm
        self._push: dict[str, zmq.Socket[bytes]] = {}
        self._lock = threading.Lock()
        self._closed = False
        #: Frames dropped, by reason ("unauthenticated", "malformed", "version", "send_full").
        self.dropped: Counter[str] = Counter()

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue ``msg`` for ``endpoint`` without blocking; False if it had to be dropped."""
        frame = self.codec.encode(msg)
        with self._lock:
            if self._closed:
                return False
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, self._hwm)
                sock.setsockopt(zmq.IMMEDIATE, 0)
                sock.connect(endpoint)
                self._push[endpoint] = sock
            try:
                sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                self.dropped["send_full"] += 1
                logger.warning("control send to %s dropped: its queue is full", endpoint)
                return False

    def receive(self, timeout_s: float) -> list[Message]:
        """Messages that arrived, waiting at most ``timeout_s`` for the first. Malformed,
        unauthenticated and wrong-version frames are dropped, logged and counted."""
        out: list[Message] = []
        if not self._poller.poll(max(0, int(timeout_s * 1000))):
            return out
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(self.codec.decode(frame))
            except ProtocolError as exc:
                text = str(exc)
                reason = (
                    "unauthenticated"
                    if "authentic" in text
                    else "version"
                    if "protocol" in text
                    else "malformed"
                )
                self.dropped[reason] += 1
                logger.warning("dropped a control frame (%s): %s", reason, exc)

    def disconnect(self, endpoint: str) -> None:
        """Close the socket to an evicted peer (pending frames are discarded)."""
        with self._lock:
            sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self, flush_s: float = 0.2) -> None:
        """Close every socket, giving queued frames (a goodbye) ``flush_s`` to leave; idempotent.
        Called by the manager after its control thread stopped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            socks = list(self._push.values())
            self._push.clear()
        for s in socks:
            s.close(linger=int(flush_s * 1000))
        self._pull.close(linger=0)
        self._ctx.term()
