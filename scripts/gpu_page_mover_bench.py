"""Bulk staging's gather and scatter on a GPU: the page mover against the run mover, one run.

The model of issue 27 (a page is 2 MiB in 64 buffers of 32 KiB per page) on GPU 0. For 8 and
64 pages (16 and 128 MiB), whole rows and a head slice (a quarter of each token row, as a
TP 1 -> 4 split moves), it

1. checks the page mover (:class:`kvwire.movers.triton_pages.PageCopier`) byte for byte: a
   gather into a block against torch's indexing, then a scatter of a fresh block into other
   pages (and nothing else in the pool changed);
2. times, side by side, what a staged chunk pays on each side: the run mover path as it was
   (``KVTensors.runs`` planned on the host + :class:`~kvwire.movers.triton_copy.RunCopier`)
   and the page mover: host microseconds per call (planning, table and launch, no wait) and
   the whole call with its wait (what a transfer worker or decode's progress thread pays),
   medians of ``--repeat``.

    python3 scripts/gpu_page_mover_bench.py --json $OUT/page_mover.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvwire.movers.triton_copy import RunCopier
from kvwire.movers.triton_pages import PageCopier

NBUF, PAGE, ROW = 64, 16, 2048  # 64 buffers (32 layers x K/V), 16 tokens of 2 KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="8,64")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    sizes = [int(x) for x in a.pages.split(",")]
    slots = 2 * max(sizes) + 8
    pool = torch.randint(
        -(2**31), 2**31 - 1, (NBUF, slots, PAGE, ROW // 4), dtype=torch.int32, device=dev
    )
    pb = pool.view(torch.uint8).view(NBUF, slots, PAGE, ROW)
    addrs = np.array([pool[b].data_ptr() for b in range(NBUF)], dtype=np.int64)
    slot_bytes = PAGE * ROW
    stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    pages_mv, runs_mv = PageCopier(dev), RunCopier(dev)
    rng = np.random.default_rng(0)
    out: list[dict[str, Any]] = []
    for npages in sizes:
        for lo, hi in ((0, ROW), (ROW // 4, ROW // 2)):
            whole = hi - lo == ROW
            n, tokens = (PAGE * ROW, 1) if whole else (hi - lo, PAGE)
            nbytes = NBUF * npages * PAGE * (hi - lo)
            block = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
            pages = rng.permutation(slots)[:npages].astype(np.int64)
            kw = {"slot_bytes": slot_bytes, "lo": lo, "row": ROW, "n": n, "tokens": tokens}

            def page_call(
                to_pool: bool, pg: np.ndarray = pages, blk: Any = block, kw: Any = kw
            ) -> None:
                pages_mv.copy(addrs, pg, blk.data_ptr(), to_pool=to_pool, stream=stream, **kw)

            def run_call(
                to_pool: bool,
                pg: np.ndarray = pages,
                blk: Any = block,
                whole: bool = whole,
                lo: int = lo,
                n: int = n,
            ) -> None:
                start = addrs[:, None] + pg[None, :] * slot_bytes
                if whole:
                    p = start.ravel()
                else:
                    tok = np.arange(PAGE, dtype=np.int64) * ROW + lo
                    p = (start[:, :, None] + tok[None, None, :]).ravel()
                b = blk.data_ptr() + np.arange(p.size, dtype=np.int64) * n
                lens = np.full(p.size, n, dtype=np.int64)
                runs_mv.copy(b, p, lens, stream) if to_pool else runs_mv.copy(p, b, lens, stream)

            # 1. check
            page_call(False)
            stream.synchronize()
            want = pb[:, torch.as_tensor(pages, device=dev), :, lo:hi].reshape(-1)
            gather_ok = bool(torch.equal(block, want))
            fresh = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
            block.copy_(fresh)
            torch.cuda.synchronize(dev)
            others = np.setdiff1d(np.arange(slots), pages)[:npages]
            before = pb.clone()
            page_call(True, others)
            stream.synchronize()
            sel = torch.as_tensor(others, device=dev)
            scatter_ok = bool(torch.equal(pb[:, sel, :, lo:hi].reshape(-1), fresh))
            before[:, sel, :, lo:hi] = pb[:, sel, :, lo:hi]
            untouched = bool(torch.equal(before, pb))
            del before
            row: dict[str, Any] = {
                "pages": npages,
                "mib": nbytes / 2**20,
                "slice": [lo, hi],
                "gather_ok": gather_ok,
                "scatter_ok": scatter_ok,
                "untouched_ok": untouched,
            }
            # 2. time (gather direction; the scatter is the same launch reversed)
            for name, fn in (("runs", run_call), ("pages", page_call)):
                fn(False)
                stream.synchronize()
                host, whole_call = [], []
                for _ in range(a.repeat):
                    t0 = time.perf_counter()
                    fn(False)
                    t1 = time.perf_counter()
                    stream.synchronize()
                    t2 = time.perf_counter()
                    host.append(t1 - t0)
                    whole_call.append(t2 - t0)
                row[f"{name}_host_us"] = 1e6 * statistics.median(host)
                row[f"{name}_call_us"] = 1e6 * statistics.median(whole_call)
            out.append(row)
            print(
                f"{npages:>3} pages {row['mib']:6.1f} MiB slice {lo}-{hi}: ok "
                f"{gather_ok and scatter_ok and untouched}; host us runs {row['runs_host_us']:.0f}"
                f" pages {row['pages_host_us']:.0f}; call us runs {row['runs_call_us']:.0f} "
                f"pages {row['pages_call_us']:.0f}",
                flush=True,
            )
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "results": out}, f, indent=1)
    assert all(r["gather_ok"] and r["scatter_ok"] and r["untouched_ok"] for r in out)


if __name__ == "__main__":
    main()
