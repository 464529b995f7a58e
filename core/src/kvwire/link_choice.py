"""What a rank knows of a peer when it picks a transfer backend for the link, and the pick.

Used by :meth:`kvwire.backend.TransferBackend.add_link` (prefill, at handshake), logged once
per link and shown by ``kvwire doctor`` (docs/failover.md).
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass, field


def host_identity() -> dict[str, str]:
    """This host's identity for the handshake: its boot id (differs between hosts and between
    boots) and its hostname. Two ranks are on one host when both match."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return {"boot_id": boot, "hostname": socket.gethostname()}


@dataclass(frozen=True)
class PeerFacts:
    """What a rank knows of a peer when it chooses a backend for the link to it (prefill,
    at handshake): the peer's host identity from the handshake (``{"boot_id", "hostname"}``,
    empty from peers older than protocol 1.8) and the metadata the peer published for the
    backend being asked."""

    host: dict[str, str]
    metadata: bytes


@dataclass(frozen=True)
class LinkChoice:
    """Which backend a link uses, the fallbacks both sides share (in order), and why every
    other offer was passed over (``{backend: reason}``). Returned by
    :meth:`TransferBackend.add_link`."""

    peer: str
    backend: str
    fallbacks: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the log and ``kvwire doctor``."""
        out = f"backend {self.backend}"
        if self.fallbacks:
            out += f" (fallbacks: {', '.join(self.fallbacks)})"
        if self.skipped:
            out += "; skipped " + "; ".join(f"{k}: {v}" for k, v in self.skipped.items())
        return out
