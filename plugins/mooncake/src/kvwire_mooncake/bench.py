"""``python -m kvwire_mooncake.bench``: kvwire's ``mooncake`` backend against raw Mooncake calls.

A spawned target process runs a kvwire ``mooncake`` agent (kvwire's bench target) with one
registered buffer. This process holds a kvwire ``mooncake`` agent *and* a raw Mooncake
``TransferEngine``, both with the same source buffer registered, and moves the same
descriptors (target rows shuffled, so nothing merges) to the target's engine three ways:

* ``raw``: one ``batch_transfer_async_write`` of all descriptors, then the blocking
  ``get_batch_transfer_status`` (the engine at its best; queue raised so one batch fits);
* ``kvwire``: ``submit`` + ``poll`` until DONE (batches of ``max_batch_descs``, waiter thread);
* ``kvwire+notify``: the same with a notification, DONE once the target acknowledged it.

Runs are interleaved (raw, kvwire, kvwire+notify, raw, ...) so machine noise hits all alike;
each mode's result is verified once against the target's digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import statistics
import sys
import time
from functools import partial
from typing import Any

import msgpack
import numpy as np

from kvwire.backend import TransferBackend, XferOp, XferState
from kvwire.bench.backend import CASES, await_reply, target_main
from kvwire.config import KVWireConfig
from kvwire.descriptors import make_table
from kvwire.layout import MemoryRegion
from kvwire.selection import create_backend
from kvwire_mooncake.engine import EngineSettings, create_engine, import_engine

MODES = ("raw", "kvwire", "kvwire+notify")


def _raw_once(engine: Any, segment: str, la: list[int], ra: list[int], lens: list[int]) -> None:
    bid = engine.batch_transfer_async_write(segment, la, ra, lens)
    if not (type(bid) is int and 0 < bid < (1 << 63)):
        raise RuntimeError(f"raw Mooncake submit of {len(la)} descriptors failed (id {bid})")
    rc = engine.get_batch_transfer_status([bid])
    if rc != 0:
        raise RuntimeError(f"raw Mooncake batch of {len(la)} descriptors failed ({rc})")


def _kvwire_once(
    backend: TransferBackend, pair: Any, idx: np.ndarray, conn: Any, notify: bool
) -> None:
    h = backend.submit(XferOp.WRITE, pair, idx, idx, b"bench" if notify else None)
    while (st := backend.poll(h)) is XferState.PENDING:
        time.sleep(0.0001)
    backend.release(h)
    if st is not XferState.DONE:
        raise RuntimeError(f"kvwire WRITE failed: {h.error}")
    if notify:
        await_reply(conn, "notified")


def measure(repeat: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case of :data:`kvwire.bench.backend.CASES`, WRITE, three modes."""
    config = KVWireConfig(transfer_backend="mooncake", transfer_backend_options=options)
    span = max(n * size for _, n, size in CASES)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(child, config.model_dump_json(), 2 * span))
    proc.start()
    backend = create_backend(config, "bench-initiator")
    rows: list[dict[str, Any]] = []
    raw: Any = None
    try:
        if not conn.poll(120):
            raise TimeoutError("bench target did not start")
        meta, remote_base = conn.recv()
        segment = msgpack.unpackb(meta, raw=False)["segment"]
        src = np.random.default_rng(1).integers(0, 256, span, np.uint8)
        backend.register([MemoryRegion.from_tensor(src, item_len=1)])
        peer = backend.add_peer(meta)
        opts = backend.options
        raw = create_engine(
            import_engine(),
            EngineSettings(
                advertise_host=opts.advertise_host or opts.host,  # type: ignore[attr-defined]
                bind_host=opts.host,  # type: ignore[attr-defined]
                protocol=opts.protocol,  # type: ignore[attr-defined]
                device_name=opts.device_name,  # type: ignore[attr-defined]
                transfer_timeout_s=120.0,
            ),
        ).engine
        if raw.register_memory(src.ctypes.data, src.nbytes) != 0:
            raise RuntimeError("raw engine could not register the source buffer")
        for label, n, size in CASES:
            local_offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
            remote_offs = np.random.default_rng(2).permutation(2 * n)[:n].astype(np.uint64)
            remote_offs *= np.uint64(size)
            pair = backend.prepare(
                peer,
                make_table(src.ctypes.data + local_offs, size),
                make_table(remote_base + remote_offs, size),
            )
            la = (np.uint64(src.ctypes.data) + local_offs).tolist()
            ra = (np.uint64(remote_base) + remote_offs).tolist()
            lens = [size] * n
            idx = np.arange(n)
            want = hashlib.blake2b(
                b"".join(src[int(o) : int(o) + size].tobytes() for o in local_offs.tolist())
            ).hexdigest()
            runs = {
                "raw": partial(_raw_once, raw, segment, la, ra, lens),
                "kvwire": partial(_kvwire_once, backend, pair, idx, conn, False),
                "kvwire+notify": partial(_kvwire_once, backend, pair, idx, conn, True),
            }
            verified = {}
            for mode in MODES:  # one verified warm-up run per mode, on a scrambled target
                conn.send(("fill", 3))
                await_reply(conn, "filled")
                runs[mode]()
                conn.send(("digest", remote_offs.tolist(), size))
                verified[mode] = await_reply(conn, "digest")[1] == want
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(repeat):
                for mode in MODES:
                    t0 = time.perf_counter()
                    runs[mode]()
                    times[mode].append(time.perf_counter() - t0)
            backend.release_prepared(pair)
            for mode in MODES:
                best = min(times[mode])
                rows.append(
                    {
                        "case": label,
                        "mode": mode,
                        "descs": n,
                        "bytes": n * size,
                        "best_s": best,
                        "median_s": statistics.median(times[mode]),
                        "gbps": n * size / best / 1e9,
                        "verified": verified[mode],
                    }
                )
    finally:
        backend.close()
        raw = None
        conn.send(("stop",))
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure, print the table (and optionally JSON)."""
    ap = argparse.ArgumentParser(prog="python -m kvwire_mooncake.bench", description=__doc__)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per mode and case")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option (repeatable), e.g. completion_wait=spin or max_batch_descs=512",
    )
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    options: dict[str, Any] = {"host": args.host}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--option {item!r} is not KEY=VALUE")
        options[key] = value
    rows = measure(args.repeat, options)
    raw = {r["case"]: r["gbps"] for r in rows if r["mode"] == "raw"}
    extra = ", ".join(f"{k}={v}" for k, v in options.items())
    print(f"kvwire mooncake vs raw Mooncake, WRITE, two processes, best of {args.repeat} ({extra})")
    print(f"{'case':<15}{'mode':<15}{'GB/s':>8}{'median ms':>11}{'vs raw':>8}{'verified':>10}")
    for r in rows:
        print(
            f"{r['case']:<15}{r['mode']:<15}{r['gbps']:>8.2f}{r['median_s'] * 1e3:>11.1f}"
            f"{r['gbps'] / raw[r['case']]:>8.2f}{'yes' if r['verified'] else 'NO':>10}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
