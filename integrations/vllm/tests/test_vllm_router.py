"""``kvwire_vllm.router`` against fake vLLM instances (aiohttp servers on loopback).

The fakes stand in for vLLM only to steer failures precisely (an instance down, a leg
answering an error, a stream cut); ``test_vllm_serve`` runs the router in front of real
``vllm serve`` instances. Each fake prefill answers ``kv_transfer_params`` naming itself and
the prompt; each fake decode checks it got them and answers tokens derived from them, so a
test sees which instances served each leg and that the params went through unchanged.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvwire_vllm.router import RouterOptions, build_app

pytestmark = pytest.mark.timeout(60)


class Fake:
    """One fake instance: records the bodies it got; ``mode`` steers its answers."""

    def __init__(self, role: str, name: str) -> None:
        self.role, self.name = role, name
        self.bodies: list[dict[str, Any]] = []
        self.mode = "ok"  # ok | error | cut | unhealthy | slow | noparams
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        self.server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.mode == "unhealthy" else 200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.name}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.mode == "error":
            return web.json_response({"error": f"{self.name} refuses"}, status=400)
        if self.mode == "slow":
            await asyncio.sleep(30)
        if self.role == "prefill" and self.mode == "noparams":
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": None})
        if self.role == "prefill":
            assert body["kv_transfer_params"] == {"do_remote_decode": True}
            assert body["max_tokens"] == 1 and body["stream"] is False
            params = {"do_remote_prefill": True, "from": self.name, "prompt": body["prompt"]}
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})
        params = body["kv_transfer_params"]
        tokens = [f"{params['from']}>{self.name}:{params['prompt']}:{i}" for i in range(3)]
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "".join(tokens)}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, tok in enumerate(tokens):
            if self.mode == "cut" and i == 1:
                assert request.transport is not None
                request.transport.close()  # the instance dies mid-stream
                return out
            await out.write(f"data: {json.dumps({'choices': [{'text': tok}]})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


async def _with_router(
    n_prefill: int,
    n_decode: int,
    body: Callable[[aiohttp.ClientSession, str, list[Fake], list[Fake]], Awaitable[None]],
    **opts: Any,
) -> None:
    prefills = [Fake("prefill", f"p{i}") for i in range(n_prefill)]
    decodes = [Fake("decode", f"d{i}") for i in range(n_decode)]
    for f in prefills + decodes:
        await f.server.start_server()
    options = RouterOptions(
        prefill=[f.url for f in prefills],
        decode=[f.url for f in decodes],
        health_interval=0.2,
        **opts,
    )
    router = TestServer(build_app(options), host="127.0.0.1")
    await router.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            await body(s, f"http://127.0.0.1:{router.port}", prefills, decodes)
    finally:
        await router.close()
        for f in prefills + decodes:
            await f.server.close()


def run(n_prefill: int, n_decode: int, body: Any, **opts: Any) -> None:
    asyncio.run(_with_router(n_prefill, n_decode, body, **opts))


async def _sse_texts(resp: aiohttp.ClientResponse) -> list[Any]:
    events = []
    async for line in resp.content:
        text = line.decode().strip()
        if text.startswith("data: ") and text != "data: [DONE]":
            events.append(json.loads(text[6:]))
    return events


def test_two_legs_non_streaming_and_streaming() -> None:
    async def body(s: aiohttp.ClientSession, url: str, p: list[Fake], d: list[Fake]) -> None:
        req = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream_options": {"a": 1}}
        async with s.post(f"{url}/v1/completions", json=req) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] == "p0>d0:hi:0p0>d0:hi:1p0>d0:hi:2"
        # prefill got a one-token, non-streaming copy; decode the original plus the params
        assert "stream_options" not in p[0].bodies[0]
        assert d[0].bodies[0]["max_tokens"] == 3
        assert d[0].bodies[0]["stream_options"] == {"a": 1}
        chat = {"model": "m", "messages": [], "prompt": "yo", "stream": True, "max_tokens": 3}
        async with s.post(f"{url}/v1/chat/completions", json=chat) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            events = await _sse_texts(r)
        assert [e["choices"][0]["text"] for e in events] == [f"p0>d0:yo:{i}" for i in range(3)]
        async with s.get(f"{url}/health") as r:
            assert r.status == 200
            assert [b["healthy"] for b in (await r.json())["decode"]] == [True]
        async with s.get(f"{url}/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "d0"

    run(1, 1, body)


def test_spreads_over_instances() -> None:
    async def body(s: aiohttp.ClientSession, url: str, p: list[Fake], d: list[Fake]) -> None:
        async def one(i: int) -> str:
            req = {"prompt": str(i), "max_tokens": 3}
            async with s.post(f"{url}/v1/completions", json=req) as r:
                assert r.status == 200
                return str((await r.json())["choices"][0]["text"])

        texts = await asyncio.gather(*(one(i) for i in range(12)))
        for i, t in enumerate(texts):
            assert f":{i}:0" in t  # each answer is its own prompt's
        assert sorted(len(f.bodies) for f in p) == [6, 6]
        assert sorted(len(f.bodies) for f in d) == [4, 4, 4]

    run(2, 3, body)


def test_failing_leg_is_a_named_502() -> None:
    async def body(s: aiohttp.ClientSession, url: str, p: list[Fake], d: list[Fake]) -> None:
        for leg, fake in (("prefill", p[0]), ("decode", d[0])):
            fake.mode = "error"
            async with s.post(f"{url}/v1/completions", json={"prompt": "a"}) as r:
                assert r.status == 502
                err = (await r.json())["error"]
            assert err["leg"] == leg and err["instance"] == fake.url
            assert err["upstream_status"] == 400 and "refuses" in err["upstream_body"]
            fake.mode = "ok"
        # a prefill answer without kv_transfer_params (no producer connector) is named too
        p[0].mode = "noparams"
        async with s.post(f"{url}/v1/completions", json={"prompt": "np"}) as r:
            assert r.status == 502
            err = (await r.json())["error"]
        assert err["leg"] == "prefill" and "no kv_transfer_params" in err["message"]
        assert all(b["prompt"] != "np" for b in d[0].bodies)  # decode was never asked
        # a body that is not a JSON object is the client's error
        async with s.post(f"{url}/v1/completions", json=[1, 2]) as r:
            assert r.status == 400

    run(1, 1, body)


def test_instance_down_is_skipped_then_back() -> None:
    async def body(s: aiohttp.ClientSession, url: str, p: list[Fake], d: list[Fake]) -> None:
        await d[0].server.close()  # d0 is gone: requests go to d1, d0 is marked down
        for _ in range(3):
            async with s.post(f"{url}/v1/completions", json={"prompt": "a"}) as r:
                assert r.status == 200
                assert "d1:" in (await r.json())["choices"][0]["text"]
        async with s.get(f"{url}/health") as r:
            st = await r.json()
        assert [b["healthy"] for b in st["decode"]] == [False, True]
        # a prefill failing its health check is not picked; none up: 503
        p[0].mode = "unhealthy"
        await _until(lambda: _healthy(s, url, "prefill"), [False])
        async with s.post(f"{url}/v1/completions", json={"prompt": "a"}) as r:
            assert r.status == 503 and "no prefill instance" in (await r.text())
        p[0].mode = "ok"
        await _until(lambda: _healthy(s, url, "prefill"), [True])
        async with s.post(f"{url}/v1/completions", json={"prompt": "a"}) as r:
            assert r.status == 200

    run(1, 2, body)


async def _healthy(s: aiohttp.ClientSession, url: str, leg: str) -> list[bool]:
    async with s.get(f"{url}/health") as r:
        return [b["healthy"] for b in (await r.json())[leg]]


async def _until(probe: Callable[[], Awaitable[Any]], want: Any) -> None:
    for _ in range(200):  # health_interval is 0.2 s: a few probes suffice
        if await probe() == want:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never {want}")


def test_stream_cut_mid_answer_ends_with_error_event() -> None:
    async def body(s: aiohttp.ClientSession, url: str, p: list[Fake], d: list[Fake]) -> None:
        d[0].mode = "cut"
        req = {"prompt": "z", "stream": True}
        async with s.post(f"{url}/v1/completions", json=req) as r:
            assert r.status == 200
            events = await _sse_texts(r)
        assert events[0]["choices"][0]["text"] == "p0>d0:z:0"
        assert events[-1]["error"]["leg"] == "decode"
        assert events[-1]["error"]["instance"] == d[0].url
        d[0].mode = "ok"
        async with s.post(f"{url}/v1/completions", json={"prompt": "a"}) as r:
            assert r.status == 200  # the router goes on serving

    run(1, 1, body)


def test_slow_leg_is_bounded() -> None:
    async def body(s: aiohttp.ClientSession, url: str, p: list[Fake], d: list[Fake]) -> None:
        p[0].mode = "slow"
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with s.post(f"{url}/v1/completions", json={"prompt": "a"}) as r:
            assert r.status == 502
            err = (await r.json())["error"]
        assert err["leg"] == "prefill" and "no answer in 0.5s" in err["message"]
        assert loop.time() - t0 < 10

    run(1, 1, body, prefill_timeout=0.5)
