"""``kvwire bench-layerwise``: time to decode-ready with layer-wise vs per-chunk transfer.

A prefill process runs a small random-weight model (fixed seed) whose layers do real work:
per layer a ``[tokens, hidden] x [hidden, hidden]`` matmul and the K and V projections, written
into the rank's paged KV pool (NumPy on CPU, torch on CUDA). A decode process asks for the
request's KV. Per prompt length and backend, in one run and interleaved, three modes:

* ``compute``: the forward pass alone (no transfer): the floor;
* ``chunk``: the pass, then ``tx.send(pages, last=True)`` (kvwire's per-chunk path);
* ``layer``: ``tx.send(pages, last=True, layerwise=True)`` before the pass, then
  ``tx.layer_ready(i, event)`` after each layer (a CUDA event recorded on the compute stream
  on GPU; the engine thread never synchronises).

Time to decode-ready is from the start of the pass to the moment decode's ``poll()`` says
``Success`` (both processes read the same monotonic clock). On CUDA, prefill runs on GPU 0
and decode on GPU 1 when two are visible (``--decode-gpu``), so the KV crosses the link
between them, and a fourth column times a plain torch copy of the same bytes from prefill's
GPU to decode's (``peer``: the link's limit, one contiguous block). Decode's K/V bytes are
hashed and compared with prefill's after every run: a run whose bytes differ is reported as
corrupt.
Prefill runs with one BLAS thread (like an engine's compute stream, it must not take the
cores kvwire's threads use).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table

from kvwire.cli_progress import progress_bar
from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import KVLayout, ModelSpec
from kvwire.session import KVManager, KVPoll, Role

MODES = ("compute", "chunk", "layer")


class BenchArgs(BaseModel):
    """The benchmark's shape (``kvwire bench-layerwise --help``)."""

    layers: int = Field(default=16, ge=2)
    hidden: int = Field(default=128, ge=8)
    heads: int = Field(default=4, ge=1)
    head_dim: int = Field(default=64, ge=1)
    page_size: int = Field(default=16, ge=1)
    tokens: list[int] = Field(default_factory=lambda: [1024, 4096])
    repeat: int = Field(default=5, ge=1)
    groups: int = Field(default=4, ge=1, le=16)
    device: str = "cpu"
    backends: list[str] = Field(default_factory=lambda: ["tcp"])
    staging: str = "direct"
    backend_options: dict[str, Any] = Field(
        default_factory=dict, description="transfer_backend_options of both sides"
    )
    decode_gpu: int | None = Field(
        default=None, ge=0, description="decode's CUDA device; None: 1 when two are visible, else 0"
    )

    @property
    def model(self) -> ModelSpec:
        """The KV pool's model facts."""
        return ModelSpec(
            num_layers=self.layers,
            total_kv_heads=self.heads,
            head_dim=self.head_dim,
            dtype="float32",
            page_size=self.page_size,
        )

    @property
    def slots(self) -> int:
        """Pages of the pool: the longest prompt."""
        return -(-max(self.tokens) // self.page_size)


def decode_gpu(a: BenchArgs, device_count: int) -> int:
    """Decode's CUDA device: ``a.decode_gpu``, or GPU 1 when two are visible (prefill is on
    GPU 0), so that the move crosses the link between GPUs rather than one GPU's memory."""
    if a.decode_gpu is not None:
        if a.decode_gpu >= device_count:
            raise ValueError(f"--decode-gpu {a.decode_gpu}: only {device_count} GPUs visible")
        return a.decode_gpu
    return 1 if device_count > 1 else 0


class _Engine:
    """One side's KV pool and (prefill) the model writing it, in NumPy or torch."""

    def __init__(self, a: BenchArgs, with_model: bool) -> None:
        self.a = a
        self.cuda = a.device == "cuda"
        shape = (a.slots, a.page_size, a.heads, a.head_dim)
        self.torch: Any = None
        self.w: list[Any] = []
        self.wk: list[Any] = []
        self.wv: list[Any] = []
        self.gpu = 0
        if self.cuda:
            import torch

            self.torch = torch
            self.gpu = 0 if with_model else decode_gpu(a, torch.cuda.device_count())
            torch.cuda.set_device(self.gpu)  # events, streams and IPC handles of this GPU
            dev = torch.device("cuda", self.gpu)
            self.kv: list[Any] = [
                torch.zeros(shape, dtype=torch.float32, device=dev) for _ in range(2 * a.layers)
            ]
        else:
            self.kv = [np.zeros(shape, dtype=np.float32) for _ in range(2 * a.layers)]
        if with_model:  # random weights, fixed seed (prefill only)
            rng = np.random.default_rng(1234)
            scale = float(1.0 / np.sqrt(a.hidden))  # a Python float keeps them float32
            kv = a.heads * a.head_dim

            def weights(cols: int) -> list[Any]:
                out = [
                    rng.standard_normal((a.hidden, cols), dtype=np.float32) * scale
                    for _ in range(a.layers)
                ]
                return [torch.from_numpy(x).to(dev) for x in out] if self.cuda else out

            self.w, self.wk, self.wv = weights(a.hidden), weights(kv), weights(kv)
        self.layout = KVLayout.from_tensors(a.model, self.kv)

    def prompt(self, tokens: int) -> Any:
        """The embedded prompt (fixed per length)."""
        x = np.random.default_rng(tokens).standard_normal((tokens, self.a.hidden), dtype=np.float32)
        return self.torch.from_numpy(x).to(f"cuda:{self.gpu}") if self.cuda else x

    def layer(self, i: int, h: Any, pages: int) -> Any:
        """Layer ``i`` over every token: its K and V into pages ``[0, pages)``; the next h."""
        a = self.a
        n = pages * a.page_size
        k, v = h @ self.wk[i], h @ self.wv[i]
        if self.cuda:
            self.kv[i][:pages].view(n, -1)[: h.shape[0]] = k
            self.kv[a.layers + i][:pages].view(n, -1)[: h.shape[0]] = v
            return self.torch.tanh(h @ self.w[i])
        self.kv[i][:pages].reshape(n, -1)[: h.shape[0]] = k
        self.kv[a.layers + i][:pages].reshape(n, -1)[: h.shape[0]] = v
        return np.tanh(h @ self.w[i])

    def event(self) -> Any:
        """A CUDA event recorded after the work queued so far (None on CPU)."""
        if not self.cuda:
            return None
        ev = self.torch.cuda.Event()
        ev.record()
        return ev

    def peer_copy_ms(self, nbytes: int, to_gpu: int, repeat: int = 5) -> float:
        """Median ms of one torch copy of ``nbytes`` contiguous bytes from this GPU to
        ``to_gpu`` (the link's limit for the request's KV); prefill side, CUDA only."""
        torch = self.torch
        src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.gpu}")
        dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{to_gpu}")
        times = []
        for _ in range(repeat + 1):
            torch.cuda.synchronize(self.gpu)
            torch.cuda.synchronize(to_gpu)
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(to_gpu)
            torch.cuda.synchronize(self.gpu)
            times.append(time.perf_counter() - t0)
        del src, dst
        return statistics.median(times[1:]) * 1e3

    def digest(self, pages: int) -> str:
        """Hash of every layer's K and V in pages ``[0, pages)``."""
        h = hashlib.blake2b(digest_size=16)
        if self.cuda:  # a position-weighted checksum per buffer, on the GPU (GiBs per run)
            torch = self.torch
            for t in self.kv:
                x = t[:pages].reshape(-1).view(torch.int32).to(torch.int64)
                w = torch.arange(x.numel(), device=x.device, dtype=torch.int64) % 1_000_003 + 1
                h.update(str(int((x * w).sum())).encode())
            return h.hexdigest()
        for t in self.kv:
            h.update(t[:pages].tobytes())
        return h.hexdigest()


