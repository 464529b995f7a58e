"""``python -m kvwire_nixl.gpu_bench``: kvwire's ``nixl`` backend on GPU memory, against raw
NIXL and a torch peer copy of the same bytes, all in one run.

Two processes, one per GPU: a spawned target holds a kvwire ``nixl`` agent with a buffer on
``--target-gpu`` (twice the largest case, so shuffled target rows never touch), drives
progress and checks what landed; this process is the initiator on ``--gpu``. It holds a kvwire
``nixl`` agent and a raw NIXL agent created with the same configuration (progress thread
off, no listener, UCX, no internal thread sync); both register the same source buffer and
address the same target rows. Every case is a WRITE, VRAM -> VRAM, and is timed four ways:

* ``kvwire``: the public :class:`~kvwire.backend.TransferBackend` API as kvwire's workers use
  it (``prepare`` once, then ``submit`` with two index arrays, ``poll`` until DONE,
  ``release``);
* ``raw prepped``: the same prepared lists through ``prep_xfer_dlist`` / ``make_prepped_xfer``
  / ``transfer`` / ``check_xfer_state``;
* ``raw one-shot``: ``get_xfer_descs`` of both ``N x 3`` tables and ``initialize_xfer`` for
  every transfer;
* ``torch peer``: ``dst.copy_(src)`` of the same number of bytes from the initiator's GPU into
  a buffer on the target's GPU (allocated by this process), between two synchronizes.

Each method is run once on a zeroed target and the target compares every byte it received
with the source pattern (the torch copy is compared with ``torch.equal``); then the methods
take turns for ``--repeat`` rounds, each round starting with the next method. A time is from
the start of the submitting call to DONE; ``submit`` is the time the submitting call itself
took (prepared: ``make_prepped_xfer`` + ``transfer``; one-shot: ``get_xfer_descs`` x 2 +
``initialize_xfer`` + ``transfer``; kvwire: ``submit``; torch: launching ``copy_``).

A second part submits chunks of ``--chunk-row`` rows picked at random from one prepared table
(as kvwire's workers submit the pages of a request) and gives the median submit time and time
to DONE per chunk for kvwire, raw prepared and raw one-shot; kvwire's overhead per chunk is
its difference to raw prepared.

``--device cpu`` runs the same code on host memory (DRAM, UCX over cma), for a machine
without GPUs and for tests. Prints markdown tables last; ``--json`` writes every figure.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvwire_nixl.gpu_bench_args import Case, Settings, chunk_reps, parse_args
from kvwire_nixl.gpu_bench_report import (
    CaseResult,
    ChunkResult,
    MethodTimes,
    render,
    summarize,
    to_json,
)

# The source holds 64-bit word ``w`` = ``w * _MUL + _ADD``: every word differs, so a row
# written to the wrong place (or not at all) fails the target's check. No overflow below
# 2**32 words (32 GiB).
_MUL = 2654435761
_ADD = 12345


# ------------------------------------------------------------------------------ the data
def fill_pattern(buf: Any, word_start: int = 0) -> None:
    """Fill an ``int64`` torch tensor with the source pattern (word ``w`` at index 0)."""
    import torch

    torch.arange(word_start, word_start + buf.numel(), dtype=torch.int64, out=buf)
    buf.mul_(_MUL).add_(_ADD)


def rows_match(buf: Any, remote_rows: np.ndarray, local_rows: np.ndarray, row_bytes: int) -> bool:
    """Whether row ``remote_rows[k]`` of ``buf`` (``int64``) holds source row ``local_rows[k]``.

    Rows are ``row_bytes`` long and numbered from the start of each buffer.
    """
    import torch

    words = row_bytes // 8
    dev = buf.device
    got = buf.view(-1, words)[torch.as_tensor(remote_rows.astype(np.int64), device=dev)]
    starts = torch.tensor(local_rows.astype(np.int64) * words, device=dev)
    want = starts[:, None] + torch.arange(words, dtype=torch.int64, device=dev)[None, :]
    want.mul_(_MUL).add_(_ADD)
    return bool(torch.equal(got, want))


# -------------------------------------------------------------------------------- target
def _target_main(conn: Connection, options: dict[str, Any], nbytes: int, device: str) -> None:
    """The target process: a kvwire ``nixl`` agent with one buffer, checked on request."""
    import torch

    from kvwire.config import KVWireConfig
    from kvwire.layout import MemoryRegion
    from kvwire.selection import create_backend

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    buf = torch.zeros(nbytes // 8, dtype=torch.int64, device=device)
    cfg = KVWireConfig(transfer_backend="nixl", transfer_backend_options=options)
    backend = create_backend(cfg, "gpu-bench-target", need=())
    try:
        backend.register([MemoryRegion.from_tensor(buf, item_len=8)])
        conn.send(("ready", backend.local_metadata(), buf.data_ptr(), _device_name(device)))
        while True:
            backend.progress()
            backend.get_notifications()
            if not conn.poll(0.0005):
                continue
            msg = conn.recv()
            if msg[0] == "stop":
                return
            if msg[0] == "zero":
                buf.zero_()
                _sync(device)
                conn.send(("zeroed",))
            elif msg[0] == "check":
                _, remote_rows, local_rows, row_bytes = msg
                _sync(device)
                conn.send(("checked", rows_match(buf, remote_rows, local_rows, row_bytes)))
    finally:
        backend.close()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(torch.device(device))


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return str(torch.cuda.get_device_name(torch.device(device)))
    return f"{platform.machine()} host memory"


def _wait_ready(conn: Connection, proc: Any, timeout: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            return conn.recv()
        if not proc.is_alive():
            raise RuntimeError(f"the target process exited with code {proc.exitcode}")
    raise TimeoutError("the target process did not start")


def _ask(conn: Connection, msg: tuple[Any, ...], reply: str, timeout: float = 120.0) -> Any:
    conn.send(msg)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.05):
            got = conn.recv()
            if got[0] == reply:
                return got
    raise TimeoutError(f"the target did not answer {msg[0]!r}")


# ----------------------------------------------------------------------------- initiator
class _Raw:
    """A raw NIXL agent configured like kvwire's, on the same source buffer."""

    def __init__(self, meta: bytes, src: Any, mem: str, dev: int) -> None:
        import msgpack

        from kvwire_nixl.agent import ENGINE

        api = ENGINE.api
        conf = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        )
        self.mem = mem
        self.agent = api.nixl_agent("gpu-bench-raw", conf)
        nbytes = src.numel() * src.element_size()
        self.reg = self.agent.register_memory(
            np.array([[src.data_ptr(), nbytes, dev]], dtype=np.uint64), mem
        )
        peer = self.agent.add_remote_agent(msgpack.unpackb(meta, raw=False)["md"])
        self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)

    def prep(self, local: np.ndarray, remote: np.ndarray) -> tuple[Any, Any]:
        return (
            self.agent.prep_xfer_dlist("", local, self.mem),
            self.agent.prep_xfer_dlist(self.peer, remote, self.mem),
        )

    def finish(self, h: Any) -> None:
        """Poll ``h`` to a terminal state and release it; raise unless DONE."""
        while (s := self.agent.check_xfer_state(h)) == "PROC":
            pass
        h.release()
        if s != "DONE":
            raise RuntimeError(f"raw NIXL transfer ended {s}")

    def close(self) -> None:
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.reg)


