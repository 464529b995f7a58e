"""Prefill's checksums computed beside the write (issue 26 item 1): ``SentSums.chunk_later``
(``DeviceRowHasher.page_sums_later``) on a GPU, checked and timed, one GPU.

For the links of ``scripts/gpu_page_sums_check.py`` (the issue's model, equal TP and head
slices both ways, pools on the GPU), random chunks of 1-16 pages:

1. later calls' sums, taken on another thread (as ``cudaipc``'s kernel watcher makes the
   note), equal ``SentSums.chunk``'s for the same chunks: five later calls outstanding at
   once (more than the lane's page slots: the oldest is waited for when its slot comes round
   again) and a plain call after them, the results taken newest first;
2. the calling thread's host time per chunk (medians): ``chunk`` (launch and wait) against
   ``chunk_later`` (launch and event, no wait), what a transfer worker pays before it can
   launch the chunk's write;
3. the order summed in the write's launch (``cudaipc``'s ``summed_writes``: the pool page
   mover copies the chunk from the prefill pool into the decode pool, both on this GPU, and
   sums it in the same launch): every chunk's sums equal ``chunk``'s and every copied byte
   equals its source; host time of the worker's two ways to launch a checked chunk's write:
   the sums' own launch then the copy's (``start`` + ``copy_pages``) against one summed
   launch (``take`` + ``copy_pages(sums=...)`` + ``launched``).
4. decode's checks launched before they wait (``LandedSums.chunk_later``, what decode's
   progress thread does for the chunks one drain of notes completed): for 1, 4 and 8 chunks
   of a request each, every launched check's sums equal ``LandedSums.chunk``'s; host time to
   check them one after another (``chunk``: launch and wait each) against launching all then
   waiting for each.

    python3 scripts/gpu_later_sums_check.py --json $OUT/later_sums.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import numpy as np
from gpu_page_sums_check import LINKS, pools

from kvwire.config import KVWireConfig
from kvwire.layout import ModelSpec
from kvwire.session.checksums import SentSums
from kvwire.session.handshake import build_mapper


def on_thread(fn: Any) -> Any:
    """``fn()`` called on a thread of its own (the result taken elsewhere than launched)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def fused(sent: Any, src: Any, dst: Any, chunk: Any, a: Any) -> tuple[int, int, dict[str, Any]]:
    """Part 3 of the docstring: (wrong, chunks checked, host times)."""
    import torch

    from kvwire.descriptors import ADDR
    from kvwire.integrity_device import DeviceRowHasher
    from kvwire.movers.triton_pool_pages import PoolPageCopier

    mapper = sent.mapper
    tables = mapper.build_tables()
    _, d_side = sent.sides
    landed_sums = DeviceRowHasher(dst)
    mover = PoolPageCopier("cuda:0")
    stream = torch.cuda.Stream()
    wrong = checked = 0
    times: dict[str, list[float]] = {"start_then_copy": [], "summed_copy": []}
    for i in range(a.rounds * 6 + a.repeat):
        s, d = chunk()
        pc = mapper.page_chunk(s, d)
        g = pc.geometry
        sa = tables.src[g.src_rows, ADDR].astype(np.int64)
        da = tables.dst[g.dst_rows, ADDR].astype(np.int64)
        t0 = time.perf_counter()
        if i % 2:
            order = sent.chunk_later(s, d)
            order.start()
            mover.copy_pages(pc, sa, da, stream=stream)
            key = "start_then_copy"
        else:
            order = sent.chunk_later(s, d)
            args = order.take()
            assert args is not None and mover.sums_fit(pc, args)
            mover.copy_pages(pc, sa, da, stream=stream, sums=args)
            order.launched(stream)
            key = "summed_copy"
        times[key].append(time.perf_counter() - t0)
        got = on_thread(order)
        if i < a.rounds * 6:  # checked: the sums, and the copied bytes
            stream.synchronize()
            want = sent.chunk(s, d)
            # what landed, summed as decode checks it: equal only if every byte is
            landed = landed_sums.page_sums(d_side, pc.dst_pages, d_side, pc.dst_pages)
            wrong += got != want or landed != want or len(want) != len(src.buffers) // 2
            checked += 1
    return wrong, checked, times


