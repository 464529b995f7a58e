"""``kvwire demo``: a real cross-process KV transfer, verified element by element.

The parent process plays a prefill instance of ``--prefill-tp`` ranks (one backend agent and
one KV pool per rank); each decode rank of ``--decode-tp`` runs in its own spawned process with
its own agent and pool. For every request, each decode rank allocates random pages (as it would
before sending its metadata), the prefill ranks write the request's KV through the selected
index mapper and backend, and the decode rank checks every element against the encoding of
:mod:`kvwire.testing.kvfill` when the notifications of all its senders have arrived.

Until the control plane lands, the demo wires the ranks together itself (metadata and page
lists travel over multiprocessing pipes); the data moves over the real backend.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvwire.backend import TransferBackend, XferOp, XferState
from kvwire.config import KVWireConfig, config_from_args
from kvwire.errors import KVWireError
from kvwire.index import default_mapper_name, source_ranks
from kvwire.index.base import IndexMapper
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.selection import auto_backend_name, create_backend, select_mapper
from kvwire.testing.kvfill import count_mismatches, fill_pages, make_pool


def add_demo_args(p: argparse.ArgumentParser) -> None:
    """Demo-specific options."""
    p.add_argument("--requests", type=int, default=200, help="requests per phase")
    p.add_argument("--tokens", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8, help="total KV heads of the model")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument(
        "--phases",
        default="2:1,2:2",
        help="comma-separated prefill_tp:decode_tp pairs to run (default 2:1,2:2)",
    )
    p.add_argument("--seed", type=int, default=0)


@dataclass
class _Shape:
    model: ModelSpec
    slots: int
    tokens: int

    @property
    def pages(self) -> int:
        return -(-self.tokens // self.model.page_size)


def _decode_main(
    conn: Connection, shape_json: bytes, rank: int, tp: int, config_json: str, seed: int
) -> None:
    """Decode rank process: own pool and agent; allocate pages, verify on notification."""
    model = ModelSpec.model_validate_json(shape_json)
    config = KVWireConfig.model_validate_json(config_json)
    slots = int(conn.recv())
    layout, arrays = make_pool(model, RankPosition(tp_size=tp, tp_rank=rank), slots)
    backend = create_backend(config, f"decode-{rank}")
    try:
        backend.register(layout.buffers)
        conn.send((backend.local_metadata(), layout.model_dump_json()))
        rng = np.random.default_rng(seed + 1000 + rank)
        free = list(rng.permutation(slots))
        pending: dict[int, tuple[np.ndarray, int, float]] = {}
        arrived: dict[int, int] = {}
        while True:
            if conn.poll(0.0005):
                msg = conn.recv()
                if msg[0] == "stop":
                    break
                _, room, npages, senders = msg
                pages = np.array([free.pop() for _ in range(npages)], dtype=np.int64)
                for a in arrays:
                    a[pages] = -1  # stale content must be overwritten
                pending[room] = (pages, senders, time.perf_counter())
                conn.send(("pages", room, pages))
            for note in backend.get_notifications():
                info = msgpack.unpackb(note.payload)
                room = int(info["room"])
                arrived[room] = arrived.get(room, 0) + 1
                pages, senders, _t0 = pending[room]
                if arrived[room] == senders:
                    bad = count_mismatches(layout, arrays, pages, 0)
                    free.extend(pages.tolist())
                    del pending[room], arrived[room]
                    conn.send(("verified", room, bad))
    finally:
        backend.close()


@dataclass
class _Prefill:
    layout: KVLayout
    arrays: list[np.ndarray]
    backend: TransferBackend
    # per decode rank: (mapper, prepared pair)
    links: dict[int, tuple[IndexMapper, Any]] = field(default_factory=dict)


@dataclass
class PhaseResult:
    """What one phase moved and verified."""

    prefill_tp: int
    decode_tp: int
    requests: int
    bytes_moved: int
    seconds: float
    latencies: list[float]
    descs_per_request: float
    corruptions: int
    failures: int


def run_phase(
    config: KVWireConfig,
    model: ModelSpec,
    tp_p: int,
    tp_d: int,
    requests: int,
    tokens: int,
    concurrency: int,
    seed: int,
    on_progress: Callable[[], None] = lambda: None,
) -> PhaseResult:
    """Run one prefill_tp -> decode_tp phase and return its figures."""
    shape = _Shape(
        model, slots=concurrency * (-(-tokens // model.page_size)) * 2 + 8, tokens=tokens
    )
    ctx = mp.get_context("spawn")
    conns: list[Connection] = []
    procs = []
    for r in range(tp_d):
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=_decode_main,
            args=(child, model.model_dump_json().encode(), r, tp_d, config.model_dump_json(), seed),
            daemon=True,
        )
        p.start()
        parent.send(shape.slots)
        conns.append(parent)
        procs.append(p)
    prefills: list[_Prefill] = []
    try:
        remote = []
        for c in conns:
            if not c.poll(60):
                raise RuntimeError("decode process did not start within 60 s")
            meta, layout_json = c.recv()
            remote.append((meta, KVLayout.model_validate_json(layout_json)))
        for s in range(tp_p):
            layout, arrays = make_pool(model, RankPosition(tp_size=tp_p, tp_rank=s), shape.slots)
            be = create_backend(config, f"prefill-{s}")
            be.register(layout.buffers)
            prefills.append(_Prefill(layout, arrays, be))
        for d, (meta, dlayout) in enumerate(remote):
            for s in source_ranks(d, tp_p, tp_d):
                pf = prefills[s]
                name = (
                    config.index_mapper
                    if config.index_mapper != "auto"
                    else default_mapper_name(pf.layout, dlayout)
                )
                sel = select_mapper(name, config.index_mapper_options)
                mapper: IndexMapper = sel.cls(pf.layout, dlayout, sel.options)
                peer = pf.backend.add_peer(meta)
                tables = mapper.build_tables()
                pf.links[d] = (mapper, pf.backend.prepare(peer, tables.src, tables.dst))
        rng = np.random.default_rng(seed)
        free_src = [list(rng.permutation(shape.slots)) for _ in prefills]
        t_start = time.perf_counter()
        timeout_s = 60.0 + 0.5 * requests
        deadline = time.monotonic() + timeout_s
        latencies: list[float] = []
        moved = descs = corrupt = failed = 0
        inflight: dict[int, dict[str, Any]] = {}
        backlog: list[tuple[Any, ...]] = []
        next_room = 1
        done = 0
        while done < requests:
            while next_room <= requests and len(inflight) < concurrency:
                room = next_room
                next_room += 1
                req: dict[str, Any] = {"t0": time.perf_counter(), "handles": [], "left": tp_d}
                src_pages = []
                for i, pf in enumerate(prefills):
                    pages = np.array([free_src[i].pop() for _ in range(shape.pages)])
                    fill_pages(pf.layout, pf.arrays, pages, 0)
                    src_pages.append(pages)
                req["src_pages"] = src_pages
                for d, c in enumerate(conns):
                    senders = source_ranks(d, tp_p, tp_d)
                    active = [s for s in senders if not prefills[s].links[d][0].is_dummy]
                    c.send(("alloc", room, shape.pages, len(active)))
                    while True:  # verification results may come first; keep them for later
                        msg = c.recv()
                        if msg[0] == "pages":
                            dst_pages = msg[2]
                            break
                        backlog.append(msg)
                    for s in active:
                        mapper, pair = prefills[s].links[d]
                        si, di = mapper.map_chunk(src_pages[s], dst_pages)
                        note = msgpack.packb({"room": room, "sender": s})
                        h = prefills[s].backend.submit(XferOp.WRITE, pair, si, di, note)
                        req["handles"].append((prefills[s].backend, h))
                        descs += int(si.size)
                inflight[room] = req
            for req in list(inflight.values()):
                for be, h in list(req["handles"]):
                    st = be.poll(h)
                    if st is XferState.PENDING:
                        continue
                    if st is XferState.FAILED:
                        failed += 1
                    else:
                        moved += h.num_bytes
                    be.release(h)
                    req["handles"].remove((be, h))
            for c in conns:
                while c.poll(0):
                    backlog.append(c.recv())
            for _, room, bad in backlog:
                inflight[room]["left"] -= 1
                corrupt += bad
            backlog.clear()
            for room, req in list(inflight.items()):
                if req["left"] == 0 and not req["handles"]:
                    latencies.append(time.perf_counter() - req["t0"])
                    for i, pages in enumerate(req["src_pages"]):
                        free_src[i].extend(pages.tolist())
                    del inflight[room]
                    done += 1
                    on_progress()
            if time.monotonic() > deadline:
                raise TimeoutError(f"phase {tp_p}->{tp_d} did not finish in {timeout_s:.0f}s")
            if not all(p.is_alive() for p in procs):
                raise RuntimeError("a decode process died; see its traceback above")
            time.sleep(0.0002)
        seconds = time.perf_counter() - t_start
        return PhaseResult(
            tp_p,
            tp_d,
            requests,
            moved,
            seconds,
            latencies,
            descs / max(requests, 1),
            corrupt,
            failed,
        )
    finally:
        for pf in prefills:
            pf.backend.close()
        for c in conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                c.send(("stop",))
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def run(args: argparse.Namespace, console: Console) -> int:
    """Entry point of ``kvwire demo``; non-zero exit on any corruption or failure."""
    config = config_from_args(args)
    model = ModelSpec(
        num_layers=args.layers,
        total_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype="int32",
        page_size=args.page_size,
    )
    phases = [tuple(int(x) for x in ph.split(":")) for ph in args.phases.split(",")]
    backend = config.transfer_backend
    if backend == "auto":
        backend = auto_backend_name()
        config = config.model_copy(update={"transfer_backend": backend})
    console.print(
        f"kvwire demo: backend [bold]{backend}[/], {args.requests} requests x {args.tokens} "
        f"tokens per phase, model {args.layers} layers x {args.kv_heads} KV heads x "
        f"{args.head_dim} dims, page size {args.page_size}"
    )
    results = []
    try:
        with Progress(console=console, transient=True) as progress:
            for tp_p, tp_d in phases:
                task = progress.add_task(f"{tp_p} prefill -> {tp_d} decode", total=args.requests)
                results.append(
                    run_phase(
                        config,
                        model,
                        tp_p,
                        tp_d,
                        args.requests,
                        args.tokens,
                        args.concurrency,
                        args.seed,
                        on_progress=functools.partial(progress.advance, task),
                    )
                )
    except (KVWireError, TimeoutError, RuntimeError) as exc:
        console.print(f"[red]FAILED[/]: {type(exc).__name__}: {exc}")
        return 1
    table = Table(title="kvwire demo results")
    for col in (
        "TP p->d",
        "reqs",
        "MB",
        "GB/s",
        "p50 ms",
        "p99 ms",
        "descs/req",
        "failed",
        "corrupt",
    ):
        table.add_column(col, justify="right")
    ok = True
    for r in results:
        lat = np.array(r.latencies) * 1e3
        table.add_row(
            f"{r.prefill_tp}->{r.decode_tp}",
            str(r.requests),
            f"{r.bytes_moved / 1e6:.1f}",
            f"{r.bytes_moved / r.seconds / 1e9:.3f}",
            f"{np.percentile(lat, 50):.1f}",
            f"{np.percentile(lat, 99):.1f}",
            f"{r.descs_per_request:.0f}",
            str(r.failures),
            str(r.corruptions),
        )
        ok &= r.corruptions == 0 and r.failures == 0 and len(r.latencies) == r.requests
    console.print(table)
    console.print("[green]every element verified[/]" if ok else "[red]FAILED[/]")
    return 0 if ok else 1
