"""``python -m kvwire_nixl.bench``: kvwire's ``nixl`` backend against raw NIXL calls.

Two processes: a spawned target runs a kvwire ``nixl`` agent (the target loop of
:mod:`kvwire.bench.backend`: it drives progress, drains notifications and digests
its buffer on request). This process holds a kvwire ``nixl`` agent *and* a raw NIXL agent
created with the same configuration (progress thread off); both register the same source
buffer and address the same target rows, so every figure compares like with like.

1. Throughput, WRITE and READ, one 256 MiB descriptor and 4096 x 16 KiB descriptors
   (target rows shuffled over twice the span, so nothing merges): kvwire ``submit`` /
   ``poll`` / ``release`` against raw ``make_prepped_xfer`` / ``transfer`` /
   ``check_xfer_state``. A WRITE counts as done when the target has drained its notification
   (both paths send the same tagged notification). Bytes are verified by digest; a local
   ``memcpy`` gives the machine's ceiling.
2. Chunks of 1 to 8192 descriptors of 4 KiB: the cost of creating the transfer with
   prepared tables (``make_prepped_xfer`` with two index arrays) against the one-shot API
   (``initialize_xfer`` from two ``N x 3`` NumPy arrays), and the time per chunk from
   submission to DONE for raw prepared, raw one-shot and kvwire, whose difference to raw
   prepared is kvwire's per-chunk overhead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np
from rich.console import Console
from rich.table import Table

from kvwire.backend import TransferBackend, XferOp, XferState
from kvwire.bench.backend import await_reply, target_main
from kvwire.config import KVWireConfig, parse_options
from kvwire.descriptors import make_table
from kvwire.layout import MemoryRegion
from kvwire.selection import create_backend
from kvwire_nixl.agent import ENGINE
from kvwire_nixl.inbox import NOTIF_TAG

#: (label, descriptor count, bytes per descriptor)
THROUGHPUT_CASES = [("1 x 256 MiB", 1, 256 << 20), ("4096 x 16 KiB", 4096, 16 << 10)]
CHUNK_ROW = 4096
CHUNK_SIZES = (1, 64, 1024, 8192)


@dataclass
class ThroughputRow:
    """One throughput case."""

    op: str
    case: str
    bytes: int
    kvwire_gbps: float
    raw_gbps: float
    memcpy_gbps: float
    verified: bool


@dataclass
class ChunkRow:
    """One chunk size: medians in microseconds."""

    rows: int
    bytes: int
    create_prepped_us: float
    create_oneshot_us: float
    raw_prepped_us: float
    raw_oneshot_us: float
    kvwire_us: float


class _Raw:
    """The raw NIXL side: an agent configured like kvwire's, and its prepared lists."""

    def __init__(self, meta: bytes, src: np.ndarray) -> None:
        api = ENGINE.api
        self.agent = api.nixl_agent(
            "bench-raw",
            api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
        )
        self.reg = self.agent.register_memory(
            np.array([[src.ctypes.data, src.size, 0]], dtype=np.uint64), "DRAM"
        )
        peer = self.agent.add_remote_agent(msgpack.unpackb(meta, raw=False)["md"])
        self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)

    def prep(self, local: np.ndarray, remote: np.ndarray) -> tuple[Any, Any]:
        return (
            self.agent.prep_xfer_dlist("", local, "DRAM"),
            self.agent.prep_xfer_dlist(self.peer, remote, "DRAM"),
        )

    def wait(self, h: Any) -> None:
        while (s := self.agent.check_xfer_state(h)) == "PROC":
            pass
        if s != "DONE":
            raise RuntimeError(f"raw NIXL transfer ended {s}")

    def close(self) -> None:
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.reg)


def _kv_wait(backend: TransferBackend, h: Any) -> None:
    while (st := backend.poll(h)) is XferState.PENDING:
        pass
    backend.release(h)
    if st is not XferState.DONE:
        raise RuntimeError(f"kvwire transfer ended {st.name}: {h.error}")


def _best_pair(a: Callable[[], None], b: Callable[[], None], repeat: int) -> tuple[float, float]:
    """Best seconds of ``a`` and of ``b``, run alternately (so drift hits both alike)."""
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(repeat):
        for fn, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(ta), min(tb)


