"""``python -m kvwire_nixl.vram_check``: GPU memory through the ``nixl`` backend (needs CUDA).

Two processes on one host (a spawned target and this initiator), each with a CUDA buffer on
``--device`` (the target on ``--target-device``), registered as VRAM. Checks, every byte
compared on the GPU: WRITE and READ VRAM<->VRAM of one large descriptor and of many shuffled
descriptors, WRITE from pinned host memory into the target's VRAM, a notification after the
data, and that a table mixing DRAM and VRAM rows is refused. Prints GB/s (best of
``--repeat``) for each transfer; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvwire.backend import TransferBackend, XferOp, XferState
from kvwire.bench.backend import await_reply
from kvwire.config import KVWireConfig, parse_options
from kvwire.descriptors import make_table
from kvwire.errors import DescriptorError
from kvwire.layout import MemoryRegion
from kvwire.selection import create_backend

MiB = 1 << 20


def _target(conn: Connection, options: dict[str, Any], nbytes: int, device: int) -> None:
    import torch

    torch.cuda.set_device(device)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    cfg = KVWireConfig(transfer_backend="nixl", transfer_backend_options=options)
    backend = create_backend(cfg, "vram-target", need=())
    try:
        backend.register([MemoryRegion.from_tensor(buf, item_len=1)])
        conn.send((backend.local_metadata(), buf.data_ptr()))
        while True:
            backend.progress()
            for note in backend.get_notifications():
                conn.send(("notified", note.payload))
            if conn.poll(0.0005):
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                if msg[0] == "fetch":  # a span of the buffer, as bytes
                    off, n = msg[1], msg[2]
                    torch.cuda.synchronize()
                    conn.send(("data", buf[off : off + n].cpu().numpy().tobytes()))
                if msg[0] == "gather":  # rows of msg[2] bytes, in the order given
                    idx = torch.tensor(msg[1], dtype=torch.int64, device=buf.device)
                    torch.cuda.synchronize()
                    rows = buf.view(-1, msg[2])[idx]
                    conn.send(("data", rows.cpu().numpy().tobytes()))
                if msg[0] == "fill":
                    g = torch.Generator(device=f"cuda:{device}").manual_seed(msg[1])
                    buf.random_(0, 256, generator=g)
                    torch.cuda.synchronize()
                    conn.send(("filled",))
    finally:
        backend.close()


def _run(backend: TransferBackend, op: XferOp, pair: Any, li: Any, ri: Any, note: Any) -> float:
    t0 = time.perf_counter()
    h = backend.submit(op, pair, li, ri, note)
    while (st := backend.poll(h)) is XferState.PENDING:
        pass
    elapsed = time.perf_counter() - t0
    backend.release(h)
    if st is not XferState.DONE:
        raise RuntimeError(f"{op.name} ended {st.name}: {h.error}")
    return elapsed


def _raw_read_gbps(
    meta: bytes, src: Any, rbase: int, n: int, dev: int, tdev: int, repeat: int
) -> str:
    """Raw NIXL READ of the same bytes by a second agent, for comparison."""
    import msgpack

    from kvwire_nixl.agent import ENGINE

    api = ENGINE.api
    agent = api.nixl_agent("vram-raw", api.nixl_agent_config(enable_prog_thread=False))
    reg = agent.register_memory(np.array([[src.data_ptr(), n, dev]], dtype=np.uint64), "VRAM")
    peer = agent.add_remote_agent(msgpack.unpackb(meta, raw=False)["md"])
    peer = peer.decode() if isinstance(peer, bytes) else peer
    lh = agent.prep_xfer_dlist("", np.array([[src.data_ptr(), n, dev]], np.uint64), "VRAM")
    rh = agent.prep_xfer_dlist(peer, np.array([[rbase, n, tdev]], np.uint64), "VRAM")
    times = []
    try:
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            h = agent.make_prepped_xfer("READ", lh, [0], rh, [0])
            agent.transfer(h)
            while (s := agent.check_xfer_state(h)) == "PROC":
                pass
            times.append(time.perf_counter() - t0)
            h.release()
            if s != "DONE":
                return f"raw READ ended {s}"
    finally:
        lh.release()
        rh.release()
        agent.remove_remote_agent(peer)
        agent.deregister_memory(reg)
    return f"{n / min(times[1:]) / 1e9:.1f} GB/s"


def _vram_chunks(
    backend: TransferBackend, peer: str, meta: bytes, src: Any, rbase: int, dev: int, tdev: int
) -> list[str]:
    """Create/submit cost of VRAM chunks: prepared vs one-shot (raw), and kvwire end to end."""
    import msgpack

    from kvwire_nixl.agent import ENGINE

    row, total = 16 << 10, min(65536, src.numel() // (16 << 10))
    local = make_table(
        src.data_ptr() + np.arange(total, dtype=np.uint64) * np.uint64(row), row, dev
    )
    perm = np.random.default_rng(5).permutation(2 * total)[:total].astype(np.uint64)
    remote = make_table(rbase + perm * np.uint64(row), row, tdev)
    api = ENGINE.api
    agent = api.nixl_agent("vram-chunks", api.nixl_agent_config(enable_prog_thread=False))
    reg = agent.register_memory(np.array([[src.data_ptr(), src.numel(), dev]], np.uint64), "VRAM")
    rpeer = agent.add_remote_agent(msgpack.unpackb(meta, raw=False)["md"])
    rpeer = rpeer.decode() if isinstance(rpeer, bytes) else rpeer
    lh = agent.prep_xfer_dlist("", local, "VRAM")
    rh = agent.prep_xfer_dlist(rpeer, remote, "VRAM")
    pair = backend.prepare(peer, local, remote)
    lines = []
    try:
        for n, order in [(k, o) for k in (1024, 8192, total) for o in ("shuffled", "sorted")]:
            rng = np.random.default_rng(n)
            li = rng.permutation(total)[:n].astype(np.int64)
            ri = rng.permutation(total)[:n].astype(np.int64)
            if order == "sorted":
                li, ri = np.sort(li), np.sort(ri)

            def timed(fn: Any, reps: int = 5) -> float:
                fn()
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                return float(np.median(ts)) * 1e3

            def prepped(li: Any = li, ri: Any = ri) -> Any:
                return agent.make_prepped_xfer("WRITE", lh, li, rh, ri)

            def oneshot(li: Any = li, ri: Any = ri) -> Any:
                return agent.initialize_xfer(
                    "WRITE",
                    agent.get_xfer_descs(local[li], "VRAM"),
                    agent.get_xfer_descs(remote[ri], "VRAM"),
                    rpeer,
                )

            def e2e(make: Any) -> None:
                h = make()
                agent.transfer(h)
                while agent.check_xfer_state(h) == "PROC":
                    pass
                h.release()

            c_p = timed(lambda: prepped().release())
            c_o = timed(lambda: oneshot().release())
            e_p = timed(lambda: e2e(prepped))
            e_o = timed(lambda: e2e(oneshot))
            e_k = timed(lambda li=li, ri=ri: _run(backend, XferOp.WRITE, pair, li, ri, None))
            lines.append(
                f"{n} x 16 KiB VRAM rows, {order} indices: create prepped {c_p:.2f} ms, "
                f"one-shot {c_o:.2f} ms "
                f"({c_o / c_p:.1f}x); create+post+done raw prepped {e_p:.2f} ms, raw one-shot "
                f"{e_o:.2f} ms, kvwire {e_k:.2f} ms ({n * row / e_k / 1e6:.1f} GB/s)"
            )
    finally:
        backend.release_prepared(pair)
        lh.release()
        rh.release()
        agent.remove_remote_agent(rpeer)
        agent.deregister_memory(reg)
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    import torch

    p = argparse.ArgumentParser(prog="python -m kvwire_nixl.vram_check", description=__doc__)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--target-device", type=int, default=None)
    p.add_argument("--mib", type=int, default=1024, help="size of the large transfer")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--option", action="append", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    options = parse_options(args.option, "--option")
    tdev = args.device if args.target_device is None else args.target_device
    n = args.mib * MiB
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, options, 2 * n, tdev))
    proc.start()
    torch.cuda.set_device(args.device)
    dev = f"cuda:{args.device}"
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    host = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8).pin_memory()
    cfg = KVWireConfig(transfer_backend="nixl", transfer_backend_options=options)
    backend = create_backend(cfg, "vram-initiator", need=())
    results: list[tuple[str, bool, str]] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        results.append((name, ok, detail))
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)

    def remote_bytes(off: int, length: int) -> torch.Tensor:
        conn.send(("fetch", off, length))
        data = await_reply(conn, "data")[1]
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    try:
        if not conn.poll(180):
            raise TimeoutError("target did not start")
        meta, rbase = conn.recv()
        backend.register(
            [MemoryRegion.from_tensor(src, item_len=1), MemoryRegion.from_tensor(host, item_len=1)]
        )
        peer = backend.add_peer(meta)
        # 1. one large descriptor, VRAM -> VRAM, WRITE then READ
        pair = backend.prepare(
            peer, make_table([src.data_ptr()], n, args.device), make_table([rbase], n, tdev)
        )
        _run(backend, XferOp.WRITE, pair, [0], [0], None)
        best = min(_run(backend, XferOp.WRITE, pair, [0], [0], None) for _ in range(args.repeat))
        same = torch.equal(remote_bytes(0, n), src.cpu())
        check(f"WRITE VRAM->VRAM 1 x {args.mib} MiB", same, f"{n / best / 1e9:.1f} GB/s")
        conn.send(("fill", 7))
        await_reply(conn, "filled")
        best = min(_run(backend, XferOp.READ, pair, [0], [0], None) for _ in range(args.repeat))
        same = torch.equal(remote_bytes(0, n), src.cpu())
        check(f"READ VRAM<-VRAM 1 x {args.mib} MiB", same, f"{n / best / 1e9:.1f} GB/s")
        backend.release_prepared(pair)
        raw_gbps = _raw_read_gbps(meta, src, rbase, n, args.device, tdev, args.repeat)
        check(f"raw NIXL READ VRAM<-VRAM 1 x {args.mib} MiB (same agent config)", True, raw_gbps)
        # 2. many shuffled descriptors
        rows, row = 4096, n // 4096
        loff = np.arange(rows, dtype=np.uint64) * np.uint64(row)
        roff = np.random.default_rng(1).permutation(2 * rows)[:rows].astype(np.uint64)
        roff *= np.uint64(row)
        pair = backend.prepare(
            peer,
            make_table(src.data_ptr() + loff, row, args.device),
            make_table(rbase + roff, row, tdev),
        )
        idx = np.arange(rows)
        best = min(_run(backend, XferOp.WRITE, pair, idx, idx, None) for _ in range(args.repeat))
        conn.send(("gather", (roff // np.uint64(row)).astype(np.int64).tolist(), row))
        got = torch.frombuffer(bytearray(await_reply(conn, "data")[1]), dtype=torch.uint8)
        same = torch.equal(got, src.cpu())
        check(f"WRITE VRAM->VRAM {rows} x {row // 1024} KiB", same, f"{n / best / 1e9:.1f} GB/s")
        backend.release_prepared(pair)
        for line in _vram_chunks(backend, peer, meta, src, rbase, args.device, tdev):
            check("chunks", True, line)
        # 3. pinned host -> remote VRAM, with a notification after the data
        m = host.numel()
        pair = backend.prepare(
            peer, make_table([host.data_ptr()], m), make_table([rbase + n], m, tdev)
        )
        secs = _run(backend, XferOp.WRITE, pair, [0], [0], b"host-done")
        note = await_reply(conn, "notified")[1]
        same = torch.equal(remote_bytes(n, m), host)
        check(
            "WRITE pinned DRAM->VRAM 64 MiB + notification",
            same and note == b"host-done",
            f"{m / secs / 1e9:.1f} GB/s (one run)",
        )
        backend.release_prepared(pair)
        # 4. a table mixing DRAM and VRAM rows is refused
        mixed = np.concatenate(
            [make_table([src.data_ptr()], 64, args.device), make_table([host.data_ptr()], 64)]
        )
        try:
            backend.prepare(peer, mixed, make_table([rbase, rbase + 64], 64, tdev))
            check("mixed DRAM/VRAM table refused", False, "prepare accepted it")
        except DescriptorError as exc:
            check("mixed DRAM/VRAM table refused", True, str(exc)[:80])
    finally:
        backend.close()
        conn.send(("stop",))
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
    print(f"proc exit code {proc.exitcode}")
    return 0 if results and all(ok for _, ok, _ in results) and proc.exitcode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
