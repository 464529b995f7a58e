"""Bootstrap service: where prefill ranks publish their control-plane address.

Every prefill rank (one process per ``(tp_rank, pp_rank, dp_rank)``) registers a
:class:`RankInfo` with the bootstrap service when it starts; decode ranks look up all ranks of
the data-parallel rank they talk to, retrying while registration is incomplete.

The service is a small JSON-over-HTTP server built on :mod:`aiohttp`. By default prefill rank 0
runs it inside its own process (:class:`BootstrapServer` runs its event loop in a daemon
thread); ``kvwire bootstrap`` runs it standalone. :class:`BootstrapClient` uses
:mod:`urllib.request` synchronously with explicit timeouts; it is meant to be called from
kvwire's background threads, never from an event loop.

HTTP API (all bodies JSON):

* ``PUT /v1/ranks`` (body: a :class:`RankInfo`) registers a rank, replacing an earlier
  incarnation of the same ``(dp, tp, pp)`` rank.
* ``DELETE /v1/ranks`` (body: a :class:`RankInfo`) removes a rank if its session matches.
* ``GET /v1/ranks?dp_rank=N`` answers ``{"complete": bool, "expected": int, "ranks": [...]}``.
* ``GET /health`` answers ``{"status": "ok", "registered": n}``; it needs no authentication and
  reveals no addresses.

When a shared secret is configured, every request except ``/health`` carries the headers
:data:`TIMESTAMP_HEADER`, :data:`NONCE_HEADER` (random, new for every request) and
:data:`SIGNATURE_HEADER`; the signature is
``HMAC-SHA256(secret, METHOD \\n PATH_WITH_QUERY \\n TIMESTAMP \\n NONCE \\n BODY)`` in hex.
The server refuses a timestamp more than :data:`MAX_CLOCK_SKEW_S` off its clock and, for the
requests that change state (PUT, DELETE), a nonce it has already seen within that window
(replay protection; the nonces it remembers are bounded and expire with the window).
"""

from __future__ import annotations

import errno
import http.client
import json
import logging
import secrets
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvwire.control.bootstrap_protocol import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    RankInfo,
    sign_request,
)
from kvwire.errors import BootstrapError

# RankInfo is the client's argument and answer: engines' code imports it with the client.
__all__ = ["BootstrapClient", "RankInfo"]

logger = logging.getLogger(__name__)

_SECRET_HINT = (
    "the bootstrap service at {address} refused the shared secret "
    "(check KVWIRE_SECRET on both sides)"
)


class _UnreachableError(Exception):
    """The service did not answer (timed out, reset, cut off): worth retrying."""


class _NoServiceError(_UnreachableError):
    """Nothing serves at the address: the connection was refused, the name does not
    resolve, or the host or network is unreachable. An answer, not a reason to retry: a
    decode rank given a wrong address fails the request at once."""


#: OS errors that say no service is at the address (as opposed to a slow or busy one).
_NO_SERVICE = (ConnectionRefusedError, socket.gaierror)
_NO_ROUTE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL}


def _no_service(reason: object) -> bool:
    if isinstance(reason, _NO_SERVICE):
        return True
    return isinstance(reason, OSError) and reason.errno in _NO_ROUTE