@dataclass
class _Session:
    """What every measurement needs."""

    settings: Settings
    conn: Connection
    backend: Any
    raw: _Raw
    peer: str
    src: Any  # int64 torch tensor, the source pattern
    peer_dst: Any  # uint8 torch tensor on the target's device, for the torch copy
    rbase: int

    @property
    def mem(self) -> str:
        return self.raw.mem


def _tables(s: _Session, rows: int, row: int, seed: int) -> tuple[np.ndarray, np.ndarray, Any]:
    """Local rows in order, remote rows shuffled over twice the span (nothing merges)."""
    from kvwire.descriptors import make_table

    st = s.settings
    ldev = st.gpu if st.device == "cuda" else 0
    rdev = st.target_gpu if st.device == "cuda" else 0
    if st.remote_layout == "contiguous":
        remote_rows = np.arange(rows, dtype=np.uint64)
    else:
        remote_rows = np.random.default_rng(seed).permutation(2 * rows)[:rows].astype(np.uint64)
    local = make_table(
        s.src.data_ptr() + np.arange(rows, dtype=np.uint64) * np.uint64(row), row, ldev
    )
    remote = make_table(s.rbase + remote_rows * np.uint64(row), row, rdev)
    return local, remote, remote_rows


def _methods(
    s: _Session, pair: Any, prepped: tuple[Any, Any], local: np.ndarray, remote: np.ndarray
) -> dict[str, Callable[[np.ndarray, np.ndarray], float]]:
    """Each NIXL method: run rows ``li`` -> ``ri`` to DONE, return the submitting call's time."""
    from kvwire.backend import XferOp, XferState

    backend, agent, mem = s.backend, s.raw.agent, s.mem
    rl, rr = prepped

    def kvwire(li: np.ndarray, ri: np.ndarray) -> float:
        t0 = time.perf_counter()
        h = backend.submit(XferOp.WRITE, pair, li, ri)
        t1 = time.perf_counter()
        while (st := backend.poll(h)) is XferState.PENDING:
            pass
        backend.release(h)
        if st is not XferState.DONE:
            raise RuntimeError(f"kvwire transfer ended {st.name}: {h.error}")
        return t1 - t0

    def raw_prepped(li: np.ndarray, ri: np.ndarray) -> float:
        t0 = time.perf_counter()
        h = agent.make_prepped_xfer("WRITE", rl, li, rr, ri)
        status = agent.transfer(h)
        t1 = time.perf_counter()
        if status == "ERR":
            h.release()
            raise RuntimeError("raw prepared transfer() returned ERR")
        s.raw.finish(h)
        return t1 - t0

    def raw_oneshot(li: np.ndarray, ri: np.ndarray) -> float:
        t0 = time.perf_counter()
        h = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs(local[li], mem),
            agent.get_xfer_descs(remote[ri], mem),
            s.raw.peer,
        )
        status = agent.transfer(h)
        t1 = time.perf_counter()
        if status == "ERR":
            h.release()
            raise RuntimeError("raw one-shot transfer() returned ERR")
        s.raw.finish(h)
        return t1 - t0

    return {"kvwire": kvwire, "raw_prepped": raw_prepped, "raw_oneshot": raw_oneshot}


