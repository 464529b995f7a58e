"""A non-blocking datagram send that keeps the GIL (local notes, :mod:`.local_notes`).

Python's ``socket.sendto`` lets go of the GIL around the system call, even with
``MSG_DONTWAIT`` on a UNIX datagram socket, where the call takes a few microseconds and never
waits. In a busy rank process a thread waiting for the GIL (the engine's scheduler, which
runs Python without pause) takes it in that gap, and the sender then waits for it until the
switch interval makes that thread give it back: up to 5 ms per note at the interpreter's
default. The note is sent by a ``cudaipc`` transfer worker or kernel watcher, so that wait
was in every request's path (py-spy put the send at 5-6% of the worker's wall time at C=8;
docs/benchmarks.md, "Session 27").

:class:`HeldSender` makes the same ``sendto(2)`` through a ``ctypes.PyDLL`` handle of the C
library, whose calls keep the GIL. It is used only where the call cannot block (the socket
flag and the non-blocking send); where the C library or ``sendto`` cannot be found (not
Linux), :attr:`HeldSender.ok` is False and the caller keeps Python's ``sendto``. Any thread
(the destination addresses are cached under a lock).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import socket
import threading
from typing import Any

from kvwire.held_io import libc_function

logger = logging.getLogger(__name__)

__all__ = ["HeldSender"]


class _SockaddrUn(ctypes.Structure):
    _fields_ = [("sun_family", ctypes.c_ushort), ("sun_path", ctypes.c_char * 108)]


#: Bytes of ``sockaddr_un`` before the path.
_PATH_OFFSET = _SockaddrUn.sun_path.offset


def _libc_sendto() -> Any:
    """The C library's ``sendto`` as a ``PyDLL`` function, or None (:mod:`kvwire.held_io`)."""
    return libc_function(
        "sendto",
        [
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_uint32,
        ],
        ctypes.c_ssize_t,
    )


class HeldSender:
    """``sendto(fd, datagram, MSG_DONTWAIT, path)`` on one UNIX datagram socket, the GIL kept."""

    def __init__(self, sock: socket.socket) -> None:
        self._fd = sock.fileno()
        self._fn = _libc_sendto() if hasattr(socket, "AF_UNIX") else None
        self._addrs: dict[str, tuple[_SockaddrUn, int]] = {}
        self._lock = threading.Lock()

    @property
    def ok(self) -> bool:
        """Whether sends go this way (else the caller uses Python's ``sendto``)."""
        return self._fn is not None

    def _addr(self, path: str) -> tuple[_SockaddrUn, int]:
        got = self._addrs.get(path)
        if got is None:
            raw = path.encode()
            if len(raw) >= 108:
                raise OSError(errno.ENAMETOOLONG, f"socket path too long: {path!r}")
            sa = _SockaddrUn(socket.AF_UNIX, raw)
            got = (sa, _PATH_OFFSET + len(raw) + 1)
            with self._lock:
                if len(self._addrs) > 4096:  # peers come and go; never grow without bound
                    self._addrs.clear()
                self._addrs[path] = got
        return got

    def send(self, path: str, datagram: bytes) -> None:
        """Hand ``datagram`` to the socket at ``path`` now, or raise OSError (EAGAIN: its
        queue is full; ECONNREFUSED, ENOENT: gone or not visible from here), as Python's
        ``sendto`` with ``MSG_DONTWAIT`` would."""
        assert self._fn is not None
        sa, size = self._addr(path)
        sent = self._fn(
            self._fd, datagram, len(datagram), socket.MSG_DONTWAIT, ctypes.byref(sa), size
        )
        if sent < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sendto: {errno.errorcode.get(err, err)}")
        if sent != len(datagram):  # a datagram goes whole or not at all
            raise OSError(errno.EMSGSIZE, f"sendto sent {sent} of {len(datagram)} bytes")
