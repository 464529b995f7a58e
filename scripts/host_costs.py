"""What the host's primitives cost: the operations a kvwire request is made of, timed alone on
whatever machine runs this (issue 27, prefill's per-request Python).

A C=1 request on the GPU machines spends 5-7x longer in each step inside a rank process than
the same step in a loop (docs/benchmarks.md, "What a page write costs on prefill"). A rank's
request is a chain of thread hand-offs (liveness -> engine -> worker -> note), each a futex
wake and a GIL hand-over, so this times those primitives on both machines side by side:

- ``syscall``: ``os.getppid()`` (one system call); ``clock``: ``time.perf_counter()``;
- ``sleep_100us``: what ``time.sleep(100e-6)`` really sleeps;
- ``event_oneway``: a ``threading.Event`` set on one thread until the waiting thread runs
  (half of a ping-pong round trip), alone and with a third thread running Python (the GIL
  then changes hands at the switch interval: 5 ms and 100 us);
- ``dgram_oneway``: one UNIX datagram between two threads (kvwire's local notes);
- ``zmq_rtt``: a ZeroMQ PAIR round trip over ``ipc://`` between two threads;
- ``encode_cold`` / ``encode_warm``: ``Codec.encode`` of a chunk note right after a 1.5 ms
  sleep, and in a loop;
- on a CUDA machine, ``copy_pages``: the page mover's call in a loop, after a 1.5 ms sleep,
  and on a worker thread woken by an Event (the rank's worker), GPU 0 -> GPU 0.

Medians in microseconds, printed and written to ``--json``. The kernel, the platform and the
idle driver are printed first (a GPU machine here runs under gVisor; the development VM under
KVM with ``haltpoll``).

    python3 scripts/host_costs.py --json $OUT/host_costs.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROUNDS = 400


def med(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 2)


def per_call(fn: Callable[[], Any], n: int = 20000) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return round((time.perf_counter() - t) / n * 1e6, 3)


def sleep_actual() -> float:
    xs = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        time.sleep(100e-6)
        xs.append(time.perf_counter() - t)
    return med(xs)


class Hog:
    """A thread that runs Python without pause (an engine loop that never sleeps)."""

    def __init__(self) -> None:
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        x = 0
        while not self.stop:
            x += 1

    def __enter__(self) -> Hog:
        self.t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self.t.join()


def pin(cpu: int | None) -> None:
    """Pin the calling thread to ``cpu`` (None: leave it)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def unpin() -> None:
    os.sched_setaffinity(0, range(os.cpu_count() or 1))


def event_oneway(cpus: tuple[int | None, int | None] = (None, None)) -> float:
    """Half the median round trip of two threads passing an Event back and forth (each
    pinned to ``cpus[i]`` when given)."""
    a, b = threading.Event(), threading.Event()
    done = False

    def peer() -> None:
        pin(cpus[1])
        while True:
            a.wait()
            a.clear()
            if done:
                return
            b.set()

    t = threading.Thread(target=peer, daemon=True)
    t.start()
    pin(cpus[0])
    xs = []
    for _ in range(ROUNDS):
        time.sleep(200e-6)  # a gap, as between requests
        t0 = time.perf_counter()
        a.set()
        b.wait()
        b.clear()
        xs.append((time.perf_counter() - t0) / 2)
    done = True
    a.set()
    t.join()
    unpin()
    return med(xs)


def dgram_oneway() -> float:
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "s")
        rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        rx.bind(path)
        tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        got: list[float] = []

        def recv() -> None:
            for _ in range(ROUNDS):
                rx.recv(64)
                got.append(time.perf_counter())

        t = threading.Thread(target=recv, daemon=True)
        t.start()
        sent = []
        for _ in range(ROUNDS):
            time.sleep(200e-6)
            sent.append(time.perf_counter())
            tx.sendto(b"x" * 40, path)
        t.join()
        rx.close()
        tx.close()
        return med([g - s for g, s in zip(got, sent, strict=True)])