def rotated(names: list[str], start: int) -> list[str]:
    """``names`` starting at ``start`` (mod its length): each round begins with another method,
    so no method always follows the same one."""
    k = start % len(names)
    return names[k:] + names[:k]


def _timed(fn: Callable[[], float]) -> tuple[float, float]:
    t0 = time.perf_counter()
    submit = fn()
    return time.perf_counter() - t0, submit


def run_case(s: _Session, case: Case, seed: int) -> CaseResult:
    """Check then time every method on one case."""
    import torch

    n, size = case.count, case.size
    local, remote, remote_rows = _tables(s, n, size, seed)
    pair = s.backend.prepare(s.peer, local, remote)
    prepped = s.raw.prep(local, remote)
    dev, tdev = s.settings.local_device, s.settings.target_device
    src_bytes = s.src.view(torch.uint8)[: case.nbytes]
    dst_bytes = s.peer_dst[: case.nbytes]
    try:
        fns: dict[str, Callable[[], float]] = {}
        idx = np.arange(n, dtype=np.int64)
        for name, method in _methods(s, pair, prepped, local, remote).items():
            fns[name] = functools.partial(method, idx, idx)

        def torch_peer() -> float:
            # torch runs a cross-device copy on the source device's stream, fenced with the
            # destination's: both synchronizes are needed for "done" and cost a few µs.
            _sync(dev)
            _sync(tdev)
            t0 = time.perf_counter()
            dst_bytes.copy_(src_bytes, non_blocking=True)
            t1 = time.perf_counter()
            _sync(dev)
            _sync(tdev)
            return t1 - t0

        fns["torch_peer"] = torch_peer
        verified = {}
        local_rows = np.arange(n, dtype=np.int64)
        for name, fn in fns.items():
            if name == "torch_peer":
                dst_bytes.zero_()
                _sync(tdev)
                fn()
                verified[name] = bool(dst_bytes.equal(src_bytes.to(dst_bytes.device)))
            else:
                _ask(s.conn, ("zero",), "zeroed")
                fn()
                got = _ask(s.conn, ("check", remote_rows, local_rows, size), "checked")
                verified[name] = bool(got[1])
            fn()  # a second warm-up round
        times = {name: MethodTimes() for name in fns}
        for r in range(s.settings.repeat):
            for name in rotated(list(fns), r):
                times[name].add(*_timed(fns[name]))
        return summarize(case, times, verified)
    finally:
        for h in prepped:
            h.release()
        s.backend.release_prepared(pair)


