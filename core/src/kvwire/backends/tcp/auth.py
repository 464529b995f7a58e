"""Authentication of the ``tcp`` backend's data plane: ZeroMQ CURVE with keys derived from
the shared secret.

With a secret, a rank's ROUTER is a CURVE server and every DEALER it opens is a CURVE client;
both key pairs follow from the secret (:func:`kvwire.security.curve_keys`). A ZAP handler
(pyzmq's :class:`~zmq.auth.thread.ThreadAuthenticator`, one thread per backend) admits only
clients that present the derived client key, so a connection that cannot prove it holds the
secret is closed during the handshake: its requests never reach the backend's I/O loop, let
alone its memory. CURVE also encrypts and authenticates every frame (no tampering, no replay
within a connection).

Why CURVE and not a handshake of our own: it is ZeroMQ's maintained, reviewed mechanism
(CurveZMQ, built on libsodium's Curve25519/XSalsa20-Poly1305), it needs no change to the
frames, and it protects every message of a connection, not only its start.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvwire.security import CurveKeys, curve_keys

logger = logging.getLogger(__name__)

#: ZAP domain of the data plane's server sockets.
ZAP_DOMAIN = "kvwire-tcp"


class _OnlyKey:
    """ZAP credentials provider: admits one client public key (Z85). Called on the
    authenticator's thread."""

    def __init__(self, allowed: bytes, agent: str) -> None:
        self._allowed = allowed
        self._agent = agent
        #: Connections refused because their client key was not the derived one.
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self._allowed
        if not ok:
            self.refused += 1
            logger.warning(
                "%s: refused a tcp data-plane connection whose CURVE key does not derive from "
                "the shared secret (%d refused so far); is KVWIRE_SECRET the same everywhere?",
                self._agent,
                self.refused,
            )
        return ok


class DataPlaneAuth:
    """The CURVE setup of one ``tcp`` backend. Created and closed by the backend's owner
    (the engine's thread); :meth:`secure_client` runs on the backend's I/O thread."""

    def __init__(self, ctx: zmq.Context[Any], secret: bytes, agent: str) -> None:
        self.keys: CurveKeys = curve_keys(secret)
        self._provider = _OnlyKey(self.keys.client_public, agent)
        self._auth = ThreadAuthenticator(ctx, log=logger)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self._provider)

    @property
    def refused(self) -> int:
        """Connections refused for a wrong key."""
        return self._provider.refused

    def secure_server(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (before it binds) a CURVE server that asks this ZAP handler."""
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.server_secret)

    def secure_client(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (before it connects) a CURVE client with the derived keys."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.client_secret)

    def close(self) -> None:
        """Stop the ZAP thread (before the context is terminated)."""
        self._auth.stop()
