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
:data:`TIMESTAMP_HEADER` and :data:`SIGNATURE_HEADER`; the signature is
``HMAC-SHA256(secret, METHOD \\n PATH_WITH_QUERY \\n TIMESTAMP \\n BODY)`` in hex.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import http.client
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from types import TracebackType
from typing import Any

import pydantic
from aiohttp import web
from aiohttp.typedefs import Handler

from kvwire.errors import BootstrapError

logger = logging.getLogger(__name__)

#: Header carrying the request's Unix time (seconds, decimal) when a secret is configured.
TIMESTAMP_HEADER = "X-KVWire-Timestamp"
#: Header carrying the hex HMAC-SHA256 signature of the request.
SIGNATURE_HEADER = "X-KVWire-Signature"
#: Requests whose timestamp is further than this from the server's clock are refused.
MAX_CLOCK_SKEW_S = 300.0
#: Largest request body the server accepts.
MAX_BODY_BYTES = 64 * 1024
#: How long :meth:`BootstrapServer.start` waits for the socket to be bound.
_START_TIMEOUT_S = 10.0
#: How long :meth:`BootstrapServer.stop` waits for the server thread.
_STOP_TIMEOUT_S = 5.0

_SECRET_HINT = (
    "the bootstrap service at {address} refused the shared secret "
    "(check KVWIRE_SECRET on both sides)"
)

RankKey = tuple[int, int, int]  # (dp_rank, tp_rank, pp_rank)


