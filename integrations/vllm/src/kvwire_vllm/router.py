"""A router for vLLM prefill/decode disaggregation: ``python -m kvwire_vllm.router``.

It serves vLLM's OpenAI routes ``POST /v1/completions`` and ``POST /v1/chat/completions`` in
two legs per request:

1. **prefill**: the request goes to a prefill instance (started with ``"kv_role":
   "kv_producer"``) with ``kv_transfer_params = {"do_remote_decode": true}``, ``max_tokens=1``
   and no streaming; the instance computes the prompt and answers with the
   ``kv_transfer_params`` decode needs (for kvwire: the room, the bootstrap address and the
   prompt length);
2. **decode**: the original request goes to a decode instance (``"kv_role": "kv_consumer"``)
   with those params; its answer (SSE stream or JSON) is streamed back to the client as is.

Nothing here is specific to kvwire: any connector that follows vLLM's
``kv_transfer_params`` convention (vLLM's own NixlConnector too) works behind it.

Instances are picked least-loaded (requests in flight; round-robin among equals) among those
up; each instance's ``GET /health`` is probed every ``--health-interval`` seconds (down after
``--health-misses`` failed probes in a row) and one a request cannot connect to is marked down
at once (the leg is then tried on the next instance).
A leg that fails answers the client **HTTP 502** with a JSON error naming the leg, the
instance and what it answered; no instance up for a leg: **503**. Every network wait is
bounded (``--connect-timeout``, ``--prefill-timeout``, ``--read-timeout``).

``GET /health`` reports every instance (200 when each leg has one up); ``GET /v1/models`` is
forwarded to a decode instance.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from kvwire_vllm.router_pool import Backend, NoBackendError, Pool

logger = logging.getLogger(__name__)

#: Routes served in two legs.
ROUTES = ("/v1/completions", "/v1/chat/completions")
#: Request headers passed on to both legs.
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
#: Bytes of a failing backend's answer quoted in the router's error.
_QUOTE = 2000


class RouterOptions(BaseModel):
    """The router's settings (the command line, or :func:`build_app` in a program)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill: list[str] = Field(min_length=1, description="Base URLs of prefill instances.")
    decode: list[str] = Field(min_length=1, description="Base URLs of decode instances.")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, lt=65536)
    health_interval: float = Field(default=5.0, gt=0, description="Seconds between probes.")
    health_timeout: float = Field(default=5.0, gt=0, description="One /health probe.")
    health_misses: int = Field(
        default=2, ge=1, description="Failed probes in a row before an instance is down."
    )
    connect_timeout: float = Field(default=5.0, gt=0, description="Connecting to an instance.")
    prefill_timeout: float = Field(
        default=300.0, gt=0, description="Whole prefill leg (computing the prompt)."
    )
    read_timeout: float = Field(
        default=300.0, gt=0, description="Decode leg: longest wait for the next bytes."
    )


class LegError(Exception):
    """A leg failed: becomes the client's 502 (or the stream's last event)."""

    def __init__(
        self, leg: str, instance: str, message: str, status: int | None = None, body: str = ""
    ) -> None:
        super().__init__(f"{leg} leg on {instance}: {message}")
        self.leg, self.instance, self.message = leg, instance, message
        self.status, self.body = status, body

    def payload(self) -> dict[str, Any]:
        """The JSON error the client gets."""
        return {
            "error": {
                "type": "kvwire_router_error",
                "message": str(self),
                "leg": self.leg,
                "instance": self.instance,
                "upstream_status": self.status,
                "upstream_body": self.body[:_QUOTE],
            }
        }


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's request: the prompt, one token, no streaming, asking for the KV."""
    out = dict(body)
    out["kv_transfer_params"] = {"do_remote_decode": True}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in ("stream_options", "min_tokens"):
        out.pop(key, None)
    return out


