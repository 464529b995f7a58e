"""The control channel's local way: frames between managers of one host over UNIX sockets.

A control frame sent over ZeroMQ to a manager on the same host crosses the sender's ZeroMQ
I/O thread, loopback TCP and the receiver's ZeroMQ I/O thread before the receiver's liveness
thread wakes: 0.17-0.24 ms one way on the 2-core development host against 0.04-0.06 ms for
a UNIX sequenced-packet socket polled by the same thread (``scripts/control_way_probe.py``);
on a GPU host a transfer request's trip fell from 0.29-0.45 to 0.23-0.25 ms
(docs/benchmarks.md, "The control channel's local way"). Every request's transfer request
and every staging grant is such a frame, on the request's path.

So each :class:`~kvwire.control.channel.ControlChannel` also listens on a UNIX
``SOCK_SEQPACKET`` socket in the abstract namespace (Linux), named ``kvwire-ctl-`` and 32
random hex digits, and announces the name in its handshake message (``Hello.local_control``,
``HelloAck.local_control``, protocol 1.13). When the handshake is done, each side connects to
the other's name; if that works, the peer shares this network namespace and every later frame
to it goes over that connection. If not (another host, another network namespace, the name
gone), frames keep going over ZeroMQ. Frames are the same bytes either way and are decoded
and checked by the same codec (MAC, freshness, size), so the way changes no guarantee:

* **Not blocking, bounded.** A send is non-blocking; a connection whose queue is full (the
  peer's liveness thread stalled) drops the frame and counts it ``send_full``, as ZeroMQ's
  high-water mark did. The queue holds ~2,700 heartbeat-sized frames (:data:`SEND_BUFFER`).
* **Order.** ZeroMQ keeps a connection's frames in order, and so does a sequenced-packet
  connection. A sender leaves the local way for ZeroMQ (for good, until the next handshake)
  only when the local way cannot take a frame at all (the peer closed it, or the frame is
  larger than :data:`MAX_LOCAL_FRAME`). Every frame it sent locally before the switch was
  queued on the receiver's connection before its first ZeroMQ frame left. The receiver takes
  a batch of ZeroMQ frames first, then every local frame queued by then, and handles the
  local ones first (:meth:`LocalInbox.drain`), so a peer's frames are handled in the order
  it sent them across the switch. A sender never goes back from ZeroMQ to the local way
  without a new handshake, whose answer comes after the peer handled its earlier frames.
* **Who can send.** Anyone in the network namespace who knows the name, as anyone there can
  reach the TCP endpoint. With a shared secret every frame is authenticated as before. The
  random name cannot be taken first by another program, and a peer's announced name is
  accepted only in kvwire's form, so a peer cannot point our frames at another program's
  socket. Abstract names vanish with their socket: a killed process leaves no file behind.
* **Resources.** At most :data:`MAX_CONNECTIONS` accepted connections: more are closed at
  once (a warning counts them), their senders go over ZeroMQ from their next frame, and the
  frames they queued before the refusal are lost. A rank has far fewer peers on its host
  than that; the cap stands against a process that opens connections to use up descriptors.
  A frame above :data:`MAX_LOCAL_FRAME` is dropped and its connection closed (kvwire never
  sends one).

Threads: :class:`LocalInbox` belongs to the liveness thread (:meth:`drain`), except
:meth:`close`, which the channel calls after that thread stopped. :class:`LocalOutbox` is used
under the channel's lock (any thread that tells). Sends and receives go through the C library
with the GIL kept (:mod:`kvwire.held_io`): each call is non-blocking.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import re
import secrets
import select
import socket
from typing import Any

from kvwire.held_io import libc_function

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_LOCAL_FRAME",
    "LocalInbox",
    "LocalOutbox",
    "SendResult",
    "supported",
    "valid_name",
]

#: The form of a local control name (without the abstract namespace's leading NUL).
NAME_RE = re.compile(r"^kvwire-ctl-[0-9a-f]{32}$")
#: Largest frame sent or taken the local way (a larger one goes over ZeroMQ).
MAX_LOCAL_FRAME = 256 << 10
#: Connections one inbox accepts at once.
MAX_CONNECTIONS = 1024
#: Frames read from one connection per drain: above what a sender's queue can hold (the
#: kernel doubles :data:`SEND_BUFFER` and charges a small frame ~770 bytes: ~2,700 frames;
#: ~11,000 at the 4 MiB ``net.core.wmem_max`` a sender may ask for), so one drain takes every
#: frame a connection had queued (the order rule needs it); it bounds a flood.
MAX_FRAMES_PER_CONNECTION = 32768
#: ``SO_SNDBUF`` asked for each outgoing connection: its queued frames are charged to it.
SEND_BUFFER = 1 << 20

_FLAGS_SEND = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_NOSIGNAL", 0)
_FLAGS_RECV = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_TRUNC", 0)


def supported() -> bool:
    """Whether this platform has what the local way needs (Linux: abstract UNIX names,
    sequenced-packet sockets, epoll)."""
    return (
        hasattr(socket, "AF_UNIX")
        and hasattr(socket, "SOCK_SEQPACKET")
        and hasattr(select, "epoll")
        and hasattr(socket, "MSG_DONTWAIT")
    )


def valid_name(name: object) -> bool:
    """Whether ``name`` is a local control name as kvwire makes them."""
    return isinstance(name, str) and NAME_RE.match(name) is not None


def _send_fn() -> Any:
    return libc_function(
        "send", [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_ssize_t
    )


def _recv_fn() -> Any:
    return libc_function(
        "recv", [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_ssize_t
    )


class LocalInbox:
    """This channel's listening socket and the connections peers opened to it (see the
    module). :attr:`name` is None where the way is off (not Linux, or the socket could not be
    made); nothing else is called then but :meth:`close`."""

    def __init__(self, agent: str) -> None:
        self._agent = agent
        self.name: str | None = None
        self._conns: dict[int, socket.socket] = {}
        self._listener: socket.socket | None = None
        self._ep: Any = None
        #: Connections refused for MAX_CONNECTIONS (tests, the warning's count).
        self.refused = 0
        if not supported():
            return
        name = "kvwire-ctl-" + secrets.token_hex(16)
        try:
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as exc:
            logger.debug("%s: no local control socket (%s)", agent, exc)
            return
        try:
            lst.bind("\0" + name)
            lst.listen(128)
            lst.setblocking(False)
            self._ep = select.epoll()
            self._ep.register(lst.fileno(), select.EPOLLIN)
        except OSError as exc:
            logger.debug("%s: no local control socket (%s)", agent, exc)
            lst.close()
            if self._ep is not None:
                self._ep.close()
                self._ep = None
            return
        self._listener = lst
        self._buf = ctypes.create_string_buffer(MAX_LOCAL_FRAME + 1)
        self._recv = _recv_fn()
        self.name = name

    def fileno(self) -> int:
        """A descriptor that turns readable when a frame or a connection waits (the channel's
        poller watches it beside ZeroMQ's socket). Only while :attr:`name` is set."""
        assert self._ep is not None
        fd: int = self._ep.fileno()
        return fd

    @property
    def connections(self) -> int:
        """Connections open now (tests, leak checks)."""
        return len(self._conns)

    def drain(self) -> tuple[list[bytes], int]:
        """Liveness thread, after it took its batch of ZeroMQ frames: every frame queued on
        this inbox's connections now, each connection's in order (a new connection is
        accepted and read in the same call), and how many packets above
        :data:`MAX_LOCAL_FRAME` were dropped (each with its connection)."""
        if self._ep is None or self._listener is None:
            return [], 0
        frames: list[bytes] = []
        oversized = 0
        lfd = self._listener.fileno()
        ready = self._ep.poll(0, MAX_CONNECTIONS + 1)
        fresh: list[int] = []
        for fd, _ in ready:
            if fd == lfd:
                fresh.extend(self._accept())
            else:
                oversized += self._read(fd, frames)
        for fd in fresh:
            oversized += self._read(fd, frames)
        return frames, oversized

    def _accept(self) -> list[int]:
        lst = self._listener
        assert lst is not None and self._ep is not None
        fds: list[int] = []
        while True:
            try:
                conn, _ = lst.accept()
            except (BlockingIOError, InterruptedError):
                return fds
            except OSError as exc:  # ECONNABORTED, EMFILE: try again on the next turn
                logger.debug("%s: local control accept failed: %s", self._agent, exc)
                return fds
            if len(self._conns) >= MAX_CONNECTIONS:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    logger.warning(
                        "%s: refused a local control connection: %d open already (%d refused); "
                        "its sender goes over ZeroMQ",
                        self._agent,
                        MAX_CONNECTIONS,
                        self.refused,
                    )
                conn.close()
                continue
            conn.setblocking(False)
            fd = conn.fileno()
            self._conns[fd] = conn
            self._ep.register(fd, select.EPOLLIN)
            fds.append(fd)

    def _read(self, fd: int, out: list[bytes]) -> int:
        """Append the frames queued on connection ``fd`` to ``out``; 1 if it sent a packet
        above the limit (the connection is dropped then), else 0."""
        conn = self._conns.get(fd)
        if conn is None:
            return 0
        for _ in range(MAX_FRAMES_PER_CONNECTION):
            n = self._recv_one(conn)
            if n is None:  # nothing more now
                return 0
            if n <= 0:  # the peer closed it (or an empty packet, which kvwire never sends)
                self._drop(fd)
                return 0
            if n > MAX_LOCAL_FRAME:
                self._drop(fd)
                return 1
            out.append(ctypes.string_at(self._buf, n))
        return 0

    def _recv_one(self, conn: socket.socket) -> int | None:
        """One packet into the buffer: its full length (larger than the buffer when it was
        cut), 0 or less when the connection ended, None when none waits."""
        for _ in range(8):  # a signal may interrupt the call (EINTR): ask again
            if self._recv is not None:
                n: int = self._recv(conn.fileno(), self._buf, MAX_LOCAL_FRAME + 1, _FLAGS_RECV)
                if n >= 0:
                    return n
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                return None if err in (errno.EAGAIN, errno.EWOULDBLOCK) else -1
            try:
                view = memoryview(self._buf).cast("B")
                return conn.recv_into(view, MAX_LOCAL_FRAME + 1, _FLAGS_RECV)
            except InterruptedError:
                continue
            except BlockingIOError:
                return None
            except OSError:
                return -1
        return None

    def _drop(self, fd: int) -> None:
        conn = self._conns.pop(fd, None)
        if conn is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._ep.unregister(fd)
        conn.close()

    def close(self) -> None:
        """Close the listener and every connection (the channel's close, after the liveness
        thread stopped). Idempotent."""
        for fd in list(self._conns):
            self._drop(fd)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._ep is not None:
            self._ep.close()
            self._ep = None
        self.name = None


class SendResult:
    """What :meth:`LocalOutbox.send` did with a frame."""

    SENT = "sent"
    #: The connection's queue is full: the frame is dropped (``send_full``).
    FULL = "full"
    #: The local way cannot take it: send it, and every later frame, over ZeroMQ.
    LEAVE = "leave"


class LocalOutbox:
    """Connections to peers' inboxes, by the peer's control endpoint (see the module). Used
    under the channel's lock."""

    def __init__(self, agent: str) -> None:
        self._agent = agent
        self._out: dict[str, socket.socket] = {}
        self._send = _send_fn() if supported() else None
        #: Frames sent this way, and peers this way was left for (tests, benchmarks).
        self.sent = 0
        self.left = 0

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self._out

    def connect(self, endpoint: str, name: str) -> bool:
        """After a handshake with the peer at ``endpoint``, which announced local control name
        ``name``: connect to it; True if frames to the peer go this way from now on. False
        (ZeroMQ as before) when the name is not kvwire's, is not reachable here (another host
        or network namespace), or the platform has no local way."""
        self.forget(endpoint)
        if not supported() or not valid_name(name):
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            sock.connect("\0" + name)
        except OSError as exc:
            sock.close()
            logger.debug("%s: no local control way to %s (%s)", self._agent, endpoint, exc)
            return False
        self._out[endpoint] = sock
        logger.debug("%s: control frames to %s go over the local socket", self._agent, endpoint)
        return True

    def send(self, endpoint: str, frame: bytes) -> str | None:
        """Send ``frame`` to the peer at ``endpoint`` this way without blocking: a
        :class:`SendResult`, or None when this way does not go to that peer."""
        sock = self._out.get(endpoint)
        if sock is None:
            return None
        if len(frame) > MAX_LOCAL_FRAME:
            self._leave(endpoint, "a frame too large for it")
            return SendResult.LEAVE
        err = 0
        if self._send is not None:
            n = self._send(sock.fileno(), frame, len(frame), _FLAGS_SEND)
            if n < 0:
                err = ctypes.get_errno()
        else:
            try:
                sock.send(frame, _FLAGS_SEND)
            except OSError as exc:
                err = exc.errno or errno.EIO
        if err == 0:
            self.sent += 1
            return SendResult.SENT
        if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EINTR):
            return SendResult.FULL
        self._leave(endpoint, errno.errorcode.get(err, str(err)))
        return SendResult.LEAVE

    def _leave(self, endpoint: str, why: str) -> None:
        self.left += 1
        logger.info(
            "%s: control frames to %s go over ZeroMQ from now on (the local socket: %s)",
            self._agent,
            endpoint,
            why,
        )
        self.forget(endpoint)

    def forget(self, endpoint: str) -> None:
        """Close the connection to ``endpoint`` (evicted, left, or a new handshake)."""
        sock = self._out.pop(endpoint, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Close every connection. Idempotent."""
        for ep in list(self._out):
            self.forget(ep)
