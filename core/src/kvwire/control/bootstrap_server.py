"""The bootstrap service's server side (aiohttp), split from :mod:`kvwire.control.bootstrap` so
that ranks which only register or look up never import aiohttp."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import threading
import time
from types import TracebackType

import pydantic
from aiohttp import web
from aiohttp.typedefs import Handler

from kvwire.control.bootstrap_protocol import (
    MAX_BODY_BYTES,
    MAX_CLOCK_SKEW_S,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    RankInfo,
    RankKey,
    format_address,
    sign_request,
)
from kvwire.errors import BootstrapError
from kvwire.security import warn_if_exposed

logger = logging.getLogger("kvwire.control.bootstrap")

#: How long :meth:`BootstrapServer.start` waits for the socket to be bound.
_START_TIMEOUT_S = 10.0
#: How long :meth:`BootstrapServer.stop` waits for the server thread.
_STOP_TIMEOUT_S = 5.0

#: Signed state-changing requests (PUT, DELETE) remembered for replay detection at once; more
#: within the window are refused with 503 (far above what registrations need).
MAX_NONCES = 65536
#: Methods whose replay would change state (a replayed GET only repeats an answer).
_NONCE_METHODS = frozenset({"PUT", "DELETE"})


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


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
            "replayed": 0,
        }
        #: Nonces of accepted signed PUT/DELETE requests -> when they may be forgotten
        #: (monotonic); insertion order is expiry order. Server thread only.
        self._nonces: dict[str, float] = {}
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
                f"{format_address(self._host, self._port)} within {_START_TIMEOUT_S:.0f} s"
            )
        if self._start_error is not None:
            self._thread.join(_STOP_TIMEOUT_S)
            raise BootstrapError(
                f"the bootstrap server could not listen on "
                f"{format_address(self._host, self._port)}: {self._start_error}"
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
        return format_address(*self._bound)

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
            warn_if_exposed("bootstrap service", self._host, self._secret is not None)
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
        if reason is None and request.method in _NONCE_METHODS:
            reason = self._check_nonce(request.headers.get(NONCE_HEADER, ""))
            if reason == "busy":
                logger.warning("bootstrap: %d signed requests in the replay window", MAX_NONCES)
                return _error(503, "too many signed requests in the replay window; retry later")
            if reason is not None:
                self.stats["replayed"] += 1
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
        nonce = request.headers.get(NONCE_HEADER)
        if not timestamp or not signature or not nonce:
            return "missing signature headers (timestamp, nonce, signature)"
        if len(nonce) > 64:
            return "malformed nonce"
        try:
            ts = float(timestamp)
        except ValueError:
            return "malformed timestamp"
        if not math.isfinite(ts) or abs(time.time() - ts) > MAX_CLOCK_SKEW_S:
            return f"timestamp more than {MAX_CLOCK_SKEW_S:.0f} s off the server's clock"
        expected = sign_request(
            self._secret, request.method, request.raw_path, timestamp, body, nonce
        )
        if not hmac.compare_digest(expected.encode(), signature.encode()):
            return "wrong signature"
        return None

    def _check_nonce(self, nonce: str) -> str | None:
        """Remember ``nonce`` of an authentic state-changing request; a reason if it was
        seen within the window (a replay), ``"busy"`` if too many are remembered. A nonce is
        kept for twice the clock allowance: a request stamped up to that far ahead is still
        accepted until then."""
        now = time.monotonic()
        nonces = self._nonces
        while nonces:
            first = next(iter(nonces))
            if nonces[first] > now:
                break
            del nonces[first]
        if nonce in nonces:
            return "replayed request (its nonce was already used)"
        if len(nonces) >= MAX_NONCES:
            return "busy"
        nonces[nonce] = now + 2 * MAX_CLOCK_SKEW_S
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
