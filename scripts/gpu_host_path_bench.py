"""GPU memory of one process -> pinned host memory of another process, on one host.

The prefill process owns a CUDA buffer (and a pinned staging buffer of its own); a spawned
decode process owns a pinned host buffer registered with NIXL as DRAM. For each UCX setting
(each in a fresh pair of processes, killed after ``--timeout`` seconds) it times, on the same
bytes laid out as one descriptor and as many rows (shuffled on the decode side):

  a  WRITE prefill VRAM -> decode DRAM (raw NIXL, initiated by prefill)
  b  READ  prefill VRAM -> decode DRAM (raw NIXL, initiated by decode)
  c  hop: torch copy VRAM -> prefill pinned DRAM, then WRITE DRAM -> decode DRAM; hop, write and
     end to end, plus a chunked variant that overlaps the hop with the writes (rows only)
  d  local pinned D2H copy with torch (the reference)

Every transfer's destination is zeroed first and checked (CRC32) against the source afterwards.
``--device cpu`` uses host memory for the "VRAM" buffer to test the code without a GPU.
Full results go to ``--out`` (JSON); a table of GB/s and the ratio to (d) is printed last.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import zlib
from typing import Any

import numpy as np

MiB = 1 << 20
#: name -> (environment, NIXL UCX backend parameters). NIXL's UCX backend defaults to
#: ucx_error_handling_mode=peer, which only tcp (of the intra-host transports) supports; "none"
#: lets UCX use cuda_copy/cuda_ipc/sm/cma.
SETTINGS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "default": ({}, {}),
    "errh=none": ({}, {"ucx_error_handling_mode": "none"}),
    "errh=none,tls=cc+ipc+sm": (
        {"UCX_TLS": "cuda_copy,cuda_ipc,sm,self"},
        {"ucx_error_handling_mode": "none"},
    ),
}


def _nixl() -> Any:
    for mod in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            return importlib.import_module(f"{mod}._api")
        except ImportError:
            continue
    raise ImportError("no NIXL build found")


def _agent(name: str, params: dict[str, str]) -> Any:
    api = _nixl()
    agent = api.nixl_agent(
        name,
        api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[]),
    )
    agent.create_backend("UCX", params)
    return agent


def _crc(arr: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B"))


def _wait(agent: Any, h: Any, timeout: float) -> float:
    t0 = time.perf_counter()
    agent.transfer(h)
    while (s := agent.check_xfer_state(h)) == "PROC":
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError("transfer did not finish")
    dt = time.perf_counter() - t0
    if s != "DONE":
        raise RuntimeError(f"transfer ended {s}")
    return dt


def _shapes(n: int, row: int) -> dict[str, tuple[int, np.ndarray]]:
    """name -> (row length, destination row of each source row)."""
    rows = n // row
    perm = np.random.default_rng(3).permutation(rows).astype(np.int64)
    return {f"1x{n // MiB}MiB": (n, np.zeros(1, np.int64)), f"{rows}x{row // 1024}KiB": (row, perm)}


def _table(base: int, row: int, count: int, dev: int, order: np.ndarray | None = None) -> Any:
    off = np.arange(count, dtype=np.uint64) if order is None else order.astype(np.uint64)
    t = np.empty((count, 3), dtype=np.uint64)
    t[:, 0] = np.uint64(base) + off * np.uint64(row)
    t[:, 1] = row
    t[:, 2] = dev
    return t


# ---------------------------------------------------------------- decode process


def _decode(conn: Any, n: int, on_gpu: bool, setting: str) -> None:
    env, params = SETTINGS[setting]
    os.environ.update(env)
    if on_gpu:
        import torch

        torch.cuda.set_device(0)
        buf_t = torch.zeros(n, dtype=torch.uint8).pin_memory()
        buf = buf_t.numpy()
    else:
        buf = np.zeros(n, dtype=np.uint8)
    agent = _agent("decode", params)
    agent.register_memory(np.array([[buf.ctypes.data, n, 0]], np.uint64), "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    peer_md = conn.recv()
    peer = agent.add_remote_agent(peer_md)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    while True:
        agent.get_new_notifs()  # drives UCX progress for the initiator's transfers
        if not conn.poll(0.0002):
            continue
        msg = conn.recv()
        try:
            if msg[0] == "stop":
                conn.send(("ok",))
                return
            if msg[0] == "reset":
                buf[:] = 0
                conn.send(("ok",))
            elif msg[0] == "digest":
                row, perm = msg[1], msg[2]
                view = buf.reshape(-1, row)[perm] if len(perm) > 1 else buf
                conn.send(("ok", _crc(view)))
            elif msg[0] == "read":  # (b): READ prefill's source rows into this buffer
                _, sbase, row, perm, kind, dev, repeat, timeout = msg
                count = len(perm)
                lh = agent.prep_xfer_dlist("", _table(buf.ctypes.data, row, count, 0, perm), "DRAM")
                rh = agent.prep_xfer_dlist(peer, _table(sbase, row, count, dev), kind)
                idx = np.arange(count, dtype=np.int64)
                times = []
                try:
                    for i in range(repeat + 1):
                        if i == repeat:  # last one on a zeroed buffer, then checked
                            buf[:] = 0
                        h = agent.make_prepped_xfer("READ", lh, idx, rh, idx)
                        times.append(_wait(agent, h, timeout))
                        agent.release_xfer_handle(h)
                finally:
                    agent.release_dlist_handle(lh)
                    agent.release_dlist_handle(rh)
                view = buf.reshape(-1, row)[perm] if count > 1 else buf
                conn.send(("ok", times[1:], _crc(view)))
        except Exception as exc:  # report, keep serving
            conn.send(("err", f"{type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------- prefill process


class Prefill:
    def __init__(self, args: argparse.Namespace, setting: str) -> None:
        self.args = args
        self.setting = setting
        self.n = args.mib * MiB
        self.on_gpu = args.device == "cuda"
        env, params = SETTINGS[setting]
        os.environ.update(env)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_decode, args=(child, self.n, self.on_gpu, setting), daemon=True
        )
        self.proc.start()
        if self.on_gpu:
            import torch

            self.torch = torch
            torch.cuda.set_device(0)
            self.src_t = torch.empty(self.n, dtype=torch.uint8, device="cuda:0")
            self.stage_t = torch.zeros(self.n, dtype=torch.uint8).pin_memory()
            self.src_ptr, self.kind = self.src_t.data_ptr(), "VRAM"
            self.stage = self.stage_t.numpy()
        else:
            self.src = np.empty(self.n, np.uint8)
            self.stage = np.zeros(self.n, np.uint8)
            self.src_ptr, self.kind = self.src.ctypes.data, "DRAM"
        self.agent = _agent("prefill", params)
        self.agent.register_memory(np.array([[self.src_ptr, self.n, 0]], np.uint64), self.kind)
        self.agent.register_memory(
            np.array([[self.stage.ctypes.data, self.n, 0]], np.uint64), "DRAM"
        )
        if not self.conn.poll(120):
            raise TimeoutError("decode process did not start")
        md, self.dst = self.conn.recv()
        self.conn.send(self.agent.get_agent_metadata())
        peer = self.agent.add_remote_agent(md)
        self.peer = peer.decode() if isinstance(peer, bytes) else peer

    def ask(self, *msg: Any, timeout: float = 60.0) -> tuple[Any, ...]:
        self.conn.send(msg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.agent.get_new_notifs()  # progress for the decode side's READs
            if self.conn.poll(0.0002):
                out: tuple[Any, ...] = self.conn.recv()
                if out[0] == "err":
                    raise RuntimeError(out[1])
                return out
        raise TimeoutError(f"decode did not answer {msg[0]!r}")

    def fill(self, seed: int) -> int:
        if self.on_gpu:
            g = self.torch.Generator(device="cuda:0").manual_seed(seed)
            self.src_t.random_(0, 256, generator=g)
            self.torch.cuda.synchronize()
            return _crc(self.src_t.cpu().numpy())
        self.src[:] = np.random.default_rng(seed).integers(0, 256, self.n, dtype=np.uint8)
        return _crc(self.src)

    def hop(self) -> float:
        """Local copy of the whole source into the pinned staging buffer."""
        t0 = time.perf_counter()
        if self.on_gpu:
            self.stage_t.copy_(self.src_t, non_blocking=True)
            self.torch.cuda.synchronize()
        else:
            np.copyto(self.stage, self.src)
        return time.perf_counter() - t0

    def write(self, base: int, kind: str, row: int, perm: np.ndarray, chunks: int = 0) -> Any:
        """Prepared WRITE from rows at base to the decode buffer; returns a timing function."""
        count = len(perm)
        lh = self.agent.prep_xfer_dlist("", _table(base, row, count, 0), kind)
        rh = self.agent.prep_xfer_dlist(self.peer, _table(self.dst, row, count, 0, perm), "DRAM")
        idx = np.arange(count, dtype=np.int64)

        def run() -> float:
            h = self.agent.make_prepped_xfer("WRITE", lh, idx, rh, idx)
            dt = _wait(self.agent, h, self.args.xfer_timeout)
            self.agent.release_xfer_handle(h)
            return dt

        def release() -> None:
            self.agent.release_dlist_handle(lh)
            self.agent.release_dlist_handle(rh)

        return run, release, lh, rh

    def pipelined(self, lh: Any, rh: Any, count: int, chunks: int) -> float:
        """Hop chunk k on the copy stream while chunk k-1 is written."""
        per = count // chunks
        step = per * (self.n // count)
        t0 = time.perf_counter()
        events = []
        if self.on_gpu:
            torch = self.torch
            for k in range(chunks):
                a, b = k * step, (k + 1) * step
                self.stage_t[a:b].copy_(self.src_t[a:b], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                events.append(ev)
        handles = []
        for k in range(chunks):
            if self.on_gpu:
                events[k].synchronize()
            else:
                a, b = k * step, (k + 1) * step
                np.copyto(self.stage[a:b], self.src[a:b])
            idx = np.arange(k * per, (k + 1) * per, dtype=np.int64)
            h = self.agent.make_prepped_xfer("WRITE", lh, idx, rh, idx)
            self.agent.transfer(h)
            handles.append(h)
        for h in handles:
            while (s := self.agent.check_xfer_state(h)) == "PROC":
                if time.perf_counter() - t0 > self.args.xfer_timeout:
                    raise TimeoutError("pipelined transfer did not finish")
            if s != "DONE":
                raise RuntimeError(f"pipelined transfer ended {s}")
        dt = time.perf_counter() - t0
        for h in handles:
            self.agent.release_xfer_handle(h)
        return dt

    def check_dst(self, want: int, row: int, perm: np.ndarray) -> bool:
        return bool(self.ask("digest", row, perm)[1] == want)

    def close(self) -> None:
        try:
            self.ask("stop", timeout=10)
        finally:
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()


def _gbps(n: int, times: list[float]) -> dict[str, float]:
    return {
        "best_gbps": round(n / min(times) / 1e9, 3),
        "median_gbps": round(n / float(np.median(times)) / 1e9, 3),
    }


def run_setting(args: argparse.Namespace, setting: str) -> None:
    """One prefill process (+ its decode child); prints RESULT lines as it goes."""
    p = Prefill(args, setting)
    rep, n = args.repeat, p.n
    seed = [100]

    def emit(method: str, shape: str, ok: bool, times: list[float] | None, **extra: Any) -> None:
        rec = {"setting": setting, "method": method, "shape": shape, "ok": ok, **extra}
        if times:
            rec.update(_gbps(n, times))
        print("RESULT " + json.dumps(rec), flush=True)

    def attempt(method: str, shape: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            emit(method, shape, False, None, error=f"{type(exc).__name__}: {exc}"[:300])

    def _one_shape(shape: str, row: int, perm: np.ndarray) -> None:
        count = len(perm)

        def a() -> None:  # WRITE VRAM -> remote DRAM
            seed[0] += 1
            want = p.fill(seed[0])
            run, release, _, _ = p.write(p.src_ptr, p.kind, row, perm)
            try:
                run()  # warm-up (UCX wire-up)
                times = [run() for _ in range(rep - 1)]
                p.ask("reset")
                times.append(run())
            finally:
                release()
            emit("a WRITE VRAM->remote DRAM", shape, p.check_dst(want, row, perm), times)

        def b() -> None:  # READ by decode
            seed[0] += 1
            want = p.fill(seed[0])
            timeout = args.xfer_timeout * (rep + 2)
            out = p.ask(
                "read", p.src_ptr, row, perm, p.kind, 0, rep, args.xfer_timeout, timeout=timeout
            )
            emit("b READ by decode VRAM->DRAM", shape, out[2] == want, out[1])

        def c() -> None:  # hop + DRAM WRITE
            seed[0] += 1
            want = p.fill(seed[0])
            run, release, lh, rh = p.write(p.stage.ctypes.data, "DRAM", row, perm)
            hops, writes, e2e, piped = [], [], [], []
            try:
                for i in range(rep + 1):
                    if i == rep:
                        p.stage[:] = 0
                        p.ask("reset")
                    h = p.hop()
                    w = run()
                    if i:
                        hops.append(h)
                        writes.append(w)
                        e2e.append(h + w)
                ok = p.check_dst(want, row, perm) and _crc(p.stage) == want
                emit("c1 hop D2H (own pinned)", shape, ok, hops)
                emit("c2 WRITE DRAM->remote DRAM", shape, ok, writes)
                emit("c  hop+WRITE end to end", shape, ok, e2e)
                if count >= args.chunks:
                    seed[0] += 1
                    want = p.fill(seed[0])
                    for i in range(rep + 1):
                        if i == rep:
                            p.stage[:] = 0
                            p.ask("reset")
                        dt = p.pipelined(lh, rh, count, args.chunks)
                        if i:
                            piped.append(dt)
                    ok = p.check_dst(want, row, perm)
                    emit(f"c' hop||WRITE, {args.chunks} chunks", shape, ok, piped)
            finally:
                release()

        def d() -> None:  # reference local D2H
            seed[0] += 1
            want = p.fill(seed[0])
            times = []
            for i in range(rep + 1):
                if i == rep:
                    p.stage[:] = 0
                dt = p.hop()
                if i:
                    times.append(dt)
            emit("d local D2H torch (ref)", shape, _crc(p.stage) == want, times)

        for name, fn in (("a", a), ("b", b), ("c", c), ("d", d)):
            if name in args.methods:
                attempt(name, shape, fn)

    try:
        for shape, (row, perm) in _shapes(n, args.row_kib * 1024).items():
            _one_shape(shape, row, perm)
    finally:
        p.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--row-kib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--methods", default="abcd")
    ap.add_argument("--settings", default=";".join(SETTINGS), help="names, separated by ';'")
    ap.add_argument("--timeout", type=float, default=150.0, help="per setting, seconds")
    ap.add_argument("--xfer-timeout", type=float, default=30.0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "host_path.json"))
    ap.add_argument("--logdir", default=os.environ.get("OUT", "."))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        run_setting(args, args.one)
        return 0
    results: list[dict[str, Any]] = []
    problems: list[str] = []
    base = list(argv if argv is not None else sys.argv[1:])
    for setting in args.settings.split(";"):
        log = os.path.join(
            args.logdir, f"log_{''.join(c if c.isalnum() else '_' for c in setting)}.txt"
        )
        env = dict(os.environ, UCX_PROTO_INFO="y")
        t0 = time.monotonic()
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *base, "--one", setting],
                stdout=subprocess.PIPE,
                stderr=fh,
                env=env,
                start_new_session=True,
                text=True,
            )
            try:
                out, _ = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                problems.append(f"{setting}: killed after {args.timeout:.0f} s")
            fh.write(out)
        got = [json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT ")]
        results += got
        if proc.returncode:
            problems.append(
                f"{setting}: exit {proc.returncode} after {time.monotonic() - t0:.0f} s"
            )
        print(
            f"# {setting}: {len(got)} results, rc {proc.returncode}, "
            f"{time.monotonic() - t0:.0f} s, log {log}",
            flush=True,
        )
    with open(args.out, "w") as fh:
        json.dump({"args": vars(args), "results": results, "problems": problems}, fh, indent=1)
    ref = {
        (r["setting"], r["shape"]): r["best_gbps"]
        for r in results
        if r["method"].startswith("d ") and r["ok"]
    }
    print(f"\n{'setting':32} {'method':30} {'shape':13} {'ok':3} {'GB/s':>8} {'med':>8} {'/d':>6}")
    for r in results:
        g = r.get("best_gbps")
        key = (r["setting"], r["shape"])
        ratio = f"{g / ref[key]:.3f}" if g and key in ref else "-"
        print(
            f"{r['setting']:32} {r['method']:30} {r['shape']:13} {'y' if r['ok'] else 'N':3} "
            f"{g if g is not None else '-':>8} {r.get('median_gbps', '-'):>8} {ratio:>6}"
            + (f"  {r['error'][:70]}" if "error" in r else "")
        )
    for pr in problems:
        print("PROBLEM", pr)
    return 0 if results and all(r["ok"] for r in results) and not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
