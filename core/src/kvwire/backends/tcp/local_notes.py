"""Notes between ``tcp`` backends of one host, over a UNIX datagram socket.

A note (a notification alone, no rows: what ``cudaipc`` sends once its kernel ended) sent
over ZeroMQ to a peer on the same host crosses four threads: the sender's ZeroMQ I/O thread,
the loopback TCP stack, the receiver's ZeroMQ I/O thread and the receiver's Python I/O thread,
before the thread that handles notifications is woken. Measured one way between two
processes on the 2-core development host: 0.11-0.14 ms p50 that way, 0.02 ms from a datagram
send to the same waiting thread (``scripts/note_latency.py``; docs/benchmarks.md).

So each backend whose class sends notes alone (``TcpBackend.sends_notes``: ``cudaipc``)
binds a datagram socket in a private directory (mode 0700: only processes of the same user,
which could read the engine's memory anyway, can send to it) and publishes its path with its
host identity in the backend metadata. A sender whose peer is on its host
(same boot id and hostname) sends a note there from the thread that queues it, without
blocking; when the datagram cannot be handed over at once (the receiver's queue is full, it
closed, the path is not visible from here: another container) the caller sends the note the
ZeroMQ way instead, so no note is lost. UNIX datagrams are reliable: once accepted, a note is
delivered. Notes on the two ways are not ordered with each other, as notes were not ordered
with a peer's data socket before.

Threads: one receiver thread per backend (blocked in ``recv`` outside the GIL), which hands
each datagram to the backend's ``deliver`` callback. :meth:`LocalNotes.send` may be called
from any thread (a datagram socket's ``sendto`` is atomic per message); it sends with the GIL
kept where it can (:mod:`.held_send`), under a lock that :meth:`LocalNotes.close` takes before
it closes the socket (a raw send must never reach a reused descriptor).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from kvwire.backends.tcp.held_send import HeldSender

logger = logging.getLogger(__name__)

__all__ = ["MAX_NOTE_BYTES", "PREFIX", "LocalNotes", "peer_notes_path", "remove_stale"]

#: Largest note sent this way (a larger one goes over ZeroMQ): far above a note with its aux
#: row, far below the kernel's datagram limit.
MAX_NOTE_BYTES = 64 << 10


#: The name of every notes socket's directory starts so (the metadata check relies on it).
PREFIX = "kvwire-notes-"
#: A directory whose socket nobody is bound to is removed once it is this old (a process
#: killed before its close left it; a younger one may be a backend between mkdir and bind).
STALE_AFTER_S = 60.0


def remove_stale(folder: str | None = None) -> int:
    """Remove this user's notes directories (in ``folder``, the temporary directory by
    default) whose socket no process is bound to any more and that are older than
    :data:`STALE_AFTER_S`: what backends killed without a close left behind. A socket is
    probed with ``connect``, which sends nothing. Returns how many were removed. Called when
    a backend binds its own; any thread."""
    folder = folder or tempfile.gettempdir()
    removed = 0
    now = time.time()
    try:
        names = [n for n in os.listdir(folder) if n.startswith(PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(folder, name)
        try:
            st = os.stat(path)
            if st.st_uid != os.getuid() or now - st.st_mtime < STALE_AFTER_S:
                continue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                probe.connect(os.path.join(path, "n"))
                continue  # someone is bound there
            except OSError:
                pass  # refused or missing: nobody
            finally:
                probe.close()
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


def peer_notes_path(meta: dict[str, Any], host: dict[str, str]) -> str | None:
    """Where notes go to the peer of backend metadata ``meta`` (seen from a backend on host
    ``host``): its notes socket when it offers one (``notes_path``) and runs on this host
    (its ``host``: same boot id and hostname), else None. ``ValueError`` for a path that is
    not a kvwire notes socket: a peer must not point our notes at another program's socket.
    Called when the peer is added."""
    path = meta.get("notes_path")
    if path is None or meta.get("host") != host:
        return None
    if (
        not isinstance(path, str)
        or not path.startswith("/")
        or len(path.encode()) > 100
        or os.path.basename(path) != "n"
        or not os.path.basename(os.path.dirname(path)).startswith(PREFIX)
    ):
        raise ValueError(f"tcp metadata notes_path {path!r} is not a kvwire notes socket")
    return path


class LocalNotes:
    """This backend's datagram socket for notes from peers on its host, and the sending side
    for notes to theirs (see the module).

    ``deliver(datagram)`` is called on the receiver thread for every datagram that arrives; it
    must not raise (the backend parses and counts bad ones). When the socket cannot be bound
    (no UNIX sockets, a temporary directory path too long for one) :attr:`address` is None and
    every :meth:`send` returns False."""

    def __init__(self, agent_name: str, deliver: Callable[[bytes], None]) -> None:
        self._deliver = deliver
        self._name = agent_name
        self._closing = threading.Event()
        self._dir: str | None = None
        self._rx: socket.socket | None = None
        self._tx: socket.socket | None = None
        self._held: HeldSender | None = None
        #: Held by a send while it uses the sending socket, and by close() to close it.
        self._tx_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        #: The path peers send to (None: this way is off here).
        self.address: str | None = None
        #: Notes handed to a peer's socket this way, and sends that fell back (approximate
        #: under concurrent senders; read by tests and benchmarks).
        self.sent = 0
        self.fallbacks = 0
        if not hasattr(socket, "AF_UNIX"):
            return
        remove_stale()
        try:
            self._dir = tempfile.mkdtemp(prefix=PREFIX)
            path = os.path.join(self._dir, "n")
            self._rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._rx.bind(path)
            self._tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._held = HeldSender(self._tx)
        except OSError as exc:
            logger.debug("%s: no local note socket (%s); notes go over ZeroMQ", agent_name, exc)
            self.close()
            return
        self.address = path
        self._thread = threading.Thread(
            target=self._receive, name=f"kvwire-notes-{agent_name}", daemon=True
        )
        self._thread.start()

    def _receive(self) -> None:
        """Receiver thread: hand every datagram to ``deliver`` until :meth:`close`."""
        rx = self._rx
        assert rx is not None
        while True:
            try:
                data = rx.recv(MAX_NOTE_BYTES + 1)
            except OSError as exc:  # not seen in practice; queued notes wait for the retry
                if self._closing.wait(0.01):
                    return
                logger.warning("%s: local notes receive failed: %s; retrying", self._name, exc)
                continue
            if self._closing.is_set():
                return
            self._deliver(data)

    def send(self, address: str, datagram: bytes) -> bool:
        """Any thread: hand ``datagram`` to the socket at ``address`` without blocking; False
        when it cannot be handed over now (the caller sends the note another way)."""
        if len(datagram) > MAX_NOTE_BYTES:
            self.fallbacks += 1
            return False
        try:
            with self._tx_lock:
                tx, held = self._tx, self._held
                if tx is None:
                    raise OSError("closed")
                if held is not None and held.ok:  # the GIL kept: no hand-off mid-send
                    held.send(address, datagram)
                else:
                    tx.sendto(datagram, socket.MSG_DONTWAIT, address)
        except OSError:  # full (EAGAIN), gone (ECONNREFUSED), not visible here (ENOENT)
            self.fallbacks += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        """Backend close: stop the receiver thread, close both sockets, remove the directory.
        Idempotent."""
        self._closing.set()
        with self._tx_lock:
            rx, tx = self._rx, self._tx
            self._rx = self._tx = None
            self._held = None
        if rx is not None:
            with contextlib.suppress(OSError):
                rx.shutdown(socket.SHUT_RDWR)  # wakes the blocked recv
            if self._thread is not None:
                self._thread.join(2.0)
            rx.close()
        if tx is not None:  # no send uses it any more (each holds the lock while it does)
            tx.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.address = None
