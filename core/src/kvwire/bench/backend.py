"""``kvwire bench-backend``: raw backend throughput between two processes.

A spawned target process registers one buffer and drains notifications; this process
registers a source buffer of random bytes and times WRITE (and READ, where supported) of each
case: one large descriptor and many small ones (non-contiguous on the target, so nothing can be
merged). Each timed transfer is checked: the target's digest of the written range must equal
the source's. A local ``memcpy`` of the same bytes gives the machine's ceiling, and for ``tcp``
the same bytes pushed through raw ZeroMQ sockets (no gather, scatter or checks) give the
engine's ceiling; both ratios come from the same run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import zmq
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvwire.backend import XferOp, XferState
from kvwire.config import KVWireConfig, config_from_args
from kvwire.descriptors import make_table
from kvwire.layout import MemoryRegion
from kvwire.selection import auto_backend_name, create_backend

#: (label, descriptor count, bytes per descriptor)
CASES = [("1 x 256 MiB", 1, 256 << 20), ("4096 x 16 KiB", 4096, 16 << 10)]


@dataclass
class BenchRow:
    """One measured case."""

    backend: str
    op: str
    case: str
    descs: int
    bytes: int
    best_s: float
    median_s: float
    gbps_best: float
    memcpy_gbps: float
    verified: bool
    #: Same bytes through the engine's own raw API (for tcp: ZeroMQ PUSH/PULL), or None.
    raw_gbps: float | None = None


def target_main(conn: Connection, config_json: str, nbytes: int) -> None:
    config = KVWireConfig.model_validate_json(config_json)
    buf = np.zeros(nbytes, dtype=np.uint8)
    backend = create_backend(config, "bench-target")
    try:
        backend.register([MemoryRegion.from_tensor(buf, item_len=1)])
        conn.send((backend.local_metadata(), buf.ctypes.data))
        while True:
            backend.progress()
            for note in backend.get_notifications():
                conn.send(("notified", note.payload))
            if conn.poll(0.0005):
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                if msg[0] == "digest":
                    offs, size = msg[1], msg[2]
                    parts = [buf[o : o + size].tobytes() for o in offs]
                    conn.send(("digest", hashlib.blake2b(b"".join(parts)).hexdigest()))
                if msg[0] == "sink":
                    _raw_sink(conn, msg[1], msg[2])
                if msg[0] == "fill":
                    buf[:] = np.random.default_rng(msg[1]).integers(0, 256, nbytes, np.uint8)
                    conn.send(("filled",))
    finally:
        backend.close()


def _raw_sink(conn: Connection, messages: int, repeat: int) -> None:
    """Target side of the raw ZeroMQ baseline: receive ``messages`` frames ``repeat`` times."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(("sink_ready", f"tcp://127.0.0.1:{port}"))
    try:
        for _ in range(repeat):
            got = sum(len(sock.recv(copy=False)) for _ in range(messages))
            conn.send(("sunk", got))
    finally:
        sock.close(linger=0)


def raw_zmq_gbps(conn: Connection, payload: np.ndarray, part: int, repeat: int) -> float:
    """Best GB/s of ``payload`` pushed raw (no gather, no checks) in ``part``-byte frames."""
    view = payload.data  # a memoryview: zero-copy frames
    frames = [view[i : i + part] for i in range(0, payload.size, part)]
    conn.send(("sink", len(frames), repeat))
    endpoint = await_reply(conn, "sink_ready")[1]
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    best = float("inf")
    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            for f in frames:
                sock.send(f, 0, copy=False)
            if await_reply(conn, "sunk")[1] != payload.size:
                raise RuntimeError("raw ZeroMQ baseline lost bytes")
            best = min(best, time.perf_counter() - t0)
    finally:
        sock.close(linger=0)
    return payload.size / best / 1e9