def _medians_us(fns: list[Callable[[], None]], repeat: int) -> list[float]:
    """Median microseconds of each of ``fns``, run round-robin ``repeat`` times."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [float(np.median(ts)) * 1e6 for ts in times]


def measure(
    options: dict[str, Any], repeat: int, chunk_repeat: int
) -> tuple[list[ThroughputRow], list[ChunkRow]]:
    """Run both parts; the target is spawned and stopped here."""
    config = KVWireConfig(transfer_backend="nixl", transfer_backend_options=options)
    span = max(n * size for _, n, size in THROUGHPUT_CASES)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(child, config.model_dump_json(), 2 * span))
    proc.start()
    backend = create_backend(config, "bench-initiator")
    raw: _Raw | None = None
    try:
        if not parent.poll(120):
            raise TimeoutError("bench target did not start")
        meta, remote_base = parent.recv()
        src = np.random.default_rng(1).integers(0, 256, span, np.uint8)
        backend.register([MemoryRegion.from_tensor(src, item_len=1)])
        peer = backend.add_peer(meta)
        raw = _Raw(meta, src)
        rows = [
            _throughput_case(backend, raw, peer, parent, src, remote_base, case, op, repeat)
            for case in THROUGHPUT_CASES
            for op in (XferOp.WRITE, XferOp.READ)
        ]
        chunks = _chunks(backend, raw, peer, src, remote_base, chunk_repeat)
    finally:
        if raw is not None:
            raw.close()
        backend.close()
        parent.send(("stop",))
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return rows, chunks


def _throughput_case(
    backend: TransferBackend,
    raw: _Raw,
    peer: str,
    conn: Connection,
    src: np.ndarray,
    remote_base: int,
    case: tuple[str, int, int],
    op: XferOp,
    repeat: int,
) -> ThroughputRow:
    label, n, size = case
    local_offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
    remote_offs = np.random.default_rng(2).permutation(2 * n)[:n].astype(np.uint64)
    remote_offs *= np.uint64(size)
    local = make_table(src.ctypes.data + local_offs, size)
    remote = make_table(remote_base + remote_offs, size)
    pair = backend.prepare(peer, local, remote)
    rl, rr = raw.prep(local, remote)
    idx = np.arange(n)
    dst = src[: n * size].copy()
    t0 = time.perf_counter()
    for _ in range(repeat):
        np.copyto(dst, src[: n * size])
    memcpy = n * size * repeat / (time.perf_counter() - t0) / 1e9
    del dst
    if op is XferOp.READ:
        conn.send(("fill", 3))
        await_reply(conn, "filled")
    note = b"bench" if op is XferOp.WRITE else None

    def kv() -> None:
        _kv_wait(backend, backend.submit(op, pair, idx, idx, note))
        if note is not None:
            await_reply(conn, "notified")

    def rw() -> None:
        msg = b"" if note is None else NOTIF_TAG + note
        h = raw.agent.make_prepped_xfer(op.name, rl, idx, rr, idx, msg)
        raw.agent.transfer(h)
        raw.wait(h)
        h.release()
        if note is not None:
            await_reply(conn, "notified")

    try:
        kv()  # warm-up: connection and page faults
        rw()
        best_kv, best_raw = _best_pair(kv, rw, repeat)
        conn.send(("digest", remote_offs.tolist(), size))
        remote_digest = await_reply(conn, "digest")[1]
    finally:
        rl.release()
        rr.release()
        backend.release_prepared(pair)
    data = b"".join(src[int(o) : int(o) + size].tobytes() for o in local_offs.tolist())
    return ThroughputRow(
        op.name,
        label,
        n * size,
        n * size / best_kv / 1e9,
        n * size / best_raw / 1e9,
        memcpy,
        hashlib.blake2b(data).hexdigest() == remote_digest,
    )


def _chunks(
    backend: TransferBackend,
    raw: _Raw,
    peer: str,
    src: np.ndarray,
    remote_base: int,
    repeat: int,
) -> list[ChunkRow]:
    total = max(CHUNK_SIZES)
    local = make_table(src.ctypes.data + np.arange(total, dtype=np.uint64) * CHUNK_ROW, CHUNK_ROW)
    perm = np.random.default_rng(4).permutation(2 * total)[:total].astype(np.uint64)
    remote = make_table(remote_base + perm * np.uint64(CHUNK_ROW), CHUNK_ROW)
    pair = backend.prepare(peer, local, remote)
    rl, rr = raw.prep(local, remote)
    try:
        return [
            _chunk_case(backend, raw, pair, local, remote, (rl, rr), n, repeat) for n in CHUNK_SIZES
        ]
    finally:
        rl.release()
        rr.release()
        backend.release_prepared(pair)


def _chunk_case(
    backend: TransferBackend,
    raw: _Raw,
    pair: Any,
    local: np.ndarray,
    remote: np.ndarray,
    prepped: tuple[Any, Any],
    n: int,
    repeat: int,
) -> ChunkRow:
    agent = raw.agent
    rl, rr = prepped
    rng = np.random.default_rng(n)
    li = rng.choice(local.shape[0], n, replace=False).astype(np.int64)
    ri = rng.choice(remote.shape[0], n, replace=False).astype(np.int64)
    reps = max(5, repeat * 256 // n) if n > 256 else repeat * 10

    def create_prepped() -> None:
        agent.make_prepped_xfer("WRITE", rl, li, rr, ri).release()

    def oneshot_handle() -> Any:
        return agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs(local[li], "DRAM"),
            agent.get_xfer_descs(remote[ri], "DRAM"),
            raw.peer,
        )

    def create_oneshot() -> None:
        oneshot_handle().release()

    def raw_prepped() -> None:
        h = agent.make_prepped_xfer("WRITE", rl, li, rr, ri)
        agent.transfer(h)
        raw.wait(h)
        h.release()

    def raw_oneshot() -> None:
        h = oneshot_handle()
        agent.transfer(h)
        raw.wait(h)
        h.release()

    def kv() -> None:
        _kv_wait(backend, backend.submit(XferOp.WRITE, pair, li, ri))

    fns = [create_prepped, create_oneshot, raw_prepped, raw_oneshot, kv]
    for fn in fns:  # warm-up
        fn()
    return ChunkRow(n, n * CHUNK_ROW, *_medians_us(fns, reps))


def render(
    rows: list[ThroughputRow], chunks: list[ChunkRow], console: Console, repeat: int
) -> None:
    """Print both tables."""
    t = Table(
        title=f"kvwire nixl vs raw NIXL ({ENGINE.distribution} {ENGINE.version}), two "
        f"processes, best of {repeat}"
    )
    for col in ("op", "case", "kvwire GB/s", "raw GB/s", "kvwire/raw", "memcpy GB/s", "verified"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r.op,
            r.case,
            f"{r.kvwire_gbps:.2f}",
            f"{r.raw_gbps:.2f}",
            f"{r.kvwire_gbps / r.raw_gbps:.2f}",
            f"{r.memcpy_gbps:.2f}",
            "yes" if r.verified else "[red]NO[/]",
        )
    console.print(t)
    c = Table(title=f"WRITE chunks of {CHUNK_ROW} B descriptors, medians in µs")
    for col in (
        "rows",
        "create prepped",
        "create one-shot",
        "one-shot/prepped",
        "raw prepped e2e",
        "raw one-shot e2e",
        "kvwire e2e",
        "kvwire overhead",
    ):
        c.add_column(col, justify="right")
    for k in chunks:
        c.add_row(
            str(k.rows),
            f"{k.create_prepped_us:.1f}",
            f"{k.create_oneshot_us:.1f}",
            f"{k.create_oneshot_us / k.create_prepped_us:.2f}",
            f"{k.raw_prepped_us:.1f}",
            f"{k.raw_oneshot_us:.1f}",
            f"{k.kvwire_us:.1f}",
            f"{k.kvwire_us - k.raw_prepped_us:+.1f}",
        )
    console.print(c)
    console.print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; e2e = create + post + poll until DONE (no notification)"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m kvwire_nixl.bench``."""
    parser = argparse.ArgumentParser(prog="python -m kvwire_nixl.bench", description=__doc__)
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per throughput case")
    parser.add_argument(
        "--chunk-repeat", type=int, default=20, help="timed runs per chunk size (scaled)"
    )
    parser.add_argument(
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="nixl backend option (JSON values accepted); repeatable",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    options = parse_options(args.option, "--option")
    rows, chunks = measure(options, args.repeat, args.chunk_repeat)
    render(rows, chunks, Console(width=max(Console().width, 132)), args.repeat)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"throughput": [asdict(r) for r in rows], "chunks": [asdict(k) for k in chunks]},
                fh,
                indent=2,
            )
    return 0 if all(r.verified for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