def zmq_rtt() -> float | None:
    try:
        import zmq
    except ImportError:
        return None
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as d:
        ep = f"ipc://{d}/z"
        srv, cli = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        srv.bind(ep)
        cli.connect(ep)

        def echo() -> None:
            for _ in range(ROUNDS + 1):
                srv.send(srv.recv())

        t = threading.Thread(target=echo, daemon=True)
        t.start()
        cli.send(b"w")
        cli.recv()
        xs = []
        for _ in range(ROUNDS):
            time.sleep(200e-6)
            t0 = time.perf_counter()
            cli.send(b"x" * 40)
            cli.recv()
            xs.append(time.perf_counter() - t0)
        t.join()
        srv.close(0)
        cli.close(0)
    ctx.term()
    return med(xs)


def encode_costs() -> dict[str, float]:
    from kvwire.control.wire import ChunkNote, Codec

    c = Codec(None)
    msg = ChunkNote(room=1, sender_id=2, session="s" * 16, span=(0, 1), num_pages=1, page_size=16)
    cold = []
    for _ in range(ROUNDS):
        time.sleep(1.5e-3)
        t0 = time.perf_counter()
        c.encode(msg)
        cold.append(time.perf_counter() - t0)
    return {"encode_cold": med(cold), "encode_warm": per_call(lambda: c.encode(msg), 5000)}


WORKER_MODES = ("event", "event_same_cpu", "event_other_cpu", "spin", "event_beside_hog")


def woken(call: Callable[[], Any], mode: str) -> dict[str, float]:
    """``call`` on a worker thread 1.5 ms after its last one, as a rank's worker is woken by
    ``send()``: from the wake-up signal to the worker running, and ``call``'s own time.
    ``mode``: woken by an Event (both threads unpinned, pinned to one CPU, or to two), a
    worker that spins on a flag instead of sleeping, or woken by an Event beside a thread
    that runs Python without pause (switch interval 100 us)."""
    go, stop = threading.Event(), [False]
    woke: list[tuple[float, float]] = []
    flag = [0]
    cpu = {"event_same_cpu": (2, 2), "event_other_cpu": (2, 3)}.get(mode, (None, None))

    def worker() -> None:
        pin(cpu[1])
        seen = 0
        while True:
            if mode == "spin":
                while flag[0] == seen and not stop[0]:
                    pass
                seen = flag[0]
            else:
                go.wait()
                go.clear()
            if stop[0]:
                return
            t1 = time.perf_counter()
            call()
            woke.append((t1, time.perf_counter()))

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    pin(cpu[0])
    sets = []
    hog = Hog() if mode == "event_beside_hog" else None
    if hog:
        sys.setswitchinterval(1e-4)
        hog.__enter__()
    for _ in range(ROUNDS):
        time.sleep(1.5e-3)
        sets.append(time.perf_counter())
        if mode == "spin":
            flag[0] += 1
        else:
            go.set()
        while len(woke) < len(sets):
            time.sleep(50e-6)
    if hog:
        hog.__exit__()
        sys.setswitchinterval(5e-3)
    stop[0] = True
    go.set()
    t.join()
    unpin()
    return {
        f"worker_{mode}_wake": med([w[0] - s for w, s in zip(woke, sets, strict=True)]),
        f"worker_{mode}_call": med([w[1] - w[0] for w in woke]),
    }