class BootstrapClient:
    """Synchronous client of the bootstrap service.

    Prefill ranks call :meth:`register` at startup and :meth:`deregister` at clean shutdown;
    decode ranks call :meth:`lookup` when they first need a prefill dp rank. Called from
    kvwire's background threads (it blocks), never from an asyncio event loop.
    """

    def __init__(
        self, address: str, secret: bytes | None = None, request_timeout_s: float = 2.0
    ) -> None:
        self.address = address
        base = address if "://" in address else f"http://{address}"
        self._base = base.rstrip("/")
        self._secret = secret or None
        self._timeout = request_timeout_s
        # The service lives inside the cluster: never route it through an environment proxy.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- public API --------------------------------------------------------------------------

    def register(self, info: RankInfo) -> None:
        """Publish (or replace) this rank's address; called by every prefill rank at startup.

        Raises :class:`BootstrapError` with the server's reason if refused or unreachable.
        """
        self._call_once("PUT", "/v1/ranks", info.model_dump_json().encode())

    def deregister(self, info: RankInfo) -> None:
        """Remove this rank; called by a prefill rank shutting down cleanly.

        A no-op on the server if a newer incarnation of the rank has already replaced it.
        """
        self._call_once("DELETE", "/v1/ranks", info.model_dump_json().encode())

    def health(self) -> dict[str, Any]:
        """``{"status": "ok", "registered": n}``; used by readiness probes and ``doctor``."""
        return self._call_once("GET", "/health", b"")

    def lookup(
        self, dp_rank: int, timeout_s: float, retry_interval_s: float = 0.05
    ) -> list[RankInfo]:
        """All prefill ranks of ``dp_rank``, sorted by ``(pp_rank, tp_rank)``.

        Called by decode ranks before their first transfer from that dp rank. Retries while
        the service answers but not every rank has registered, or does not answer in time
        (a busy service), until ``timeout_s`` passes; then raises :class:`BootstrapError`
        saying what was missing. Refusals (bad secret, bad request) and an address where
        nothing serves (connection refused, a name that does not resolve, no route) are
        raised at once, naming the address.
        """
        deadline = time.monotonic() + timeout_s
        path = f"/v1/ranks?{urllib.parse.urlencode({'dp_rank': dp_rank})}"
        last: dict[str, Any] | None = None
        unreachable: str | None = None
        while True:
            remaining = deadline - time.monotonic()
            try:
                reply = self._request("GET", path, b"", min(self._timeout, max(remaining, 0.05)))
            except _NoServiceError as e:
                raise BootstrapError(
                    f"bootstrap service unreachable at {self.address}: {e} (nothing serves "
                    "there: is the bootstrap address right, and the prefill instance up?)"
                ) from e
            except _UnreachableError as e:
                unreachable, last = str(e), None
            else:
                unreachable, last = None, reply
                ranks = [RankInfo.model_validate(r) for r in reply.get("ranks", [])]
                if reply.get("complete") and len(ranks) == reply.get("expected"):
                    return sorted(ranks, key=lambda r: (r.pp_rank, r.tp_rank))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(retry_interval_s, remaining))
        if unreachable is not None or last is None:
            raise BootstrapError(
                f"bootstrap service unreachable at {self.address} for {timeout_s:g} s: "
                f"{unreachable}"
            )
        raise BootstrapError(self._incomplete_message(dp_rank, timeout_s, last))

    # -- internals ---------------------------------------------------------------------------

    def _incomplete_message(self, dp_rank: int, timeout_s: float, reply: dict[str, Any]) -> str:
        ranks = [RankInfo.model_validate(r) for r in reply.get("ranks", [])]
        expected = int(reply.get("expected", 0))
        if not ranks and expected == 0:
            return (
                f"no prefill rank of dp_rank={dp_rank} registered with the bootstrap service "
                f"at {self.address} within {timeout_s:g} s"
            )
        first = ranks[0] if ranks else None
        missing: list[str] = []
        if first is not None:
            have = {(r.tp_rank, r.pp_rank) for r in ranks}
            missing = [
                f"(tp={tp}, pp={pp})"
                for pp in range(first.pp_size)
                for tp in range(first.tp_size)
                if (tp, pp) not in have
            ]
        where = f"; missing {', '.join(missing)}" if missing else ""
        return (
            f"only {len(ranks)} of {expected} prefill ranks of dp_rank={dp_rank} registered "
            f"with the bootstrap service at {self.address} within {timeout_s:g} s{where}"
        )

    def _call_once(self, method: str, path: str, body: bytes) -> dict[str, Any]:
        try:
            return self._request(method, path, body, self._timeout)
        except _UnreachableError as e:
            raise BootstrapError(f"bootstrap service unreachable at {self.address}: {e}") from e

    def _request(self, method: str, path: str, body: bytes, timeout: float) -> dict[str, Any]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._secret is not None and path != "/health":
            timestamp = f"{time.time():.3f}"
            nonce = secrets.token_hex(16)
            headers[TIMESTAMP_HEADER] = timestamp
            headers[NONCE_HEADER] = nonce
            headers[SIGNATURE_HEADER] = sign_request(
                self._secret, method, path, timestamp, body, nonce
            )
        req = urllib.request.Request(
            self._base + path, data=body if body else None, headers=headers, method=method
        )
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as e:
            with e:
                message = _server_message(e.read())
            if e.code == 401:
                raise BootstrapError(
                    _SECRET_HINT.format(address=self.address) + f": {message}"
                ) from None
            raise BootstrapError(
                f"bootstrap service at {self.address} refused {method} {path} "
                f"(HTTP {e.code}): {message}"
            ) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            # refused, timed out, reset, or cut off mid-reply: worth retrying
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            kind = _NoServiceError if _no_service(reason) else _UnreachableError
            raise kind(str(reason) or type(reason).__name__) from e
        try:
            reply = json.loads(payload)
        except ValueError as e:
            raise BootstrapError(
                f"bootstrap service at {self.address} sent a malformed reply to {method} {path}"
            ) from e
        if not isinstance(reply, dict):
            raise BootstrapError(
                f"bootstrap service at {self.address} sent a malformed reply to {method} {path}"
            )
        return reply


def _server_message(payload: bytes) -> str:
    """The ``error`` field of a JSON error reply, or the raw text of any other reply."""
    try:
        data = json.loads(payload)
    except ValueError:
        return payload.decode("utf-8", "replace").strip() or "(no message)"
    if isinstance(data, dict) and isinstance(error := data.get("error"), str):
        return error
    return str(data)
