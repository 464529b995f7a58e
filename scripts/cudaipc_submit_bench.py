"""CPU per page write of ``cudaipc``'s submit path on a host without a GPU, for A/B work on its
Python: the backend's own VRAM path with its CUDA calls replaced by host stand-ins (as
plugins/cudaipc/tests/test_cudaipc_pages.py does: regions flagged VRAM over host memory, the
page mover a no-op that counts its calls, events that are done at once), two agents in one
process. A loop plays a prefill worker: each turn submits ``--concurrency`` chunks in page form
under ``post_batch`` (held and launched together at the turn's end, as on a GPU), then polls
each to DONE and releases it; decode's notifications are drained. Prints, per round, the CPU
microseconds per write of each thread (the worker, the kernel watcher, the side channel's),
every note checked.

    python3 scripts/cudaipc_submit_bench.py [--writes N] [--concurrency C] [--rounds R]

What it does not measure: the launch itself (the stand-in mover does nothing), the GIL's
hand-offs between a rank's threads, the GPU host's slower core. The pipeline above the
backend is ``scripts/worker_cpu_bench.py``'s.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np
from worker_cpu_bench import thread_cpu  # scripts/ is first on the path when run as a script

from kvwire.backend import XferOp, XferState
from kvwire.config import KVWireConfig
from kvwire.index import EqualTPMapper
from kvwire.layout import ModelSpec, RankPosition
from kvwire.selection import create_backend
from kvwire.staging import ChunkPlan
from kvwire.testing.kvfill import make_pool
from kvwire_cudaipc import host_stand_ins

MODEL = ModelSpec(num_layers=32, total_kv_heads=2, head_dim=16, dtype="int32", page_size=4)


class _Pages:
    """The page mover's stand-in: counts launches, moves nothing."""

    def __init__(self) -> None:
        self.launches = 0

    def copy_pages(self, *args: Any, **kwargs: Any) -> None:
        self.launches += 1

    def copy_batch(self, items: Any, *, stream: object = None) -> int:
        self.launches += 1
        return 1


def stand_ins() -> _Pages:
    pages = _Pages()
    host_stand_ins.install(setattr, pages)
    return pages


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--writes", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--pages", type=int, default=8, help="pages per chunk")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    pages = stand_ins()
    slots = 2 * a.pages
    src, s_arrays = make_pool(MODEL, RankPosition(), slots)
    dst, d_arrays = make_pool(MODEL, RankPosition(), slots)
    cfg = KVWireConfig(transfer_backend="cudaipc")
    pre = create_backend(cfg, "prefill", need=())
    dec = create_backend(cfg, "decode", need=())

    try:
        pre.register(host_stand_ins.vram_regions(s_arrays))
        dec.register(host_stand_ins.vram_regions(d_arrays))
        mapper = EqualTPMapper(src, dst)
        tables = mapper.build_tables()
        pair = pre.prepare(pre.add_peer(dec.local_metadata()), tables.src, tables.dst)
        assert pair.state.all_vram
        plan = ChunkPlan.direct(mapper, np.arange(a.pages), np.arange(a.pages) + a.pages)
        assert plan.pages is not None
        chunk = plan.pages
        wake = threading.Event()

        def turns(n: int) -> None:
            got = 0
            for t in range(0, n, a.concurrency):
                k = min(a.concurrency, n - t)
                with pre.post_batch():
                    hs = [pre.submit_pages(XferOp.WRITE, pair, chunk, b"note%d" % i,
                                           wake=wake.set) for i in range(k)]  # fmt: skip
                for h in hs:
                    while (st := pre.poll(h)) is XferState.PENDING:
                        wake.wait(0.001)
                        wake.clear()
                    assert st is XferState.DONE, h.error
                    pre.release(h)
                while got < t + k:
                    got += len(dec.get_notifications())
                    if got < t + k:
                        time.sleep(0.0001)

        turns(400)  # warm-up
        for r in range(a.rounds):
            before, launches = thread_cpu(), pages.launches
            t0 = time.perf_counter()
            turns(a.writes)
            wall = time.perf_counter() - t0
            after = thread_cpu()
            per = {k: (after[k] - before.get(k, 0.0)) * 1e6 / a.writes for k in after}
            row = "  ".join(f"{k}={v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])
                            if v > 0.05)  # fmt: skip
            print(f"round {r}: {a.writes / wall:.0f} writes/s, "
                  f"{(pages.launches - launches) / a.writes:.3f} launches/write; "
                  f"CPU us/write: {row}")  # fmt: skip
    finally:
        pre.close()
        dec.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