def gpu_costs() -> dict[str, float]:
    import numpy as np
    import torch

    from kvwire.descriptors import ADDR
    from kvwire.index import EqualTPMapper
    from kvwire.layout import KVLayout, ModelSpec, RankPosition
    from kvwire.movers.triton_pool_pages import PoolPageCopier

    model = ModelSpec(
        num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16,
        is_mla=False,
    )  # fmt: skip

    def pool(slots: int) -> KVLayout:
        shape = (slots, model.page_size, model.total_kv_heads, model.head_dim)
        bufs = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda:0") for _ in range(64)]
        return KVLayout.from_tensors(model, bufs, RankPosition(tp_size=1, tp_rank=0))

    torch.cuda.set_device(0)
    src, dst = pool(4), pool(4)
    mapper = EqualTPMapper(src, dst)
    tables = mapper.build_tables()
    s_all, d_all = tables.src[:, ADDR].astype(np.int64), tables.dst[:, ADDR].astype(np.int64)
    chunk = mapper.page_chunk(np.array([0]), np.array([1]))
    assert chunk is not None
    g = chunk.geometry
    sa, da = s_all[g.src_rows], d_all[g.dst_rows]
    mover = PoolPageCopier(0)
    stream = torch.cuda.Stream(0)  # type: ignore[no-untyped-call]

    def call() -> None:
        mover.copy_pages(chunk, sa, da, stream=stream)

    call()
    torch.cuda.synchronize(0)
    warm = []
    for i in range(ROUNDS):
        t0 = time.perf_counter()
        call()
        warm.append(time.perf_counter() - t0)
        if i % 32 == 31:
            torch.cuda.synchronize(0)
    after_sleep = []
    for _ in range(ROUNDS):
        time.sleep(1.5e-3)
        t0 = time.perf_counter()
        call()
        after_sleep.append(time.perf_counter() - t0)
    out: dict[str, float] = {
        "copy_pages_warm": med(warm),
        "copy_pages_after_sleep": med(after_sleep),
    }
    out.update(event_costs(torch, call, stream))
    for mode in WORKER_MODES:
        out.update(woken(call, mode))
    torch.cuda.synchronize(0)
    return out


def event_costs(torch: Any, launch: Callable[[], None], stream: Any) -> dict[str, float]:
    """A launch's completion event, after a launch (µs): a fresh blocking-sync event
    created, recorded and dropped (its CUDA event made at the record, destroyed at the
    drop: cudaipc before session 22), against one of a few reused events recorded."""
    pool = [torch.cuda.Event(blocking=True) for _ in range(64)]
    for ev in pool:
        ev.record(stream)
    torch.cuda.synchronize(0)
    fresh, reused = [], []
    for i in range(ROUNDS):
        launch()
        t0 = time.perf_counter()
        ev = torch.cuda.Event(blocking=True)
        ev.record(stream)
        del ev
        t1 = time.perf_counter()
        launch()
        t2 = time.perf_counter()
        pool[i % 64].record(stream)
        t3 = time.perf_counter()
        fresh.append(t1 - t0)
        reused.append(t3 - t2)
        if i % 32 == 31:
            torch.cuda.synchronize(0)
    torch.cuda.synchronize(0)
    return {"event_fresh_record_drop": med(fresh), "event_reused_record": med(reused)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--no-gpu", action="store_true")
    a = ap.parse_args()
    idle = Path("/sys/devices/system/cpu/cpuidle/current_driver")
    facts = {
        "uname": " ".join(platform.uname()),
        "cpus": os.cpu_count(),
        "idle_driver": idle.read_text().strip() if idle.exists() else "none",
        "python": platform.python_version(),
    }
    print(facts, flush=True)
    res: dict[str, Any] = {
        "syscall": per_call(os.getppid),
        "clock": per_call(time.perf_counter),
        "sleep_100us": sleep_actual(),
        "event_oneway": event_oneway(),
        "event_oneway_same_cpu": event_oneway((0, 0)),
        "event_oneway_other_cpu": event_oneway((0, 1)),
    }
    for interval in (5e-3, 1e-4):
        sys.setswitchinterval(interval)
        with Hog():
            res[f"event_oneway_beside_hog_{int(interval * 1e6)}us"] = event_oneway()
    sys.setswitchinterval(5e-3)
    res["dgram_oneway"] = dgram_oneway()
    res["zmq_rtt"] = zmq_rtt()
    res.update(encode_costs())
    from kvwire.control.wire import ChunkNote, Codec

    codec = Codec(None)
    note = ChunkNote(room=1, sender_id=2, session="s" * 16, span=(0, 1), num_pages=1, page_size=16)
    for mode in ("event", "spin"):  # the CPU stand-in of the GPU rows below
        got = woken(lambda: codec.encode(note), mode)
        res.update({k.replace("_call", "_encode"): v for k, v in got.items()})
    if not a.no_gpu:
        try:
            import torch

            if torch.cuda.is_available():
                res.update(gpu_costs())
        except ImportError:
            pass
    for k, v in res.items():
        print(f"{k:32s} {v}")
    if a.json:
        Path(a.json).write_text(json.dumps({"facts": facts, "us": res}, indent=1))


if __name__ == "__main__":
    main()
