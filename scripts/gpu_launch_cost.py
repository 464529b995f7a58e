"""Host cost of one `cudaipc` page write, piece by piece, on a GPU (issue 27, the C=1 latency).

The session-17 trace put 0.18 ms of a 2 MiB request's 1.2-1.5 ms in `CudaIpcBackend._launch`
and a stack sampler found prefill's workers inside Triton's launcher more often than
anywhere else. This times, in one process with no other thread (medians of ``--repeat``
calls, host µs, the stream synchronised every 64 calls so its queue never fills), for one
chunk of the issue's model (32 layers x K/V, 16-token pages of 2 KiB rows) from a pool on
GPU 0 into a pool on GPU 1 (peer access on):

- ``page_chunk``: the mapper's page form of the chunk;
- ``copy_pages``: the page mover's whole call (table slot, the launch, the slot's event);
- ``launch``: the compiled kernel's launch alone, as the mover makes it (``kernel[grid]``);
- ``event``: a blocking CUDA event made and recorded, as the backend does after a launch;
- ``device``: entering and leaving ``torch.cuda.device`` of the current device;
- ``query``: ``Event.query`` of a completed event.

It also prints the installed Triton's launch entry points (names and signatures only), for
the next step: whether a launch can skip the per-call Python of the runner.

    python3 scripts/gpu_launch_cost.py --json $OUT/launch_cost.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvwire.descriptors import ADDR
from kvwire.index import EqualTPMapper
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.movers.triton_pool_pages import PoolPageCopier

MODEL = ModelSpec(
    num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16, is_mla=False
)


def pool(dev: int, slots: int) -> KVLayout:
    """A pool of ``slots`` pages on GPU ``dev``: one buffer per (layer, K/V)."""
    shape = (slots, MODEL.page_size, MODEL.total_kv_heads, MODEL.head_dim)
    bufs = [
        torch.zeros(shape, dtype=torch.bfloat16, device=f"cuda:{dev}")
        for _ in range(2 * MODEL.num_layers)
    ]
    return KVLayout.from_tensors(MODEL, bufs, RankPosition(tp_size=1, tp_rank=0))


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median host µs of ``fn`` (GPU 0 synchronised every 64 calls, outside the timing)."""
    out = []
    for i in range(repeat):
        if i % 64 == 0:
            torch.cuda.synchronize(0)
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize(0)
    return statistics.median(out)


def measure(
    npages: int,
    mapper: EqualTPMapper,
    s_all: Any,
    d_all: Any,
    mover: PoolPageCopier,
    stream: Any,
    seen: dict[str, Any],
    repeat: int,
) -> dict[str, Any]:
    """One chunk of ``npages`` pages: every piece timed (module docstring)."""
    sp = np.arange(npages, dtype=np.int64)
    dp = np.arange(npages, 2 * npages, dtype=np.int64)
    chunk = mapper.page_chunk(sp, dp)
    assert chunk is not None
    g = chunk.geometry
    src_a, dst_a = s_all[g.src_rows], d_all[g.dst_rows]
    mover.copy_pages(chunk, src_a, dst_a, stream=stream)
    torch.cuda.synchronize(0)
    _fn, name, key, index, addrs, scalars, _stream = seen["args"][:7]
    kernel = mover._kernels.kernel((name, *key))
    grid = seen["kw"].get("grid") or int(addrs.size) * int(index.size)
    assert mover._slots is not None
    table = mover._slots.addr(0)
    cs = stream.cuda_stream
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record(stream)
    torch.cuda.synchronize(0)

    def event() -> None:
        ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        ev.record(stream)

    def device() -> None:
        with torch.cuda.device(0):
            pass

    row: dict[str, Any] = {
        "pages": npages,
        "mib": npages * 2,
        "page_chunk_us": timed(lambda: mapper.page_chunk(sp, dp), repeat),
        "copy_pages_us": timed(
            lambda: mover.copy_pages(chunk, src_a, dst_a, stream=stream), repeat
        ),
        "launch_us": timed(lambda: kernel[(grid, 1, 1)](table, *scalars, *key, stream=cs), repeat),
        "event_us": timed(event, repeat),
        "device_us": timed(device, repeat),
        "query_us": timed(done.query, repeat),
    }
    print(", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    if npages == 1:  # where a launch's host time goes, by function (one thread: cProfile)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for i in range(300):
            kernel[(grid, 1, 1)](table, *scalars, *key, stream=cs)
            if i % 64 == 63:
                torch.cuda.synchronize(0)
        prof.disable()
        torch.cuda.synchronize(0)
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="1,8,64", help="pages per chunk (2 MiB each)")
    ap.add_argument("--repeat", type=int, default=500)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    from kvwire_cudaipc._cuda import enable_peer_access

    enable_peer_access(0, 1)
    torch.cuda.set_device(0)
    slots = 2 * max(int(x) for x in a.pages.split(",")) + 2
    src, dst = pool(0, slots), pool(1, slots)
    mapper = EqualTPMapper(src, dst)
    tables = mapper.build_tables()
    s_all, d_all = tables.src[:, ADDR].astype(np.int64), tables.dst[:, ADDR].astype(np.int64)
    mover = PoolPageCopier(0)
    stream = torch.cuda.Stream(0)  # type: ignore[no-untyped-call]
    seen: dict[str, Any] = {}
    launch = mover._launch

    def spy(*args: Any, **kw: Any) -> None:  # the mover's launch arguments, kept
        seen["args"], seen["kw"] = args, kw
        launch(*args, **kw)

    mover._launch = spy  # type: ignore[method-assign]
    rows = [measure(int(x), mapper, s_all, d_all, mover, stream, seen, a.repeat)
            for x in a.pages.split(",")]  # fmt: skip
    kernel = mover._kernels.kernels()[0]
    api: dict[str, str] = {"kernel_type": type(kernel).__qualname__}
    for name in ("__getitem__", "run", "launch_metadata", "_init_handles"):
        fn = getattr(type(kernel), name, None) or getattr(kernel, name, None)
        if fn is not None:
            try:
                api[name] = str(inspect.signature(fn))
            except (TypeError, ValueError):
                api[name] = type(fn).__name__
    run = getattr(kernel, "run", None)
    if run is not None:
        api["run_type"] = type(run).__qualname__
        try:
            api["run.__call__"] = str(inspect.signature(type(run).__call__))
        except (TypeError, ValueError, AttributeError):
            api["run.__call__"] = "?"
    print(api)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "triton_api": api}, f, indent=1)


if __name__ == "__main__":
    main()
