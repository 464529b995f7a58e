"""The test process's side of the two-process vLLM harness (``vllm_pd_harness``): a handle
on one instance process, and waits on what its engines report."""

from __future__ import annotations

import time
from typing import Any

#: Tokens each test request decodes after its prompt.
N_DECODE = 6


class Instance:
    """The parent's handle on one process and its engines."""

    def __init__(self, ctx: Any, role: str, engines: dict[str, dict[str, Any]]) -> None:
        from vllm_pd_harness import serve

        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, role, engines), daemon=True)
        self.proc.start()

    def ready(self, timeout: float = 180.0) -> Any:
        return self._recv(timeout)

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer in {timeout}s (alive: {self.proc.is_alive()})")
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(value)
        return value

    def call(self, engine: str, cmd: str, timeout: float = 60.0, **kwargs: Any) -> Any:
        self.conn.send((engine, cmd, kwargs))
        return self._recv(timeout)

    def stop(self) -> None:
        try:
            self.conn.send(("", "stop", {}))
            self._recv(20)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


def wait_report(inst: Instance, engine: str, rid: str, key: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rep = inst.call(engine, "status")["reports"].get(rid, {})
        if key in rep:
            return rep
        time.sleep(0.02)
    raise TimeoutError(f"{engine}/{rid}: no {key!r} in {inst.call(engine, 'status')}")


def pd(
    cluster: tuple[Instance, Instance], engine: str, rid: str, prompt: list[int], **decode_kw: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One request through both instances; returns (prefill answer, decode report)."""
    p, d = cluster
    pre = p.call(engine, "prefill", rid=rid, prompt=prompt)
    assert pre["delay_free"] is True  # prefill holds its blocks until the push is done
    d.call(engine, "decode", rid=rid, prompt=prompt, params=pre["params"], n=N_DECODE, **decode_kw)
    return pre, wait_report(d, engine, rid, "failed")


def prompt_of(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(48) for _ in range(n)]


def idle(inst: Instance, engine: str, timeout: float = 15) -> dict[str, Any]:
    """Wait until the engine holds nothing: every block free, no live request or room."""
    deadline = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = inst.call(engine, "status")
        if (
            st["free_blocks"] == st["free0"]
            and not st["live"]
            and not st["pending"]
            and not any(st["rooms"].values())
        ):
            return st
        time.sleep(0.05)
    raise AssertionError(f"{engine} did not go idle: {st}")
