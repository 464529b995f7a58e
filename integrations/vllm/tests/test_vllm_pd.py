"""Prefill -> decode through ``KVWireConnector`` across two processes, checked by computation.

One prefill process and one decode process (spawned) each host three vLLM "instances" that
differ in the KV cache layout vLLM resolved (``LBNHC`` = NHD, ``LBHNC`` = HND, and the
block-major ``BLHNC``) over kvwire's ``tcp`` backend, plus one ``LBNHC`` instance over
``nixl`` (chosen through ``kv_connector_extra_config``), each with its own connector halves
and kvwire manager; see ``vllm_pd_harness``. Decode's greedy tokens must equal a single-process
run of the same random-weight GQA model (``vllm_pd_model.reference``), which holds only if
every K/V element of the prompt arrived in the right block, head and token.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any

import pytest
from vllm_pd_model import reference

from kvwire.testing.cluster import free_bootstrap_port

pytestmark = pytest.mark.timeout(240)

#: engine name -> (vLLM KV cache layout of prefill, of decode, kvwire backend, prefill TP,
#: decode TP). Layer-major pools are described with their heads (``kv_pool: heads``), so the
#: two instances may differ in TP and page order; the block-major one moves whole blocks.
ENGINES = {
    "nhd": ("LBNHC", "LBNHC", "tcp", 1, 1),
    "hnd": ("LBHNC", "LBHNC", "tcp", 1, 1),
    "blk": ("BLHNC", "BLHNC", "tcp", 1, 1),
    "nixl": ("LBNHC", "LBNHC", "nixl", 1, 1),
    "tp2": ("LBNHC", "LBNHC", "tcp", 2, 2),
    "gather": ("LBNHC", "LBNHC", "tcp", 2, 1),
    "scatter-hnd": ("LBHNC", "LBHNC", "tcp", 1, 2),
    "nhd-to-hnd": ("LBNHC", "LBHNC", "nixl", 2, 1),
    "blocks-4to8": ("LBNHC", "LBHNC", "tcp", 2, 1),
    "blocks-8to4": ("LBHNC", "LBNHC", "tcp", 1, 2),
}
#: vLLM block size (tokens) of prefill and decode where not 4 (kvwire moves token ranges)
BLOCKS = {"blocks-4to8": (4, 8), "blocks-8to4": (8, 4)}
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


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Instance, Instance]]:
    ctx = mp.get_context("spawn")
    control = {"heartbeat_interval_s": 0.2, "bootstrap_timeout_s": 20}
    # bootstrap ports outside the ephemeral range, distinct: a port picked in the ephemeral
    # range here can be taken by another process's socket before the engine binds it
    ports: list[int] = []
    for _ in ENGINES:
        ports.append(free_bootstrap_port("127.0.0.1", ports))
    pre = {
        name: {
            "layout": lay,
            "tp": tp,
            "block": BLOCKS.get(name, (4, 4))[0],
            "extra": {"transfer_backend": be, "bootstrap_port": port, "control": control},
        }
        for port, (name, (lay, _, be, tp, _)) in zip(ports, ENGINES.items(), strict=True)
    }
    dec = {
        name: {
            "layout": lay,
            "tp": tp,
            "block": BLOCKS.get(name, (4, 4))[1],
            "extra": {"transfer_backend": be, "control": control},
        }
        for name, (_, lay, be, _, tp) in ENGINES.items()
    }
    p, d = Instance(ctx, "prefill", pre), Instance(ctx, "decode", dec)
    try:
        for inst in (p, d):
            pools = inst.ready()  # engine -> the worker's pool summary
            for name, summary in pools.items():
                heads = ENGINES[name][0] != "BLHNC"  # layer-major: described with heads
                assert ("K|V rows" in summary) == heads, (name, summary)
        yield p, d
    finally:
        p.stop()
        d.stop()


def _wait_report(inst: Instance, engine: str, rid: str, key: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rep = inst.call(engine, "status")["reports"].get(rid, {})
        if key in rep:
            return rep
        time.sleep(0.02)
    raise TimeoutError(f"{engine}/{rid}: no {key!r} in {inst.call(engine, 'status')}")


def _pd(
    cluster: tuple[Instance, Instance], engine: str, rid: str, prompt: list[int], **decode_kw: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One request through both instances; returns (prefill answer, decode report)."""
    p, d = cluster
    pre = p.call(engine, "prefill", rid=rid, prompt=prompt)
    assert pre["delay_free"] is True  # prefill holds its blocks until the push is done
    d.call(engine, "decode", rid=rid, prompt=prompt, params=pre["params"], n=N_DECODE, **decode_kw)
    return pre, _wait_report(d, engine, rid, "failed")


def _prompt(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(48) for _ in range(n)]


def _idle(inst: Instance, engine: str, timeout: float = 15) -> dict[str, Any]:
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


@pytest.mark.parametrize("engine", list(ENGINES))
def test_decode_tokens_equal_single_process(
    cluster: tuple[Instance, Instance], engine: str
) -> None:
    for i, n in enumerate((13, 16, 29)):  # partial last block, whole blocks, several blocks
        prompt = _prompt(100 + i, n)
        want = reference(prompt, N_DECODE)
        pre, rep = _pd(cluster, engine, f"{engine}-ok-{i}", prompt)
        assert pre["params"]["remote_num_tokens"] == n
        assert pre["first"] == want[0]
        assert rep["failed"] is False and rep["external"] == n and rep["local_hit"] == 0
        assert rep["tokens"] == want, (engine, n)
    for inst, tp in zip(cluster, ENGINES[engine][3:], strict=True):
        st = _idle(inst, engine)
        assert st["backend"] == ENGINES[engine][2]
        assert st["ranks"] == list(range(tp))