class Router:
    """The aiohttp application's state: one pool per leg and one client session.

    Created by :func:`build_app`; its handlers run on the app's event loop."""

    def __init__(self, opts: RouterOptions) -> None:
        self.opts = opts
        self.prefill = Pool("prefill", opts.prefill, opts.health_misses)
        self.decode = Pool("decode", opts.decode, opts.health_misses)
        self._session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task[None] | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "router not started"
        return self._session

    async def start(self, app: web.Application) -> None:
        """aiohttp startup hook: open the session, probe once, start the health loop."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(connect=self.opts.connect_timeout),
            connector=aiohttp.TCPConnector(limit=0),
        )
        await self._check()
        self._health = asyncio.create_task(self._health_loop())

    async def stop(self, app: web.Application) -> None:
        """aiohttp cleanup hook."""
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        if self._session is not None:
            await self._session.close()

    async def _check(self) -> None:
        t = self.opts.health_timeout
        await asyncio.gather(
            self.prefill.check(self.session, t), self.decode.check(self.session, t)
        )

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.opts.health_interval)
            try:
                await self._check()
            except Exception:  # never let the loop die: log and go on probing
                logger.exception("health check failed")

    # ------------------------------------------------------------------ handlers
    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 when each leg has an instance up, else 503."""
        up = any(b.healthy for b in self.prefill.backends) and any(
            b.healthy for b in self.decode.backends
        )
        body = {"prefill": self.prefill.status(), "decode": self.decode.status()}
        return web.json_response(body, status=200 if up else 503)

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: forwarded to a decode instance."""
        try:
            backend = self.decode.pick()
            async with self.session.get(f"{backend.url}/v1/models") as resp:
                data = await resp.read()
                return web.Response(body=data, status=resp.status, content_type=resp.content_type)
        except NoBackendError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=503)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return web.json_response(
                LegError("decode", backend.url, f"GET /v1/models failed: {exc!r}").payload(),
                status=502,
            )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` and ``/v1/chat/completions``: the two legs."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return web.json_response({"error": {"message": f"body is not JSON: {exc}"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response(
                {"error": {"message": "body must be a JSON object"}}, status=400
            )
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        headers.setdefault("X-Request-Id", uuid.uuid4().hex)
        path = request.path
        try:
            params = await self._prefill(path, body, headers)
            return await self._decode(
                request, path, {**body, "kv_transfer_params": params}, headers
            )
        except NoBackendError as exc:
            return web.json_response(
                {"error": {"type": "kvwire_router_error", "message": str(exc)}}, status=503
            )
        except LegError as exc:
            logger.warning("%s", exc)
            return web.json_response(exc.payload(), status=502)

    # ------------------------------------------------------------------ legs
    async def _attempts(self, pool: Pool) -> AsyncIterator[Backend]:
        """Instances to try for one leg: the best one, then (after a connection failure
        marked it down) the next, until none is up."""
        tried: set[str] = set()
        while True:
            backend = pool.pick(frozenset(tried))
            tried.add(backend.url)
            yield backend

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        """Run the prefill leg; return the ``kv_transfer_params`` for decode."""
        timeout = aiohttp.ClientTimeout(
            total=self.opts.prefill_timeout, connect=self.opts.connect_timeout
        )
        async for backend in self._attempts(self.prefill):
            with self.prefill.use(backend):
                try:
                    async with self.session.post(
                        f"{backend.url}{path}",
                        json=_prefill_body(body),
                        headers=headers,
                        timeout=timeout,
                    ) as resp:
                        text = await resp.text()
                        status = resp.status
                except aiohttp.ClientConnectorError as exc:
                    self.prefill.mark_down(backend, repr(exc))
                    continue  # never reached the instance: the next may take it
                except TimeoutError as exc:
                    raise LegError(
                        "prefill", backend.url, f"no answer in {self.opts.prefill_timeout}s"
                    ) from exc
                except aiohttp.ClientError as exc:
                    raise LegError("prefill", backend.url, repr(exc)) from exc
            if status != 200:
                raise LegError("prefill", backend.url, f"answered HTTP {status}", status, text)
            try:
                params = json.loads(text).get("kv_transfer_params")
            except (json.JSONDecodeError, AttributeError) as exc:
                raise LegError(
                    "prefill", backend.url, "answer is not a JSON object", status, text
                ) from exc
            if not isinstance(params, dict):
                raise LegError(
                    "prefill",
                    backend.url,
                    "answer has no kv_transfer_params (is the instance started "
                    "with a kv_producer KV connector?)",
                    status,
                    text,
                )
            return params
        raise AssertionError("unreachable")  # _attempts raises NoBackendError when done

    async def _decode(
        self, request: web.Request, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """Run the decode leg and stream its answer back to the client."""
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.opts.connect_timeout, sock_read=self.opts.read_timeout
        )
        async for backend in self._attempts(self.decode):
            with self.decode.use(backend):
                try:
                    async with self.session.post(
                        f"{backend.url}{path}", json=body, headers=headers, timeout=timeout
                    ) as resp:
                        if resp.status != 200:
                            text = await resp.text()
                            raise LegError(
                                "decode",
                                backend.url,
                                f"answered HTTP {resp.status}",
                                resp.status,
                                text,
                            )
                        return await self._relay(request, resp, backend)
                except aiohttp.ClientConnectorError as exc:
                    self.decode.mark_down(backend, repr(exc))
                    continue  # never reached the instance: the next may take it
                except TimeoutError as exc:
                    raise LegError(
                        "decode", backend.url, f"no answer in {self.opts.read_timeout}s"
                    ) from exc
                except aiohttp.ClientError as exc:
                    raise LegError("decode", backend.url, repr(exc)) from exc
        raise AssertionError("unreachable")

    async def _relay(
        self, request: web.Request, resp: aiohttp.ClientResponse, backend: Backend
    ) -> web.StreamResponse:
        """Copy decode's answer to the client as it arrives. Once the first bytes went out
        the status cannot change: a failure after that ends the stream with an SSE
        ``data: {"error": ...}`` event naming the leg and instance."""
        out = web.StreamResponse(status=resp.status)
        out.content_type = resp.content_type
        if resp.charset:
            out.charset = resp.charset
        await out.prepare(request)
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except (TimeoutError, aiohttp.ClientError) as exc:
            err = LegError("decode", backend.url, f"failed mid-answer: {exc!r}")
            logger.warning("%s", err)
            await out.write(f"data: {json.dumps(err.payload())}\n\n".encode())
        await out.write_eof()
        return out


def build_app(opts: RouterOptions) -> web.Application:
    """The router as an aiohttp application (for ``web.run_app`` or a test server)."""
    router = Router(opts)
    app = web.Application()
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    for route in ROUTES:
        app.router.add_post(route, router.generate)
    app.router.add_get("/health", router.health)
    app.router.add_get("/v1/models", router.models)
    return app


def parse_args(argv: list[str] | None = None) -> RouterOptions:
    """The command line as :class:`RouterOptions`."""
    p = argparse.ArgumentParser(
        prog="python -m kvwire_vllm.router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--health-interval", type=float, default=5.0)
    p.add_argument("--health-timeout", type=float, default=5.0)
    p.add_argument("--health-misses", type=int, default=2)
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument("--prefill-timeout", type=float, default=300.0)
    p.add_argument("--read-timeout", type=float, default=300.0)
    p.add_argument("--log-level", default="INFO")
    ns = p.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return RouterOptions(**{k: v for k, v in vars(ns).items() if k != "log_level"})


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m kvwire_vllm.router``."""
    opts = parse_args(argv)
    logger.info(
        "kvwire router on %s:%d: prefill %s, decode %s",
        opts.host,
        opts.port,
        opts.prefill,
        opts.decode,
    )
    web.run_app(build_app(opts), host=opts.host, port=opts.port, print=None)


if __name__ == "__main__":
    main()
