"""The floor of a one-thread request loop in Python (issue 27): how fast can a request go when
each side is one thread that does everything, with kvwire's own mover and no engine?

Sessions 28-33 traced a ``cudaipc`` request through kvwire (decode's engine thread, the
control channel, prefill's liveness thread and engine, the transfer worker, the kernel
watcher, the note, decode's progress thread, decode's engine): eight thread hand-offs, each
35-45 us on the GPU hosts, plus ~0.2 ms of Python a side, and concluded that the open targets
(2 MiB p50 <= 0.3 ms at C=1, 16 MiB >= 0.3x the link) need a request path that crosses fewer
threads. This probe measures what such a path could reach before anyone builds it.

Two processes (forked before CUDA starts), prefill on GPU 0 and decode on GPU 1, joined by
one ``SOCK_SEQPACKET`` socket pair (kvwire's local control way is the same kind of socket).
Decode's pool (``--buffers`` buffers, 32 layers x K/V, of ``--pages`` pages of 32 KiB each: a
page of the issue-27 model is 2 MiB in 64 runs) is exported over CUDA IPC and opened by
prefill with peer access, as the ``cudaipc`` backend does. Then, per cell (MiB per request,
requests in flight), decode's one thread keeps C requests in flight: it sends each request
(an id and its destination pages), and takes the notes back; prefill's one thread takes every
request waiting, plans each (the run addresses of its pages: NumPy), launches kvwire's
``RunCopier`` once per request on one stream, records an event (``kvwire.cuda_events``), and
sends each request's note as soon as its event has completed (spinning on the event and on
the socket, nothing else). Every request's first and last page is checked on decode
(a sum of its bytes against the sum prefill computed of the source page).

Variants add one of kvwire's mechanisms at a time, to price each (``--variants``, a
comma-separated list of ``+``-joined switches, ``base`` for none):

  codec    requests and notes as kvwire frames (``TransferRequest``, ``ChunkNote`` through
           ``kvwire.control.wire.Codec``, with a shared secret: MAC and freshness stamps)
  threads  kvwire's hand-offs: prefill's receiving thread queues each request to a worker
           thread (plan and launch), which queues the event to a watcher thread (it waits for
           the event, then sends the note); decode's receiving thread queues each note to
           decode's engine thread (the one that sends requests)
  step     decode's engine sees notes only at its steps (``--step-us``, 200: the GPU benches'
           engine loop, which polls each request once a step); prefill is not stepped

Prints, per cell, p50/p90 latency (decode's send to decode's receipt of the note) and GB/s,
beside ``kvwire bench --device cuda``'s figures for the same cells when given
(``--kvwire-json``: that command's JSON).

    python3 scripts/gpu_request_floor_probe.py --json $OUT/floor.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
RUN = 32 << 10  # bytes of one (layer, K/V) run of a page
BUFFERS = 64  # 32 layers x K/V
PAGE = RUN * BUFFERS  # 2 MiB
_HDR = struct.Struct("<qq")  # request id, pages


def _cells(a: argparse.Namespace) -> list[tuple[int, int]]:
    return [(m, c) for m in a.mib for c in a.concurrency]


class _Wire:
    """A request or a note on the socket: packed bytes, or kvwire frames (``codec``)."""

    def __init__(self, codec: bool) -> None:
        self.codec = None
        if codec:
            from kvwire.control.wire import Codec

            self.codec = Codec(b"floor-probe-secret")

    def request(self, rid: int, pages: np.ndarray) -> bytes:
        if self.codec is None:
            return _HDR.pack(rid, pages.size) + pages.tobytes()
        from kvwire.control.wire import TransferRequest

        msg = TransferRequest(room=rid, session="decode", dst_pages=pages.tobytes())
        return self.codec.encode(msg, "prefill")

    def read_request(self, raw: bytes) -> tuple[int, np.ndarray]:
        if self.codec is None:
            rid, n = _HDR.unpack_from(raw)
            return rid, np.frombuffer(raw, dtype=np.int64, count=max(n, 0), offset=_HDR.size)
        from kvwire.control.wire_base import pages_from_bytes

        m: Any = self.codec.decode(raw, "prefill")
        return int(m.room), pages_from_bytes(m.dst_pages)

    def note(self, rid: int, n: int) -> bytes:
        if self.codec is None:
            return _HDR.pack(rid, 0)
        from kvwire.control.wire import ChunkNote

        msg = ChunkNote(room=rid, sender_id=0, session="prefill", last=True, span=(0, n),
                        num_pages=n, page_size=16)  # fmt: skip
        return self.codec.encode(msg)

    def read_note(self, raw: bytes) -> int:
        if self.codec is None:
            return int(_HDR.unpack_from(raw)[0])
        m: Any = self.codec.decode(raw)
        return int(m.room)


#: The request id that stops prefill (a valid room: kvwire frames refuse negative ones).
_STOP = 1 << 62


def _prefill(sock: socket.socket, conn: Any, a: argparse.Namespace, variant: set[str]) -> None:
    import queue
    import threading

    import torch

    from kvwire import cuda_events
    from kvwire.movers.triton_copy import RunCopier
    from kvwire_cudaipc import _cuda

    torch.cuda.set_device(0)
    src = torch.randint(-(1 << 62), 1 << 62, (BUFFERS, a.pages, RUN // 8), device="cuda:0")
    page_sums = [int(src[:, p].sum()) for p in range(a.pages)]  # wraps like decode's sum
    raw, offset = conn.recv()
    _cuda.enable_peer_access(0, 1)
    dst_base = _cuda.OPENED.open(raw, 0) + offset
    conn.send(page_sums)
    src_buf = np.arange(BUFFERS, dtype=np.int64) * (a.pages * RUN) + int(src.data_ptr())
    dst_buf = np.arange(BUFFERS, dtype=np.int64) * (a.pages * RUN) + dst_base
    copier = RunCopier("cuda:0")
    stream = torch.cuda.Stream(device="cuda:0")
    events = [torch.cuda.Event() for _ in range(256)]
    lens_cache: dict[int, np.ndarray] = {}
    wire = _Wire("codec" in variant)
    count = [0]

    def launch(rid: int, pages: np.ndarray) -> Any:
        srcp = (pages + rid) % a.pages  # the request's source pages
        s = (src_buf[:, None] + srcp[None, :] * RUN).ravel()
        d = (dst_buf[:, None] + pages[None, :] * RUN).ravel()
        lens = lens_cache.get(s.size)
        if lens is None:
            lens = lens_cache[s.size] = np.full(s.size, RUN, dtype=np.int64)
        copier.copy(s, d, lens, stream)
        ev = events[count[0] % len(events)]
        count[0] += 1
        cuda_events.record(ev, stream)
        return ev

    if "threads" in variant:  # receiver -> worker -> watcher, as kvwire's prefill
        work: queue.SimpleQueue[tuple[int, np.ndarray]] = queue.SimpleQueue()
        watch: queue.SimpleQueue[tuple[int, int, Any]] = queue.SimpleQueue()

        def worker() -> None:
            torch.cuda.set_device(0)
            while True:
                rid, pages = work.get()
                if rid == _STOP:
                    watch.put((_STOP, 0, None))
                    return
                watch.put((rid, pages.size, launch(rid, pages)))

        def watcher() -> None:
            torch.cuda.set_device(0)
            while True:
                rid, n, ev = watch.get()
                if rid == _STOP:
                    return
                ev.synchronize()
                sock.send(wire.note(rid, n))

        threads = [threading.Thread(target=f, daemon=True) for f in (worker, watcher)]
        for t in threads:
            t.start()
        while True:
            rid, pages = wire.read_request(sock.recv(1 << 20))
            work.put((rid, pages))
            if rid == _STOP:
                for t in threads:
                    t.join()
                return

    sock.setblocking(False)
    inflight: list[tuple[int, int, Any]] = []  # (request id, pages, event), launch order
    while True:
        # take every request waiting (block only when nothing is in flight)
        while True:
            try:
                msg = sock.recv(1 << 20) if inflight else _blocking_recv(sock)
            except BlockingIOError:
                break
            rid, pages = wire.read_request(msg)
            if rid == _STOP:
                return
            inflight.append((rid, pages.size, launch(rid, pages)))
        # notes for every launch done, in order
        while inflight and inflight[0][2].query():
            rid, n, _ = inflight.pop(0)
            sock.send(wire.note(rid, n))


def _blocking_recv(sock: socket.socket) -> bytes:
    sock.setblocking(True)
    try:
        return sock.recv(1 << 20)
    finally:
        sock.setblocking(False)


def _decode(sock: socket.socket, conn: Any, a: argparse.Namespace, variant: set[str]) -> None:
    import queue
    import threading

    import torch

    from kvwire_cudaipc import _cuda

    torch.cuda.set_device(1)
    dst = torch.zeros((BUFFERS, a.pages, RUN // 8), dtype=torch.int64, device="cuda:1")
    raw, offset, _ = _cuda.export(1, int(dst.data_ptr()))
    conn.send((raw, offset))
    page_sums = conn.recv()
    wire = _Wire("codec" in variant)
    step_s = a.step_us * 1e-6 if "step" in variant else 0.0
    notes: queue.SimpleQueue[int] = queue.SimpleQueue()
    threaded = "threads" in variant
    if threaded:  # decode's receiving thread hands each note to the engine thread

        def receiver() -> None:
            while True:
                rid = wire.read_note(sock.recv(1 << 16))
                notes.put(rid)
                if rid == _STOP:
                    return

        threading.Thread(target=receiver, daemon=True).start()

    def next_note() -> int:
        if threaded and not step_s:
            return notes.get()
        if threaded:
            while True:
                try:
                    return notes.get_nowait()
                except queue.Empty:
                    time.sleep(step_s)
        if not step_s:
            return wire.read_note(sock.recv(1 << 16))
        while True:
            try:
                return wire.read_note(sock.recv(1 << 16, socket.MSG_DONTWAIT))
            except BlockingIOError:
                time.sleep(step_s)

    rng = np.random.default_rng(5)
    report: dict[str, Any] = {"cells": []}
    rid = 0
    for mib, conc in _cells(a):
        n = mib * MiB // PAGE
        # C requests' pages never overlap while in flight: C disjoint slices of a permutation
        perm = rng.permutation(a.pages)[: n * conc].reshape(conc, n).astype(np.int64)
        lat: list[float] = []
        checked = bad = 0
        wall = 0.0
        for phase in ("warm", "timed"):
            count = a.warmup if phase == "warm" else a.requests
            sent: dict[int, tuple[float, int]] = {}  # id -> (t0, slot)
            free = list(range(conc))
            done = nxt = 0
            t_start = time.perf_counter()
            while done < count:
                while free and nxt < count:
                    slot = free.pop()
                    rid += 1
                    sent[rid] = (time.perf_counter(), slot)
                    sock.send(wire.request(rid, perm[slot]))
                    nxt += 1
                got = next_note()
                t1 = time.perf_counter()
                t0, slot = sent.pop(got)
                if phase == "timed":
                    lat.append(t1 - t0)
                    if done < a.check:  # first and last page against prefill's source sums
                        for i in (0, n - 1):
                            want = page_sums[(int(perm[slot][i]) + got) % a.pages]
                            checked += 1
                            bad += int(dst[:, int(perm[slot][i])].sum()) != want
                free.append(slot)
                done += 1
            wall = time.perf_counter() - t_start
        lat.sort()
        cell = {
            "mib": mib,
            "concurrency": conc,
            "requests": a.requests,
            "gbps": round(a.requests * mib * MiB / wall / 1e9, 2),
            "p50_ms": round(1e3 * lat[len(lat) // 2], 3),
            "p90_ms": round(1e3 * lat[int(len(lat) * 0.9)], 3),
            "pages_checked": checked,
            "pages_wrong": bad,
        }
        report["cells"].append(cell)
        print(f"floor {'+'.join(sorted(variant)) or 'base'} {cell}", flush=True)
    sock.send(wire.request(_STOP, np.zeros(0, dtype=np.int64)))
    conn.send(report)


def _run(a: argparse.Namespace, variant: set[str]) -> dict[str, Any]:
    """One variant: both processes forked (CUDA is not started in this process)."""
    ctx = mp.get_context("fork")
    ps, ds = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (ps, ds):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    to_prefill, prefill_end = ctx.Pipe()
    to_decode, decode_end = ctx.Pipe()
    p = ctx.Process(target=_prefill, args=(ps, prefill_end, a, variant), daemon=True)
    d = ctx.Process(target=_decode, args=(ds, decode_end, a, variant), daemon=True)
    p.start()
    d.start()
    to_prefill.send(to_decode.recv())  # decode's pool handle
    to_decode.send(to_prefill.recv())  # prefill's source page sums
    report: dict[str, Any] = to_decode.recv()
    p.join(30)
    d.join(30)
    for proc in (p, d):
        if proc.is_alive():
            proc.kill()
    ps.close()
    ds.close()
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=lambda v: [int(x) for x in v.split(",")], default=[2, 16, 128])
    ap.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8])
    ap.add_argument("--pages", type=int, default=1024, help="pages of each pool (2 MiB each)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--check", type=int, default=20, help="timed requests checked per cell")
    ap.add_argument("--variants", default="base", help="comma-separated (module doc)")
    ap.add_argument("--step-us", type=float, default=200.0, help="the engines' step (step)")
    ap.add_argument("--kvwire-json", default="", help="kvwire bench --device cuda's JSON")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if max(a.mib) * MiB // PAGE * max(a.concurrency) > a.pages:
        ap.error("--pages must hold every request in flight")
    out: dict[str, Any] = {"machine": os.uname().nodename, "variants": {}}
    for v in a.variants.split(","):
        variant = set() if v == "base" else set(v.split("+"))
        if variant - {"codec", "threads", "step"}:
            ap.error(f"unknown variant {v!r}")
        out["variants"][v] = _run(a, variant)
    if a.kvwire_json:
        kv = json.loads(Path(a.kvwire_json).read_text())
        out["kvwire_cudaipc"] = kv.get("paths", {}).get("cudaipc")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    names = list(out["variants"])
    print("\n| MiB | C | " + " | ".join(f"{v} GB/s (p50 ms)" for v in names) + " |")
    print("|---:|---:|" + "---:|" * len(names))
    wrong = 0
    for i, (mib, conc) in enumerate(_cells(a)):
        row = []
        for v in names:
            c = out["variants"][v]["cells"][i]
            wrong += c["pages_wrong"]
            row.append(f"{c['gbps']} ({c['p50_ms']})")
        print(f"| {mib} | {conc} | " + " | ".join(row) + " |")
    print(f"pages wrong: {wrong}")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