def test_corrupted_kv_changes_tokens(cluster: tuple[Instance, Instance]) -> None:
    """Negative control: the same run with decode's received KV damaged must not match."""
    prompt = _prompt(7, 21)
    _, rep = _pd(cluster, "nhd", "nhd-corrupt", prompt, corrupt=True)
    assert rep["failed"] is False
    assert rep["tokens"] != reference(prompt, N_DECODE)


def test_prefix_cached_on_decode_moves_only_the_rest(cluster: tuple[Instance, Instance]) -> None:
    """Decode already holds the first 3 blocks (12 tokens) of the second prompt: it asks for
    the rest only, into the blocks after them, and still decodes the reference tokens."""
    shared = _prompt(11, 12)
    first, second = shared + _prompt(12, 9), shared + _prompt(13, 7)
    _, rep1 = _pd(cluster, "blk", "blk-prefix-a", first)
    assert rep1["tokens"] == reference(first, N_DECODE)
    _, rep2 = _pd(cluster, "blk", "blk-prefix-b", second)
    assert rep2["local_hit"] == 12 and rep2["external"] == len(second) - 12
    assert rep2["tokens"] == reference(second, N_DECODE)


def test_bad_prefill_block_ids_fail_the_request_on_both_sides(
    cluster: tuple[Instance, Instance],
) -> None:
    p, d = cluster
    prompt = _prompt(21, 14)
    pre = p.call("hnd", "prefill", rid="hnd-badp", prompt=prompt, bad_blocks=True)
    d.call("hnd", "decode", rid="hnd-badp", prompt=prompt, params=pre["params"], n=N_DECODE)
    rep = _wait_report(d, "hnd", "hnd-badp", "failed")
    assert rep["failed"] is True
    assert rep["invalid_blocks"], "the failed request's blocks must be reported as load errors"
    err = p.call("hnd", "status")["errors"]["hnd-badp"]
    assert "DescriptorError" in err and str(48 + 3) in err, err
    assert _wait_report(p, "hnd", "hnd-badp", "sent")["sent"] is True  # prefill freed it
    for inst in cluster:
        _idle(inst, "hnd")


def test_bad_decode_block_ids_fail_the_request(cluster: tuple[Instance, Instance]) -> None:
    p, d = cluster
    prompt = _prompt(31, 10)
    pre = p.call("nhd", "prefill", rid="nhd-badd", prompt=prompt)
    d.call(
        "nhd",
        "decode",
        rid="nhd-badd",
        prompt=prompt,
        params=pre["params"],
        n=N_DECODE,
        bad_blocks=True,
    )
    rep = _wait_report(d, "nhd", "nhd-badd", "failed")
    assert rep["failed"] is True
    err = d.call("nhd", "status")["errors"]["nhd-badd"]
    assert "-1" in err, err
    assert _wait_report(p, "nhd", "nhd-badd", "sent")["sent"] is True
    for inst in cluster:
        _idle(inst, "nhd")


def test_abort_while_receiving_frees_blocks_only_when_reported(
    cluster: tuple[Instance, Instance],
) -> None:
    """A decode request whose prefill never pushes (a room prefill does not know) is aborted
    by the client: vLLM holds its blocks until the connector reports it, which it does once
    no prefill write can land; then every block is free again."""
    p, d = cluster
    prompt = _prompt(41, 18)
    pre = p.call("blk", "prefill", rid="blk-abort-src", prompt=prompt)
    params = dict(pre["params"], kvwire_room=pre["params"]["kvwire_room"] ^ 0x5A5A)
    d.call("blk", "decode", rid="blk-abort", prompt=prompt, params=params, n=N_DECODE)
    time.sleep(0.3)
    st = d.call("blk", "status")
    assert st["free_blocks"] < st["free0"] and "blk-abort" in st["waiting"]
    d.call("blk", "abort", rid="blk-abort")
    rep = _wait_report(d, "blk", "blk-abort", "abort_reported")
    assert "failed" not in rep and "tokens" not in rep
    _idle(d, "blk")
    # The real request's room was never asked for: prefill still holds its blocks until
    # its bootstrap timeout fails the room (20 s here); abort it from decode's side instead.
    d.call("blk", "decode", rid="blk-abort-src", prompt=prompt, params=pre["params"], n=1)
    assert _wait_report(d, "blk", "blk-abort-src", "failed")["failed"] is False
    for inst in cluster:
        _idle(inst, "blk")


def test_prompt_mismatch_computes_locally_and_releases_prefill(
    cluster: tuple[Instance, Instance],
) -> None:
    """Decode gets params for a prompt of another length: it computes the prompt itself
    (no load), and still tells prefill, which holds the blocks for it, to free them at once
    (an empty receive), long before prefill's 20 s bootstrap timeout would."""
    p, d = cluster
    prompt = _prompt(51, 15)
    pre = p.call("nhd", "prefill", rid="nhd-mismatch", prompt=prompt)
    longer = [*prompt, 5]
    t0 = time.monotonic()
    d.call("nhd", "decode", rid="nhd-mismatch", prompt=longer, params=pre["params"], n=N_DECODE)
    rep = d.call("nhd", "status")["reports"]["nhd-mismatch"]
    assert rep["async"] is False and rep["tokens"] == reference(longer, N_DECODE)
    assert _wait_report(p, "nhd", "nhd-mismatch", "sent", timeout=5)["sent"] is True
    assert time.monotonic() - t0 < 5
    for inst in cluster:
        _idle(inst, "nhd")
