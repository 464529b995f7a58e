"""What the parent (:class:`~kvwire.testing.remote.RemoteAgent`) and the child process
(:mod:`kvwire.testing.remote_child`) of a remote agent agree on: the errors a call can end
with, how a buffer is filled and digested, and the records of a buffer and a notification.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from kvwire.layout import MemoryRegion

#: How often the child drives ``progress()`` / ``get_notifications()`` while idle.
POLL_INTERVAL_S = 0.001

#: How a buffer is initialised: ``None`` zeros, an ``int`` seeds random bytes, ``bytes`` repeat.
Fill = int | bytes | None


class RemoteAgentError(RuntimeError):
    """The remote agent process could not serve a call."""


class RemoteAgentDiedError(RemoteAgentError):
    """The remote agent process is gone (it crashed, exited or was killed)."""


class RemoteAgentTimeoutError(RemoteAgentError):
    """The remote agent process did not answer in time (it may be stuck or suspended)."""


class RemoteCallError(RemoteAgentError):
    """A command failed in the child with an exception that could not be sent back as is."""


def fill_bytes(nbytes: int, fill: Fill = None) -> NDArray[np.uint8]:
    """A new writable ``uint8`` array of ``nbytes`` initialised as ``fill`` says.

    The same ``(nbytes, fill)`` gives the same bytes in every process, so a test can model a
    remote buffer's content without copying it over the pipe.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    if fill is None:
        return np.zeros(nbytes, dtype=np.uint8)
    if isinstance(fill, bool):
        raise TypeError("fill must be None, an int seed or a bytes pattern, not bool")
    if isinstance(fill, int):
        rng = np.random.default_rng(fill)
        return np.frombuffer(bytearray(rng.bytes(nbytes)), dtype=np.uint8)
    if isinstance(fill, bytes | bytearray):
        if not fill:
            raise ValueError("a fill pattern must not be empty")
        pattern = np.frombuffer(bytes(fill), dtype=np.uint8)
        return np.tile(pattern, -(-nbytes // pattern.size))[:nbytes].copy()
    raise TypeError(f"fill must be None, an int seed or a bytes pattern, got {type(fill).__name__}")


def digest(data: Any) -> str:
    """Hex BLAKE2b digest (16 bytes) of a bytes-like object or contiguous array."""
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(bytes(view))
    return hashlib.blake2b(view.cast("B"), digest_size=16).hexdigest()


def sampled_digest(data: NDArray[np.uint8], stride: int = 1) -> str:
    """The digest a notification snapshot holds for ``data`` watched with ``stride``."""
    return digest(np.ascontiguousarray(data[::stride]))


@dataclass(frozen=True)
class RemoteBuffer:
    """A buffer held by the child: ``nbytes`` at ``addr``, of which ``region`` is registered."""

    name: str
    addr: int
    nbytes: int
    region: MemoryRegion | None

    @property
    def end(self) -> int:
        """One past the buffer's last byte."""
        return self.addr + self.nbytes


class RemoteNotification(NamedTuple):
    """A notification drained by the child, with digests of its watched buffers taken then."""

    peer: str
    payload: bytes
    #: ``{buffer name: digest}`` of every watched buffer, snapshotted when the notification
    #: was drained: :func:`digest` of ``buf[offset:offset + length:stride]`` as watched
    #: (:func:`sampled_digest` computes the expected value).
    digests: dict[str, str]
