"""What kvwire does about who may talk to a rank: the shared-secret policy, exposure warnings,
and the keys derived from the secret. See ``docs/security.md`` for the threat model.

* :func:`enforce_secret_policy` refuses to start a rank when ``require_secret`` is set and no
  secret is (called when the backend is selected, the first thing a manager does with its
  configuration, and by ``kvwire bootstrap``).
* :func:`warn_if_exposed` logs one WARNING per endpoint kind and process when an endpoint
  listens on a non-loopback address without a secret (called by whoever binds it: the control
  channel, the ``tcp`` backend, the bootstrap service).
* :func:`curve_keys` derives the ``tcp`` data plane's CURVE key pairs from the secret, so that
  the one secret operators already distribute is all they need.
* :func:`exposure_checks` is what ``kvwire doctor`` reports.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvwire.errors import ConfigError

if TYPE_CHECKING:
    from kvwire.config import KVWireConfig

logger = logging.getLogger(__name__)

#: How to make a secret, quoted in errors and warnings.
SECRET_HOWTO = (
    "set KVWIRE_SECRET to the same random value (e.g. the output of "
    "`python -c 'import secrets; print(secrets.token_hex(32))'`) on every prefill and decode "
    "instance and on the bootstrap service"
)

_warned: set[str] = set()
_warned_lock = threading.Lock()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 in brackets or not) only reaches this
    machine. Wildcards (``0.0.0.0``, ``::``, ``*``) and unknown names are not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(what: str, host: str, authenticated: bool) -> bool:
    """Log a WARNING, once per ``what`` per process, when ``what`` listens on ``host``, which
    is not loopback, without a shared secret. Returns whether the endpoint is exposed (warned
    now or before). Called by the thread that binds the endpoint."""
    if authenticated or is_loopback(host):
        return False
    with _warned_lock:
        if what in _warned:
            return True
        _warned.add(what)
    logger.warning(
        "kvwire %s listens on %s without a shared secret: anyone who can reach this address "
        "can send it requests (evict peers, replace registrations, read or write registered "
        "KV memory on the tcp backend). %s, or bind it to 127.0.0.1, or set "
        "KVWIRE_REQUIRE_SECRET=1 to refuse to start like this",
        what,
        host,
        SECRET_HOWTO,
    )
    return True


def reset_exposure_warnings() -> None:
    """Forget which warnings were logged (tests)."""
    with _warned_lock:
        _warned.clear()


def enforce_secret_policy(require_secret: bool, secret: bytes | None, where: str) -> None:
    """Raise :class:`ConfigError` when a secret is required but none (or an empty one) is set.
    ``where`` names what refuses to start. Called at startup, on the engine's thread."""
    if require_secret and not secret:
        raise ConfigError(
            f"{where} refuses to start: require_secret is set (KVWIRE_REQUIRE_SECRET) but no "
            f"shared secret is configured; {SECRET_HOWTO}, or unset KVWIRE_REQUIRE_SECRET"
        )


def hkdf_sha256(secret: bytes, info: bytes, length: int = 32, salt: bytes = b"kvwire") -> bytes:
    """HKDF-SHA256 (RFC 5869, extract then expand) of ``secret``: an independent key for each
    ``info`` label, so the data plane's CURVE keys share no key material with each other or
    with the control-plane HMAC (which keys on the secret itself)."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE key pairs of the ``tcp`` data plane: every rank serves with the server
    pair and connects with the client pair; both follow from the shared secret alone."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_keys(secret: bytes) -> CurveKeys:
    """Derive the data plane's CURVE key pairs from ``secret`` (deterministic: every holder of
    the secret derives the same keys, nobody else can). Any 32 bytes are a valid Curve25519
    secret key (libsodium clamps them)."""
    import zmq
    from zmq.utils import z85

    server_secret = z85.encode(hkdf_sha256(secret, b"kvwire tcp data plane: server key"))
    client_secret = z85.encode(hkdf_sha256(secret, b"kvwire tcp data plane: client key"))
    return CurveKeys(
        server_public=zmq.curve_public(server_secret),
        server_secret=server_secret,
        client_public=zmq.curve_public(client_secret),
        client_secret=client_secret,
    )


@dataclass(frozen=True)
class ExposureCheck:
    """One line of ``kvwire doctor``'s security section."""

    subject: str
    ok: bool
    detail: str
    fix: str = ""


def exposure_checks(config: KVWireConfig) -> list[ExposureCheck]:
    """What ``kvwire doctor`` says about ``config``'s secret and listening addresses."""
    secret = config.secret_bytes
    out = [
        ExposureCheck(
            "shared secret",
            bool(secret) or not config.require_secret,
            "set (control messages signed, bootstrap signed, tcp data plane CURVE)"
            if secret
            else "not set (KVWIRE_SECRET): every endpoint accepts unauthenticated requests"
            + (
                "; require_secret is set, so ranks will refuse to start"
                if config.require_secret
                else ""
            ),
            "" if secret else SECRET_HOWTO,
        )
    ]
    opts: dict[str, Any] = config.transfer_backend_options
    hosts = [
        ("control endpoint (control.host)", config.control.host),
        ("bootstrap service (control.bootstrap_host)", config.control.bootstrap_host),
    ]
    if isinstance(opts.get("host"), str):
        hosts.append(("data endpoint (transfer backend option host)", opts["host"]))
    for subject, host in hosts:
        exposed = not secret and not is_loopback(host)
        out.append(
            ExposureCheck(
                subject,
                not exposed,
                f"listens on {host}"
                + (" without a secret: reachable by anyone on the network" if exposed else ""),
                f"{SECRET_HOWTO}, or bind it to 127.0.0.1" if exposed else "",
            )
        )
    return out
