"""Test harness: SGLang-shaped ranks driving kvwire-sglang's classes, with a real computation.

A tiny random-weight GQA model (NumPy, 2 layers, 2 KV heads, 4 query heads) keeps its K/V in
paged pools shaped like SGLang's (``[slots, page, heads, dim]`` per layer, K buffers then V
buffers). Every rank fills SGLang's real ``KVArgs`` with those pointers, builds
:class:`~kvwire_sglang.conn.KvwireKVManager` and drives requests through
``KvwireKVSender``/``KvwireKVReceiver`` in the order SGLang's scheduler calls them (sender:
``poll`` until ``WaitingForInput``, ``init``, ``send`` per chunk without a last flag;
receiver: ``init``, ``send_metadata`` with ``decode_prefix_len``, ``poll``). A prefill rank of a
TP group computes every head and keeps only its own (its shard of the pool); decode (TP 1)
generates greedily from what kvwire moved into its pool, and the tokens must equal a
single-process run's.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import enum
import math
import multiprocessing as mp
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

VOCAB, D, QH, KVH, HD, PS, LAYERS, SLOTS = 40, 16, 4, 2, 4, 4, 2, 32
AUX_ROWS = 8


class GQA:
    """Random weights (fixed seed); per-token forward over a paged cache."""

    def __init__(self, seed: int = 7) -> None:
        rng = np.random.default_rng(seed)

        def w(*shape: int) -> Any:
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

        self.embed = (rng.standard_normal((VOCAB, D))).astype(np.float32)
        self.layers = [
            (w(D, QH * HD), w(D, KVH * HD), w(D, KVH * HD), w(QH * HD, D)) for _ in range(LAYERS)
        ]
        self.out = w(D, VOCAB)

    def step(self, cache: Pool, pages: list[int], token: int, pos: int) -> int:
        x = self.embed[token].copy()
        for layer, (wq, wk, wv, wo) in enumerate(self.layers):
            q = (x @ wq).reshape(QH, HD)
            cache.write(layer, pages, pos, (x @ wk).reshape(KVH, HD), (x @ wv).reshape(KVH, HD))
            k, v = cache.read(layer, pages, pos + 1)
            kk, vv = np.repeat(k, QH // KVH, axis=1), np.repeat(v, QH // KVH, axis=1)
            s = np.einsum("hd,nhd->hn", q, kk) / np.float32(np.sqrt(HD))
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            x = x + np.einsum("hn,nhd->hd", p, vv).reshape(-1) @ wo
        return int(np.argmax(x @ self.out))

    def run(self, cache: Pool, pages: list[int], tokens: list[int], start: int) -> int:
        nxt = -1
        for i, t in enumerate(tokens):
            nxt = self.step(cache, pages, t, start + i)
        return nxt


class Pool:
    """One rank's paged KV pool; holds the KV heads ``heads`` of the model."""

    def __init__(self, heads: list[int]) -> None:
        self.heads = np.asarray(heads)
        shape = (SLOTS, PS, len(heads), HD)
        self.k = [np.zeros(shape, np.float32) for _ in range(LAYERS)]
        self.v = [np.zeros(shape, np.float32) for _ in range(LAYERS)]
        self.aux = np.zeros((AUX_ROWS, 16), np.int32)  # like SGLang's output_ids rows

    def write(self, layer: int, pages: list[int], pos: int, k: Any, v: Any) -> None:
        slot, t = pages[pos // PS], pos % PS
        self.k[layer][slot, t] = k[self.heads]
        self.v[layer][slot, t] = v[self.heads]

    def read(self, layer: int, pages: list[int], n: int) -> tuple[Any, Any]:
        pos = np.arange(n)
        slots = np.asarray(pages)[pos // PS]
        return self.k[layer][slots, pos % PS], self.v[layer][slots, pos % PS]

    def kv_args(self, tp_rank: int, with_heads: bool) -> Any:
        """SGLang's real KVArgs, filled as its scheduler fills it."""
        from sglang.srt.disaggregation.base.conn import KVArgs

        bufs = [*self.k, *self.v]
        a = KVArgs()
        a.engine_rank = tp_rank
        a.pp_rank = 0
        a.system_dp_rank = 0
        a.kv_data_ptrs = [b.ctypes.data for b in bufs]
        a.kv_data_lens = [b.nbytes for b in bufs]
        a.kv_item_lens = [b[0].nbytes for b in bufs]
        a.kv_cache_dtype_str = "float32"
        a.page_size = PS
        a.num_draft_entries = 0
        if with_heads:  # prefill; decode learns them from the engine facts
            a.kv_head_num = len(self.heads)
            a.total_kv_head_num = KVH
        a.prefill_start_layer = 0
        a.prefill_end_layer = LAYERS
        a.aux_data_ptrs, a.aux_data_lens = [self.aux.ctypes.data], [self.aux.nbytes]
        a.aux_item_lens = [self.aux[0].nbytes]
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        a.gpu_id = 0
        return a


def reference(prompt: list[int], n_gen: int) -> list[int]:
    """Single process, one pool with every head: prefill then greedy decoding."""
    model, pool = GQA(), Pool(list(range(KVH)))
    pages = list(range(SLOTS))
    out = [model.run(pool, pages, prompt, 0)]
    for i in range(n_gen):
        out.append(model.step(pool, pages, out[-1], len(prompt) + i))
    return out


def wait(h: Any, states: tuple[int, ...], timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while (p := int(h.poll())) not in states:
        if time.monotonic() > deadline:
            raise TimeoutError(f"poll stuck at {p}, wanted {states}")
        time.sleep(0.002)
    return p


@dataclass
class Request:
    room: int
    prompt: list[int]
    n_gen: int = 6
    chunk_pages: int = 2
    cached_pages: int = 0  # prompt pages decode already holds (its radix cache)
    corrupt: bool = False  # negative control: damage a moved page on decode


def _prefill(mgr: Any, pool: Pool, addr: str, req: Request) -> dict[str, Any]:
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvwire_sglang.conn import KvwireKVSender

    model = GQA()
    rng = np.random.default_rng(req.room)
    n = len(req.prompt)
    num_pages = math.ceil(n / PS)
    pages = rng.permutation(SLOTS)[:num_pages].tolist()
    tx = KvwireKVSender(mgr, addr, req.room)
    wait(tx, (KVPoll.WaitingForInput, KVPoll.Failed))
    tx.init(num_pages - tx.pop_decode_prefix_len() // PS, aux_index=2)
    step = req.chunk_pages * PS
    work = Pool(list(range(KVH)))  # this TP rank's computation sees every head ...
    for start in range(0, n, step):  # SGLang's chunked prefill: no last flag on send()
        end = min(n, start + step)
        first = model.run(work, pages, req.prompt[start:end], start)
        if end == n:
            pool.aux[2, 0] = first  # the first output token rides in the aux row
        chunk = np.asarray(pages[start // PS : math.ceil(end / PS)], dtype=np.int32)
        for layer in range(LAYERS):  # ... and its registered pool keeps its own heads only
            pool.k[layer][chunk] = work.k[layer][chunk][:, :, pool.heads]
            pool.v[layer][chunk] = work.v[layer][chunk][:, :, pool.heads]
        if tx.should_send_kv_chunk(len(chunk), end == n):
            tx.send(chunk, None)
    status = wait(tx, (KVPoll.Success, KVPoll.Failed))
    metric = tx.get_transfer_metric()
    tx.clear()
    return {"status": status, "bytes": metric.transfer_total_bytes}


def _decode(mgr: Any, pool: Pool, addr: str, req: Request) -> dict[str, Any]:
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvwire_sglang.conn import KvwireKVReceiver

    model = GQA()
    rng = np.random.default_rng(req.room + 1)
    n = len(req.prompt)
    pages = rng.permutation(SLOTS)[: math.ceil((n + req.n_gen) / PS)].tolist()
    cached = req.cached_pages * PS
    if cached:  # decode's own prefix cache: computed here, not moved
        model.run(pool, pages, req.prompt[:cached], 0)
    rx = KvwireKVReceiver(mgr, addr, req.room)
    rx.init(0)
    dst = np.asarray(pages[req.cached_pages : math.ceil(n / PS)], dtype=np.int32)
    rx.send_metadata(dst, 5, None, decode_prefix_len=cached)
    status = wait(rx, (KVPoll.Success, KVPoll.Failed))
    if status != KVPoll.Success:
        try:
            rx.failure_exception()
        except Exception as exc:
            rx.clear()
            return {"status": status, "error": f"{type(exc).__name__}: {exc}"}
    if req.corrupt:
        last = pages[(n - 1) // PS]
        pool.k[1][last] += 3.0
    out = [int(pool.aux[5, 0])]
    for i in range(req.n_gen):
        out.append(model.step(pool, pages, out[-1], n + i))
    rx.clear()
    return {"status": status, "tokens": out}


def rank_main(role: str, tp: int, rank: int, addr: str, conn: Any) -> None:
    """A rank process: build the manager, then serve requests from ``conn`` until None."""
    try:
        from kvwire_sglang.conn import KvwireKVManager
        from kvwire_sglang.facts import EngineFacts, engine_facts

        heads = list(range(KVH)) if tp == 1 else [rank * (KVH // tp) + h for h in range(KVH // tp)]
        pool = Pool(heads)
        host, port = addr.rsplit(":", 1)
        server_args = types.SimpleNamespace(host=host, disaggregation_bootstrap_port=int(port))
        facts = EngineFacts(
            attn_tp_size=tp, num_layers=LAYERS, total_kv_heads=KVH, local_kv_heads=len(heads)
        )
        with engine_facts(facts):
            mode = real_utils_module().DisaggregationMode(role)  # SGLang's own enum
            mgr = KvwireKVManager(pool.kv_args(rank, role == "prefill"), mode, server_args, False)
        conn.send(("ready", mgr.layout.model.model_dump()))
        while (req := conn.recv()) is not None:
            fn = _prefill if role == "prefill" else _decode
            try:
                conn.send(("ok", fn(mgr, pool, addr, req)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
        mgr.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


#: How long a live rank process may take to answer one message. A rank that dies fails the
#: wait at once; a live one is given this much (a rank's first request builds its manager, and
#: on a loaded 2-core host one took over 90 s where it takes ~10 s idle): the bound is only
#: against a rank that hangs.
ANSWER_S = 240.0


def reply(c: Any, proc: Any, timeout: float = ANSWER_S) -> tuple[str, Any]:
    """A rank process's next reply on pipe ``c``: ``(kind, value)``, kind "ok" or "error" (a
    traceback). Waits while ``proc`` (the rank's process) is alive, at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not c.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"rank process {proc.name} exited ({proc.exitcode}), no answer")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank process {proc.name} did not answer in {timeout:.0f}s")
    try:
        kind, value = c.recv()
    except EOFError:  # the rank's end of the pipe closed: it exited
        proc.join(5)
        why = f"rank process {proc.name} exited ({proc.exitcode}), no answer"
        raise RuntimeError(why) from None
    return str(kind), value


class OutOfStep:
    """Replies of rank processes driven over pipes, one reply per message. Every rank's reply
    is read before a rank's error is raised; once a wait failed (a rank hung or died), later
    replies would answer earlier messages, so every later request fails naming that failure
    instead of comparing another request's results."""

    def __init__(self) -> None:
        self.broken: str | None = None

    def check(self) -> None:
        """Before sending a request: refuse if an earlier wait failed."""
        if self.broken is not None:
            raise RuntimeError(f"an earlier request on this cluster failed: {self.broken}")

    def replies(self, pairs: list[tuple[Any, Any]]) -> list[Any]:
        """Each rank's reply value, in order (``pairs``: pipe, process); a rank's error raised
        once all replied."""
        got = []
        for c, p in pairs:
            try:
                got.append(reply(c, p))
            except Exception as exc:  # whatever ended the wait, the pipes are out of step
                self.broken = f"{type(exc).__name__}: {exc}"
                raise
        for kind, value in got:
            if kind == "error":
                raise RuntimeError(value)
        return [value for _, value in got]


class Cluster:
    """A prefill instance (``prefill_tp`` processes) and a decode instance (1 process), plus
    SGLang's bootstrap server object (kvwire's service) in this process."""

    def __init__(self, prefill_tp: int, port: int) -> None:
        from kvwire_sglang.conn import KvwireKVBootstrapServer

        self.server = KvwireKVBootstrapServer("127.0.0.1", port)
        self.addr = self.server.server.address
        ctx = mp.get_context("spawn")
        self.procs: list[tuple[Any, Any, str]] = []
        for role, tp, rank in [("prefill", prefill_tp, r) for r in range(prefill_tp)] + [
            ("decode", 1, 0)
        ]:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(role, tp, rank, self.addr, child), daemon=True)
            p.start()
            self.procs.append((p, parent, role))
        self.pipes = OutOfStep()
        self.pipes.replies([(c, p) for p, c, _ in self.procs])

    def run(self, req: Request) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """One request through every rank; returns (prefill results, decode result)."""
        self.pipes.check()
        for _, c, _ in self.procs:
            c.send(req)
        results = self.pipes.replies([(c, p) for p, c, _ in self.procs])
        return results[:-1], results[-1]

    def close(self) -> None:
        for p, c, _ in self.procs:
            with contextlib.suppress(OSError):
                c.send(None)
            p.join(20)
            if p.is_alive():
                p.kill()
        self.server.close()


def real_utils_module() -> types.ModuleType:
    """SGLang's real ``TransferBackend``, ``KVClassType``, ``DisaggregationMode`` and
    ``get_kv_class``, executed from the installed ``sglang/srt/disaggregation/utils.py`` (the
    module itself needs SGLang's GPU stack to import), as a module of that name."""
    import sglang.srt.disaggregation as pkg

    path = Path(next(iter(pkg.__path__))) / "utils.py"
    tree = ast.parse(path.read_text())
    want = {"TransferBackend", "KVClassType", "DisaggregationMode", "get_kv_class"}
    body = [
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef | ast.FunctionDef)
        and n.name in want
        and not any(
            isinstance(d, ast.Name) and d.id == "overload" for d in getattr(n, "decorator_list", [])
        )
    ]
    found = {n.name for n in body}
    assert found == want, f"SGLang's utils.py changed: found {found}"
    mod = types.ModuleType("sglang.srt.disaggregation.utils")
    mod.__file__ = str(path)
    flags = __future__.annotations.compiler_flag
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec", flags=flags)
    mod.__dict__.update({"Enum": enum.Enum, "Optional": Optional, "Type": type})
    exec(code, mod.__dict__)
    return mod