class RankInfo(pydantic.BaseModel):
    """How to reach one prefill rank: published by that rank, read by decode ranks."""

    model_config = pydantic.ConfigDict(extra="ignore", frozen=True)

    tp_rank: int = pydantic.Field(ge=0)
    pp_rank: int = pydantic.Field(default=0, ge=0)
    dp_rank: int = pydantic.Field(default=0, ge=0)
    tp_size: int = pydantic.Field(ge=1)
    pp_size: int = pydantic.Field(default=1, ge=1)
    dp_size: int = pydantic.Field(default=1, ge=1)
    #: The rank's control-plane ZeroMQ endpoint, e.g. ``"tcp://127.0.0.1:5555"``.
    endpoint: str = pydantic.Field(min_length=1)
    #: The rank's transfer-agent name.
    agent: str = pydantic.Field(min_length=1)
    #: Random id of this process incarnation; a restarted rank has a new one.
    session: str = pydantic.Field(min_length=1)
    protocol: int = 1

    @pydantic.model_validator(mode="after")
    def _ranks_in_range(self) -> RankInfo:
        for name in ("tp", "pp", "dp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if rank >= size:
                raise ValueError(f"{name}_rank={rank} is out of range for {name}_size={size}")
        return self

    @property
    def key(self) -> RankKey:
        """``(dp_rank, tp_rank, pp_rank)``: identifies the rank across incarnations."""
        return (self.dp_rank, self.tp_rank, self.pp_rank)

    def describe(self) -> str:
        """Short human-readable name of the rank, for logs and error messages."""
        return f"dp={self.dp_rank} tp={self.tp_rank} pp={self.pp_rank}"


def sign_request(secret: bytes, method: str, path_qs: str, timestamp: str, body: bytes) -> str:
    """Hex HMAC-SHA256 of a request; used by the client to sign and the server to verify."""
    msg = b"\n".join([method.upper().encode(), path_qs.encode(), timestamp.encode(), body])
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class BootstrapServer:
    """The bootstrap service: an aiohttp server running its own event loop in a daemon thread.

    Prefill rank 0 creates and starts one when the session starts (unless an external
    service is configured) and stops it on shutdown; ``kvwire bootstrap`` runs one in the
    foreground. Usable as a context manager (``__enter__`` starts, ``__exit__`` stops).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: bytes | None = None) -> None:
        self._host = host
        self._port = port
        self._secret = secret or None
        self._ranks: dict[RankKey, RankInfo] = {}
        #: Counters, updated by the server thread only.
        self.stats: dict[str, int] = {
            "registered": 0,
            "replaced": 0,
            "deregistered": 0,
            "lookups": 0,
            "refused": 0,
            "unauthenticated": 0,
        }
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._bound: tuple[str, int] | None = None
        self._stopped = False

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> BootstrapServer:
        """Bind and serve in a daemon thread; returns once listening.

        Called by prefill rank 0 at session start and by ``kvwire bootstrap``. Raises
        :class:`BootstrapError` if the address cannot be bound.
        """
        if self._thread is not None:
            raise BootstrapError("the bootstrap server was already started")
        self._thread = threading.Thread(
            target=self._run_thread, name="kvwire-bootstrap", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            raise BootstrapError(
                f"the bootstrap server did not start listening on "
                f"{_format_address(self._host, self._port)} within {_START_TIMEOUT_S:.0f} s"
            )
        if self._start_error is not None:
            self._thread.join(_STOP_TIMEOUT_S)
            raise BootstrapError(
                f"the bootstrap server could not listen on "
                f"{_format_address(self._host, self._port)}: {self._start_error}"
            ) from self._start_error
        logger.info("bootstrap service listening on %s", self.address)
        return self

    @property
    def address(self) -> str:
        """``host:port`` actually bound (the real port when constructed with port 0).

        Read by the process that started the server, to publish it to the other ranks.
        """
        if self._bound is None:
            raise BootstrapError("the bootstrap server is not listening (call start() first)")
        return _format_address(*self._bound)

    def stop(self) -> None:
        """Stop serving, close the socket and join the thread (bounded time).

        Called at session shutdown or by ``kvwire bootstrap`` on SIGINT/SIGTERM; idempotent.
        """
        if self._stopped:
            return
        self._stopped = True
        thread, loop, stop_event = self._thread, self._loop, self._stop_event
        if thread is None:
            return
        if loop is not None and stop_event is not None:
            # RuntimeError: the loop is already closed, the thread has finished.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop_event.set)
        thread.join(_STOP_TIMEOUT_S)
        if thread.is_alive():
            logger.warning("bootstrap server thread did not stop within %.0f s", _STOP_TIMEOUT_S)
        else:
            logger.info("bootstrap service stopped")

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _run_thread(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # surfaced to start() when raised before listening
            if not self._ready.is_set():
                self._start_error = e
            else:
                logger.exception("bootstrap server failed")
        finally:
            self._ready.set()
            loop.close()

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        app.router.add_get("/health", self._handle_health)
        app.router.add_put("/v1/ranks", self._handle_register)
        app.router.add_delete("/v1/ranks", self._handle_deregister)
        app.router.add_get("/v1/ranks", self._handle_lookup)
        runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._host, self._port)
            await site.start()
            addr = runner.addresses[0]
            self._bound = (str(addr[0]), int(addr[1]))
            self._ready.set()
            await self._stop_event.wait()
        finally:
            await runner.cleanup()

    # -- request handling (server thread) ----------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Refuse requests without a valid signature when a secret is configured."""
        if self._secret is None or request.path == "/health":
            return await handler(request)
        body = await request.read()  # bounded by client_max_size; cached for the handler
        reason = self._check_signature(request, body)
        if reason is not None:
            self.stats["unauthenticated"] += 1
            logger.warning(
                "bootstrap: refused %s %s from %s: %s",
                request.method,
                request.path,
                request.remote,
                reason,
            )
            return _error(401, f"unauthenticated: {reason}")
        return await handler(request)

    def _check_signature(self, request: web.Request, body: bytes) -> str | None:
        assert self._secret is not None
        timestamp = request.headers.get(TIMESTAMP_HEADER)
        signature = request.headers.get(SIGNATURE_HEADER)
        if not timestamp or not signature:
            return "missing signature headers"
        try:
            ts = float(timestamp)
        except ValueError:
            return "malformed timestamp"
        if not math.isfinite(ts) or abs(time.time() - ts) > MAX_CLOCK_SKEW_S:
            return f"timestamp more than {MAX_CLOCK_SKEW_S:.0f} s off the server's clock"
        expected = sign_request(self._secret, request.method, request.raw_path, timestamp, body)
        if not hmac.compare_digest(expected.encode(), signature.encode()):
            return "wrong signature"
        return None

    async def _parse_rank(self, request: web.Request) -> RankInfo | web.Response:
        body = await request.read()
        try:
            return RankInfo.model_validate_json(body)
        except pydantic.ValidationError as e:
            return _error(400, f"invalid rank registration: {e}")

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "registered": len(self._ranks)})

    async def _handle_register(self, request: web.Request) -> web.Response:
        info = await self._parse_rank(request)
        if isinstance(info, web.Response):
            return info
        for other in self._ranks.values():
            if other.key == info.key:
                continue
            for name in ("tp_size", "pp_size", "dp_size"):
                mine, theirs = getattr(info, name), getattr(other, name)
                if mine != theirs:
                    self.stats["refused"] += 1
                    msg = (
                        f"rank {info.describe()} registers {name}={mine} but rank "
                        f"{other.describe()} registered {name}={theirs}: all ranks of a "
                        f"prefill instance must agree on tp/pp/dp sizes"
                    )
                    logger.warning("bootstrap: %s", msg)
                    return _error(409, msg)
        old = self._ranks.get(info.key)
        self._ranks[info.key] = info
        self.stats["registered"] += 1
        if old is not None and old.session != info.session:
            self.stats["replaced"] += 1
            logger.warning(
                "bootstrap: rank %s restarted (session %s -> %s), now at %s",
                info.describe(),
                old.session,
                info.session,
                info.endpoint,
            )
        else:
            logger.info("bootstrap: rank %s registered at %s", info.describe(), info.endpoint)
        return web.json_response({"registered": True, "replaced": old is not None})

    async def _handle_deregister(self, request: web.Request) -> web.Response:
        info = await self._parse_rank(request)
        if isinstance(info, web.Response):
            return info
        current = self._ranks.get(info.key)
        if current is None or current.session != info.session:
            logger.info(
                "bootstrap: ignored deregistration of rank %s (session %s is not registered)",
                info.describe(),
                info.session,
            )
            return web.json_response({"removed": False})
        del self._ranks[info.key]
        self.stats["deregistered"] += 1
        logger.info("bootstrap: rank %s deregistered", info.describe())
        return web.json_response({"removed": True})

    async def _handle_lookup(self, request: web.Request) -> web.Response:
        raw = request.query.get("dp_rank", "0")
        try:
            dp_rank = int(raw)
        except ValueError:
            return _error(400, f"dp_rank must be an integer, got {raw!r}")
        if dp_rank < 0:
            return _error(400, f"dp_rank must be >= 0, got {dp_rank}")
        self.stats["lookups"] += 1
        any_rank = next(iter(self._ranks.values()), None)
        if any_rank is not None and dp_rank >= any_rank.dp_size:
            return _error(
                400, f"dp_rank={dp_rank} is out of range: the prefill dp_size is {any_rank.dp_size}"
            )
        expected = any_rank.tp_size * any_rank.pp_size if any_rank is not None else 0
        ranks = sorted(
            (r for r in self._ranks.values() if r.dp_rank == dp_rank),
            key=lambda r: (r.pp_rank, r.tp_rank),
        )
        return web.json_response(
            {
                "complete": expected > 0 and len(ranks) == expected,
                "expected": expected,
                "ranks": [r.model_dump() for r in ranks],
            }
        )


class _UnreachableError(Exception):
    """The service did not answer (refused, timed out, reset): worth retrying."""


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

        Called by decode ranks before their first transfer from that dp rank. Retries while the
        service is unreachable or not every rank has registered, until ``timeout_s`` passes;
        then raises :class:`BootstrapError` saying what was missing. Refusals (bad secret,
        bad request) are raised at once.
        """
        deadline = time.monotonic() + timeout_s
        path = f"/v1/ranks?{urllib.parse.urlencode({'dp_rank': dp_rank})}"
        last: dict[str, Any] | None = None
        unreachable: str | None = None
        while True:
            remaining = deadline - time.monotonic()
            try:
                reply = self._request("GET", path, b"", min(self._timeout, max(remaining, 0.05)))
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
            headers[TIMESTAMP_HEADER] = timestamp
            headers[SIGNATURE_HEADER] = sign_request(self._secret, method, path, timestamp, body)
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
            raise _UnreachableError(str(reason) or type(reason).__name__) from e
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