def landed(a: Any, src: Any, dst: Any, rng: Any, slots: int) -> tuple[int, int, dict[str, Any]]:
    """Part 4 of the docstring: (wrong, checks compared, host times)."""
    from kvwire.session.checksums import LandedSums

    ls = LandedSums(KVWireConfig(), src, dst)
    wrong = checked = 0
    times: dict[str, list[float]] = {}
    for k in (1, 4, 8):
        for i in range(a.rounds + a.repeat // 4):
            reqs = []
            for n in rng.integers(1, 17, size=k).tolist():
                reqs.append((n, rng.permutation(slots)[:n].astype(np.int64)))
            t0 = time.perf_counter()
            seq = [ls.chunk(n, d, None, (0, n)) for n, d in reqs]
            t1 = time.perf_counter()
            later = [ls.chunk_later(n, d, None, (0, n)) for n, d in reqs]
            assert all(x is not None for x in later)
            got = [x() for x in later]  # type: ignore[misc]
            t2 = time.perf_counter()
            if i < a.rounds:
                pairs = zip(got, seq, strict=True)
                wrong += sum(g != w or len(w) != len(dst.buffers) // 2 for g, w in pairs)
                checked += k
            else:
                times.setdefault(f"check_{k}_in_turn", []).append(t1 - t0)
                times.setdefault(f"check_{k}_launched_first", []).append(t2 - t1)
    return wrong, checked, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    a.device = "cuda"
    model = ModelSpec(num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    slots = 40
    rng = np.random.default_rng(11)
    report: dict[str, Any] = {"links": {}}
    bad = 0
    for name, (tps, tpd, rs, rd) in LINKS.items():
        src, _, keep_s = pools(a, model, tps, rs, slots)
        dst, _, keep_d = pools(a, model, tpd, rd, slots)
        sent = SentSums(build_mapper(KVWireConfig(), src, dst), src)

        def chunk() -> tuple[Any, Any]:
            n = int(rng.integers(1, 17))
            return rng.permutation(slots)[:n], rng.permutation(slots)[:n]

        wrong = checked = 0
        for _ in range(a.rounds):
            # more later results outstanding than the lane has page slots (the oldest are
            # waited for when their slot comes round again), a plain call among them, the
            # results taken on another thread, newest first
            chunks = [chunk() for _ in range(6)]
            later = [sent.chunk_later(s, d) for s, d in chunks[:5]]
            assert all(x is not None for x in later), name
            for x in later:
                x.start()  # as the template starts it at submit
            plain = sent.chunk(*chunks[5])
            got = [*[on_thread(x) for x in reversed(later)][::-1], plain]
            want = [sent.chunk(s, d) for s, d in chunks]
            pairs = zip(got, want, strict=True)
            wrong += sum(g != w or len(w) != model.num_layers for g, w in pairs)
            checked += len(chunks)
        s, d = chunk()
        times = {"chunk": [], "chunk_later": [], "result_after_1ms": []}
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            sent.chunk(s.copy(), d)
            t1 = time.perf_counter()
            later = sent.chunk_later(s.copy(), d)
            assert later is not None
            later.start()
            t2 = time.perf_counter()
            time.sleep(0.001)
            t3 = time.perf_counter()
            later()
            t4 = time.perf_counter()
            times["chunk"].append(t1 - t0)
            times["chunk_later"].append(t2 - t1)
            times["result_after_1ms"].append(t4 - t3)
        fw, fc, ftimes = fused(sent, src, dst, chunk, a)
        times.update(ftimes)
        lw, lc, ltimes = landed(a, src, dst, rng, slots)
        times.update(ltimes)
        med = {k: round(1e3 * statistics.median(v), 4) for k, v in times.items()}
        report["links"][name] = {
            "chunks": checked, "wrong": wrong, "host_ms": med, "fused_chunks": fc,
            "fused_wrong": fw, "landed_checks": lc, "landed_wrong": lw,
        }  # fmt: skip
        print(
            f"{name}: {checked} chunks, {wrong} wrong; fused {fc} chunks, {fw} wrong; "
            f"decode checks launched first {lc}, {lw} wrong; host ms per call {med}"
        )
        bad += wrong + fw + lw
        del keep_s, keep_d
    print("LATER-SUMS-OK" if not bad else f"LATER-SUMS-BAD {bad}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
