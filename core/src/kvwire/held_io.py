"""C library socket calls that keep the GIL, for sends and receives that never wait.

Python's socket methods let go of the GIL around every system call, even a non-blocking one
on a UNIX socket, where the call takes a few microseconds. In a rank process whose engine
thread runs Python without pause, that thread takes the GIL in the gap and the caller waits
for it until the switch interval makes the engine give it back: up to 5 ms per call at the
interpreter's default (docs/benchmarks.md, "Session 27"). A ``ctypes.PyDLL`` function keeps
the GIL for the call, which is right only where the call cannot block: callers pass
``MSG_DONTWAIT``.

Used by local notes (:mod:`kvwire.backends.tcp.held_send`) and the control channel's local
way (:mod:`kvwire.control.local_way`). Where the C library or a function cannot be found (not
Linux) :func:`libc_function` returns None and the caller keeps Python's socket method. Any
thread: each function is looked up once per process, under a lock.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["libc_function"]

_lookup = threading.Lock()
#: name -> the PyDLL function, or False once its lookup failed.
_found: dict[str, Any] = {}


def libc_function(name: str, argtypes: list[Any], restype: Any) -> Any:
    """The C library's ``name`` as a ``PyDLL`` function with ``errno`` kept
    (``ctypes.get_errno``), typed with ``argtypes`` and ``restype``; None where it cannot be
    found. The first lookup of a name fixes its types."""
    fn = _found.get(name)
    if fn is None:
        with _lookup:
            fn = _found.get(name)
            if fn is None:
                try:
                    fn = getattr(ctypes.PyDLL(None, use_errno=True), name)
                    fn.argtypes = argtypes
                    fn.restype = restype
                except (OSError, AttributeError, TypeError) as exc:
                    logger.debug("no C %s (%s): Python's socket call is used", name, exc)
                    fn = False
                _found[name] = fn
    return fn or None