def _config(backend: str, staging: str, options: dict[str, Any]) -> KVWireConfig:
    return KVWireConfig(
        transfer_backend=backend,
        transfer_backend_options=options,
        staging=staging,
        # 2 s beats: a rank busy with its model's compute on a loaded host must not be
        # evicted (0.5 s beats bound silence at 1.5 s)
        control=ControlOptions(heartbeat_interval_s=2.0),
    )


def _prefill_main(conn: Connection, args: dict[str, Any], backend: str) -> None:
    a = BenchArgs(**args)
    eng = _Engine(a, with_model=True)
    cfg = _config(backend, a.staging, a.backend_options)
    cfg.control = cfg.control.model_copy(update={"layerwise_groups": a.groups})
    mgr = KVManager(cfg, Role.PREFILL, eng.layout, kv_tensors=eng.kv)
    conn.send(("ready", mgr.bootstrap_addr))
    try:
        while (cmd := conn.recv())[0] in ("run", "peer"):
            if cmd[0] == "peer":
                _, nbytes, to_gpu = cmd
                conn.send(("peer", eng.peer_copy_ms(nbytes, to_gpu)))
                continue
            _, mode, tokens, room = cmd
            pages = -(-tokens // a.page_size)
            x = eng.prompt(tokens)
            tx = None
            if mode != "compute":
                tx = mgr.sender(room)
                while tx.poll() < KVPoll.WaitingForInput:
                    time.sleep(0.0005)
                tx.init(pages, 0)
            if eng.cuda:
                eng.torch.cuda.synchronize()
            t0 = time.monotonic()
            if tx is not None and mode == "layer":
                tx.send(np.arange(pages), last=True, layerwise=True)
            h = x
            for i in range(a.layers):
                h = eng.layer(i, h, pages)
                if tx is not None and mode == "layer":
                    tx.layer_ready(i, event=eng.event())
            if tx is not None and mode == "chunk":
                if eng.cuda:
                    eng.torch.cuda.synchronize()  # per-chunk: the pass ends before the send
                tx.send(np.arange(pages), last=True)
            if eng.cuda and mode == "compute":
                eng.torch.cuda.synchronize()
            t_compute = time.monotonic()
            status = KVPoll.Success
            if tx is not None:
                while (status := tx.poll()) not in (KVPoll.Success, KVPoll.Failed):
                    time.sleep(0.0005)
                tx.clear()
            conn.send(("done", t0, t_compute, int(status), eng.digest(pages)))
    finally:
        mgr.close()


def _decode_main(conn: Connection, args: dict[str, Any], backend: str) -> None:
    a = BenchArgs(**args)
    eng = _Engine(a, with_model=False)
    mgr = KVManager(
        _config(backend, a.staging, a.backend_options), Role.DECODE, eng.layout, kv_tensors=eng.kv
    )
    conn.send(("ready", str(eng.gpu)))
    try:
        while (cmd := conn.recv())[0] == "recv":
            _, tokens, room, addr = cmd
            pages = -(-tokens // a.page_size)
            for t in eng.kv:
                t[:pages] = 0
            rx = mgr.receiver(room, addr)
            rx.init()
            rx.send_metadata(np.arange(pages), 0)
            conn.send(("asked",))
            while (status := rx.poll()) not in (KVPoll.Success, KVPoll.Failed):
                time.sleep(0.0001)
            t_ready = time.monotonic()
            err = None
            if status != KVPoll.Success:
                try:
                    rx.failure_exception()
                except Exception as exc:
                    err = str(exc)
            rx.clear()
            conn.send(("ready", t_ready, int(status), eng.digest(pages), err))
    finally:
        mgr.close()


def _spawn(target: Any, args: BenchArgs, backend: str) -> tuple[Any, Connection, str]:
    """Start one side; returns its process, pipe and bootstrap address (prefill)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, args.model_dump(), backend), daemon=True)
    proc.start()
    msg = None
    deadline = time.monotonic() + 300  # a CUDA + NIXL start takes a while on a loaded host
    while proc.is_alive() and time.monotonic() < deadline:
        if parent.poll(0.2):
            msg = parent.recv()
            break
    if msg is None or msg[0] != "ready":
        proc.kill()
        raise RuntimeError(f"{target.__name__} did not start (exit code {proc.exitcode})")
    return proc, parent, str(msg[1])


class Row(BaseModel):
    """Median times of one (backend, prompt length)."""

    backend: str
    tokens: int
    mb: float
    compute_ms: float
    chunk_ms: float
    layer_ms: float
    peer_ms: float | None = None
    prefill_gpu: int | None = None
    decode_gpu: int | None = None
    corrupt: int = 0
    failed: int = 0

    @property
    def layer_vs_compute(self) -> float:
        return self.layer_ms / self.compute_ms

    @property
    def chunk_vs_compute(self) -> float:
        return self.chunk_ms / self.compute_ms


def measure(a: BenchArgs, console: Console) -> list[Row]:
    """Every (backend, length, mode) ``repeat`` times, modes interleaved."""
    rows: list[Row] = []
    one_blas = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    saved = {k: os.environ.get(k) for k in one_blas}
    total = len(a.backends) * len(a.tokens) * a.repeat * len(MODES)
    room = int(time.time() * 1000) << 16
    with progress_bar(console) as progress:
        task = progress.add_task("bench-layerwise", total=total)
        for backend in a.backends:
            os.environ.update(one_blas)  # the children read it at start
            try:
                pproc, pconn, bootstrap = _spawn(_prefill_main, a, backend)
                dproc, dconn, d_gpu = _spawn(_decode_main, a, backend)
            finally:
                for k, v in saved.items():  # the parent's own settings back
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            try:
                for tokens in a.tokens:
                    times: dict[str, list[float]] = {m: [] for m in MODES}
                    corrupt = failed = 0
                    for _ in range(a.repeat):
                        for mode in MODES:
                            room += 1
                            if mode != "compute":
                                dconn.send(("recv", tokens, room, bootstrap))
                                dconn.recv()
                            pconn.send(("run", mode, tokens, room))
                            _, t0, t_comp, status, p_digest = pconn.recv()
                            if mode == "compute":
                                times[mode].append(t_comp - t0)
                            else:
                                _, t_ready, d_status, d_digest, _err = dconn.recv()
                                if status != KVPoll.Success or d_status != KVPoll.Success:
                                    failed += 1
                                elif d_digest != p_digest:
                                    corrupt += 1
                                times[mode].append(t_ready - t0)
                            progress.advance(task)
                    pages = -(-tokens // a.page_size)
                    nbytes = pages * a.page_size * a.heads * a.head_dim * 4 * 2 * a.layers
                    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
                    peer = None
                    if a.device == "cuda":
                        pconn.send(("peer", nbytes, int(d_gpu)))
                        peer = float(pconn.recv()[1])
                    rows.append(
                        Row(
                            backend=backend,
                            tokens=tokens,
                            mb=nbytes / 1e6,
                            compute_ms=med["compute"],
                            chunk_ms=med["chunk"],
                            layer_ms=med["layer"],
                            peer_ms=peer,
                            prefill_gpu=0 if a.device == "cuda" else None,
                            decode_gpu=int(d_gpu) if a.device == "cuda" else None,
                            corrupt=corrupt,
                            failed=failed,
                        )
                    )
            finally:
                for conn, proc in ((pconn, pproc), (dconn, dproc)):
                    with contextlib.suppress(OSError):  # a side that died has no pipe
                        conn.send(("stop",))
                    proc.join(20)
                    if proc.is_alive():
                        proc.kill()
    return rows


def render(rows: Sequence[Row]) -> Table:
    """The results table with its ratios."""
    t = Table(title="time to decode-ready: layer-wise vs per-chunk (medians)")
    for col in ("backend", "GPUs", "tokens", "KV MB", "compute ms", "chunk ms", "layer ms"):
        t.add_column(col, justify="right")
    t.add_column("peer ms", justify="right")
    for col in ("chunk/compute", "layer/compute", "chunk/layer", "corrupt", "failed"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r.backend,
            "-" if r.decode_gpu is None else f"{r.prefill_gpu}->{r.decode_gpu}",
            str(r.tokens),
            f"{r.mb:.1f}",
            f"{r.compute_ms:.1f}",
            f"{r.chunk_ms:.1f}",
            f"{r.layer_ms:.1f}",
            "-" if r.peer_ms is None else f"{r.peer_ms:.1f}",
            f"{r.chunk_vs_compute:.2f}x",
            f"{r.layer_vs_compute:.2f}x",
            f"{r.chunk_ms / r.layer_ms:.2f}x",
            str(r.corrupt),
            str(r.failed),
        )
    return t


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvwire bench-layerwise``."""
    d = BenchArgs()
    p.add_argument("--backends", default=",".join(d.backends), help="comma-separated backends")
    p.add_argument("--tokens", default=",".join(map(str, d.tokens)), help="prompt lengths")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden", type=int, default=d.hidden, help="model width (compute per layer)")
    p.add_argument("--heads", type=int, default=d.heads, help="KV heads")
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--repeat", type=int, default=d.repeat, help="runs per mode (median)")
    p.add_argument("--groups", type=int, default=d.groups, help="layerwise_groups option")
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device)
    p.add_argument(
        "--decode-gpu",
        type=int,
        default=None,
        help="decode's CUDA device (default: 1 when two GPUs are visible, else 0; prefill: 0)",
    )
    p.add_argument("--staging", default=d.staging, help="staging strategy of both sides")
    p.add_argument(
        "--backend-options",
        default="{}",
        help="transfer_backend_options of both sides, as JSON, e.g. "
        "'{\"copy_engine_min_bytes\": 0}'",
    )
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")


def run(args: argparse.Namespace, console: Console) -> int:
    """Entry point of ``kvwire bench-layerwise``; non-zero on any failure or corruption."""
    a = BenchArgs(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        tokens=[int(x) for x in args.tokens.split(",")],
        repeat=args.repeat,
        groups=args.groups,
        device=args.device,
        backends=args.backends.split(","),
        staging=args.staging,
        backend_options=json.loads(args.backend_options),
        decode_gpu=args.decode_gpu,
    )
    rows = measure(a, console)
    console.print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": a.model_dump(), "rows": [r.model_dump() for r in rows]}, f, indent=1)
    return 1 if any(r.corrupt or r.failed for r in rows) else 0
