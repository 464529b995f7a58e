"""Exception hierarchy of kvwire.

Every error names what is wrong and, where there is one, how to fix it. Callers can catch
:class:`KVWireError` for anything raised by kvwire itself.
"""

from __future__ import annotations


class KVWireError(Exception):
    """Base class of every error raised by kvwire."""


class ConfigError(KVWireError, ValueError):
    """A configuration value or option is invalid."""


class LayoutError(KVWireError, ValueError):
    """A KV layout or memory region is malformed, or two layouts cannot work together."""


class PluginError(KVWireError):
    """A plugin could not be found, loaded or registered."""


class UnknownNameError(PluginError, LookupError):
    """A backend, mapper or staging strategy name is not registered."""


class CapabilityError(KVWireError):
    """The selected implementation lacks a capability the configuration needs."""


class DescriptorError(KVWireError, ValueError):
    """A descriptor table or index array is malformed or out of range."""


class HandleError(KVWireError):
    """A transfer handle or prepared table was used after release, or released twice."""


class TransferError(KVWireError):
    """A transfer failed.

    Carries the request ``room``, the ``peer`` and the ``operation`` it was part of, when known,
    so that the control plane can fail the right request on both sides.
    """

    def __init__(
        self,
        message: str,
        *,
        room: int | None = None,
        peer: str | None = None,
        operation: str | None = None,
    ) -> None:
        parts = [message]
        ctx = []
        if room is not None:
            ctx.append(f"room={room}")
        if peer is not None:
            ctx.append(f"peer={peer}")
        if operation is not None:
            ctx.append(f"op={operation}")
        if ctx:
            parts.append(f"[{', '.join(ctx)}]")
        super().__init__(" ".join(parts))
        self.room = room
        self.peer = peer
        self.operation = operation


class PeerError(TransferError):
    """A remote peer is unknown, was removed, or is unreachable."""


class BootstrapError(KVWireError):
    """The bootstrap service could not be reached, refused a request, or the prefill instance's
    ranks did not all register before the deadline."""


class ProtocolError(KVWireError, ValueError):
    """A control message is malformed, of an unsupported protocol version, or unauthenticated."""


class HandshakeError(KVWireError):
    """A peer refused the handshake (incompatible layout or version), or the handshake timed
    out."""