def run_chunks(s: _Session, seed: int) -> list[ChunkResult]:
    """Submit and DONE times of chunks of random rows of one prepared table."""
    st = s.settings
    if not st.chunks:
        return []
    total, row = max(st.chunks), st.chunk_row
    local, remote, _ = _tables(s, total, row, seed)
    pair = s.backend.prepare(s.peer, local, remote)
    prepped = s.raw.prep(local, remote)
    out = []
    try:
        methods = _methods(s, pair, prepped, local, remote)
        for n in st.chunks:
            rng = np.random.default_rng(seed + n)
            li = rng.permutation(total)[:n].astype(np.int64)
            ri = rng.permutation(total)[:n].astype(np.int64)
            fns = {name: functools.partial(m, li, ri) for name, m in methods.items()}
            for fn in fns.values():  # warm-up
                fn()
            reps = chunk_reps(n, st.chunk_repeat)
            times = {name: MethodTimes() for name in fns}
            for r in range(reps):
                for name in rotated(list(fns), r):
                    times[name].add(*_timed(fns[name]))
            out.append(
                ChunkResult(
                    rows=n,
                    bytes=n * row,
                    reps=reps,
                    submit_us={k: statistics.median(t.submit_s) * 1e6 for k, t in times.items()},
                    e2e_us={k: statistics.median(t.total_s) * 1e6 for k, t in times.items()},
                )
            )
    finally:
        for h in prepped:
            h.release()
        s.backend.release_prepared(pair)
    return out


def measure(st: Settings) -> tuple[list[CaseResult], list[ChunkResult], dict[str, Any]]:
    """Start the target, run both parts, stop the target."""
    import torch

    from kvwire.config import KVWireConfig
    from kvwire.layout import MemoryRegion
    from kvwire.selection import create_backend
    from kvwire_nixl.agent import ENGINE

    if st.device == "cuda":
        need = max(st.gpu, st.target_gpu) + 1
        if not torch.cuda.is_available() or torch.cuda.device_count() < need:
            raise RuntimeError(f"--device cuda needs {need} visible GPUs")
    span = st.source_bytes
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(
        target=_target_main, args=(child, st.options, 2 * span, st.target_device), daemon=True
    )
    t_start = time.perf_counter()
    proc.start()
    dev = st.local_device
    if st.device == "cuda":
        torch.cuda.set_device(torch.device(dev))
    src = torch.empty(span // 8, dtype=torch.int64, device=dev)
    fill_pattern(src)
    largest = max(c.nbytes for c in st.cases)
    peer_dst = torch.zeros(largest, dtype=torch.uint8, device=st.target_device)
    _sync(dev)
    _sync(st.target_device)
    cfg = KVWireConfig(transfer_backend="nixl", transfer_backend_options=st.options)
    backend = create_backend(cfg, "gpu-bench-initiator", need=())
    raw: _Raw | None = None
    try:
        _, meta, rbase, target_name = _wait_ready(conn, proc)
        backend.register([MemoryRegion.from_tensor(src, item_len=8)])
        peer = backend.add_peer(meta)
        mem = "VRAM" if st.device == "cuda" else "DRAM"
        raw = _Raw(meta, src, mem, st.gpu if st.device == "cuda" else 0)
        s = _Session(st, conn, backend, raw, peer, src, peer_dst, rbase)
        results = [run_case(s, c, seed=1 + i) for i, c in enumerate(st.cases)]
        chunks = run_chunks(s, seed=100)
    finally:
        if raw is not None:
            raw.close()
        backend.close()
        with contextlib.suppress(OSError):
            conn.send(("stop",))
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    meta_out = {
        "memory": "VRAM->VRAM" if st.device == "cuda" else "DRAM->DRAM",
        "initiator": f"{dev} ({_device_name(dev)})",
        "target": f"{st.target_device} ({target_name})",
        "nixl": f"{ENGINE.distribution} {ENGINE.version}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "repeat": st.repeat,
        "remote_layout": st.remote_layout,
        "chunk_row": st.chunk_row,
        "chunk_repeat": st.chunk_repeat,
        "options": st.options,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_", "NCCL_"))},
        "argv": sys.argv[1:],
        "target_exit_code": proc.exitcode,
        "seconds": time.perf_counter() - t_start,
    }
    return results, chunks, meta_out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m kvwire_nixl.gpu_bench``; 1 if any check failed."""
    st = parse_args(argv)
    results, chunks, meta = measure(st)
    data = to_json(results, chunks, meta)
    if st.json_path:
        with open(st.json_path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
    print(render(results, chunks, meta), flush=True)
    ok = all(r.verified for r in results) and meta["target_exit_code"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