def await_reply(conn: Connection, kind: str, timeout: float = 120.0) -> tuple[Any, ...]:
    """The next message of ``kind`` from a benchmark's target process (others are dropped);
    TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            msg: tuple[Any, ...] = conn.recv()
            if msg[0] == kind:
                return msg
    raise TimeoutError(f"target did not answer {kind!r} within {timeout:.0f}s")


def measure(config: KVWireConfig, repeat: int, progress: Progress | None = None) -> list[BenchRow]:
    """Run every case for WRITE (and READ when the backend supports it)."""
    name = config.transfer_backend
    span = max(n * size for _, n, size in CASES)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(child, config.model_dump_json(), 2 * span))
    proc.start()
    rows: list[BenchRow] = []
    backend = create_backend(config, "bench-initiator")
    try:
        if not parent.poll(120):
            raise TimeoutError("bench target did not start")
        meta, remote_base = parent.recv()
        src = np.random.default_rng(1).integers(0, 256, span, np.uint8)
        backend.register([MemoryRegion.from_tensor(src, item_len=1)])
        peer = backend.add_peer(meta)
        ops = [XferOp.WRITE] + ([XferOp.READ] if backend.capabilities.read else [])
        task = progress.add_task("bench", total=len(CASES) * len(ops)) if progress else None
        for label, n, size in CASES:
            local_offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
            # Target rows are spread over 2x the span in a shuffled order: nothing merges.
            remote_offs = np.random.default_rng(2).permutation(2 * n)[:n].astype(np.uint64)
            remote_offs *= np.uint64(size)
            pair = backend.prepare(
                peer,
                make_table(src.ctypes.data + local_offs, size),
                make_table(remote_base + remote_offs, size),
            )
            dst = src[: n * size].copy()  # touched once, so the timing has no page faults
            t0 = time.perf_counter()
            for _ in range(repeat):
                np.copyto(dst, src[: n * size])
            memcpy = n * size * repeat / (time.perf_counter() - t0) / 1e9
            idx = np.arange(n)
            raw = None
            if name == "tcp":
                part = int(backend.options.max_part_bytes)  # type: ignore[attr-defined]
                raw = raw_zmq_gbps(parent, src[: n * size], part, repeat)
            for op in ops:
                if op is XferOp.READ:
                    parent.send(("fill", 3))
                    await_reply(parent, "filled")
                times = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    h = backend.submit(op, pair, idx, idx, b"bench")
                    while (st := backend.poll(h)) is XferState.PENDING:
                        time.sleep(0.0001)
                    if op is XferOp.WRITE:
                        await_reply(parent, "notified")
                    times.append(time.perf_counter() - t0)
                    backend.release(h)
                    if st is not XferState.DONE:
                        raise RuntimeError(f"{op.value} {label} failed: {h.error}")
                parent.send(("digest", remote_offs.tolist(), size))
                remote_digest = await_reply(parent, "digest")[1]
                local = b"".join(src[int(o) : int(o) + size].tobytes() for o in local_offs.tolist())
                verified = hashlib.blake2b(local).hexdigest() == remote_digest
                best = min(times)
                rows.append(
                    BenchRow(
                        name,
                        op.value,
                        label,
                        n,
                        n * size,
                        best,
                        float(np.median(times)),
                        n * size / best / 1e9,
                        memcpy,
                        verified,
                        raw,
                    )
                )
                if progress is not None and task is not None:
                    progress.advance(task)
            backend.release_prepared(pair)
    finally:
        backend.close()
        parent.send(("stop",))
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return rows


def run(args: argparse.Namespace, console: Console) -> int:
    """Entry point of ``kvwire bench-backend``."""
    config = config_from_args(args)
    if config.transfer_backend == "auto":
        config = config.model_copy(update={"transfer_backend": auto_backend_name()})
    with Progress(console=console, transient=True) as progress:
        rows = measure(config, args.repeat, progress)
    table = Table(title=f"kvwire bench-backend: {config.transfer_backend}, two processes")
    cols = (
        "op",
        "case",
        "best GB/s",
        "median ms",
        "raw GB/s",
        "vs raw",
        "memcpy GB/s",
        "vs memcpy",
        "verified",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.op,
            r.case,
            f"{r.gbps_best:.2f}",
            f"{r.median_s * 1e3:.1f}",
            "-" if r.raw_gbps is None else f"{r.raw_gbps:.2f}",
            "-" if r.raw_gbps is None else f"{r.gbps_best / r.raw_gbps:.2f}",
            f"{r.memcpy_gbps:.2f}",
            f"{r.gbps_best / r.memcpy_gbps:.2f}",
            "yes" if r.verified else "[red]NO[/]",
        )
    console.print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=2)
    return 0 if all(r.verified for r in rows) else 1
