"""The token-run mover (page-size conversion) on a GPU: checked byte for byte, then timed
beside the page mover and torch's indexed copy, one run.

The model of issue 27 (64 buffers of 16-token pages, 2 KiB token rows) on GPU 0. A staged
chunk of a page-converting link (prefill pages of 16 tokens, decode pages of 32: units of 16
tokens; and head slices of units of 1 token) is gathered from 16-token pages into a block and
scattered into 32-token pages. It

1. checks :class:`kvwire.movers.triton_units.UnitCopier` against the NumPy reference runs
   (:func:`kvwire.movers.plan.unit_runs` copied by ``copy_runs_reference`` on a host copy):
   gather, then scatter of a fresh block into other units (nothing else in the pool changed);
2. times, side by side (medians of ``--repeat``, synchronised): the unit mover, the page
   mover on the same bytes as whole pages (what an equal-page chunk pays), and torch's
   indexed copy of the same units.

    python3 scripts/gpu_unit_mover_check.py --json $OUT/unit_mover.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from typing import Any

import numpy as np
import torch

from kvwire.movers import copy_runs_reference, unit_runs
from kvwire.movers.triton_pages import PageCopier
from kvwire.movers.triton_units import UnitCopier

NBUF, ROW, SLOTS = 64, 2048, 160


def _time(fn: Any, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def _index(view: Any, pi: Any, ki: Any) -> Any:
    return view[:, pi, ki].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", default="8,64", help="units per chunk")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dev = torch.device("cuda:0")
    rng = np.random.default_rng(0)
    units_mover, pages_mover = UnitCopier(dev), PageCopier(dev)
    report: list[dict[str, Any]] = []
    for page, unit, lo, hi in ((16, 16, 0, ROW), (32, 16, 0, ROW), (32, 1, 512, 1024)):
        per = page // unit
        pool = torch.randint(0, 256, (NBUF, SLOTS, page, ROW), dtype=torch.uint8, device=dev)
        addrs = np.array([pool[b].data_ptr() for b in range(NBUF)], dtype=np.int64)
        whole = hi - lo == ROW
        n, tokens = (unit * ROW, 1) if whole else (hi - lo, unit)
        kw = dict(slot_bytes=page * ROW, per_page=per, unit_bytes=unit * ROW, lo=lo, row=ROW,
                  n=n, tokens=tokens)  # fmt: skip
        for count in [int(x) for x in a.units.split(",")]:
            u = rng.permutation(SLOTS * per)[:count].astype(np.int64)
            size = NBUF * count * tokens * n
            block = torch.zeros(size, dtype=torch.uint8, device=dev)
            units_mover.copy_units(addrs, u, block.data_ptr(), **kw, to_pool=False)
            torch.cuda.synchronize()
            # reference on the host: pool bytes then block bytes in one array, offsets local
            host = pool.cpu().numpy().reshape(-1)
            mem = np.concatenate([host, np.zeros(size, dtype=np.uint8)])
            rel = (addrs - addrs[0]).astype(np.int64)
            copy_runs_reference(mem, *unit_runs(rel, u, host.size, **kw))
            gather_ok = bool(np.array_equal(mem[host.size :], block.cpu().numpy()))
            fresh = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
            block.copy_(fresh)
            other = rng.permutation(SLOTS * per)[:count].astype(np.int64)
            mem = np.concatenate([host, fresh.cpu().numpy()])
            pool_r, blk_r, len_r = unit_runs(rel, other, host.size, **kw)
            copy_runs_reference(mem, blk_r, pool_r, len_r)
            units_mover.copy_units(addrs, other, block.data_ptr(), **kw, to_pool=True)
            torch.cuda.synchronize()
            scatter_ok = bool(np.array_equal(mem[: host.size], pool.cpu().numpy().reshape(-1)))
            t_units = _time(
                partial(units_mover.copy_units, addrs, u, block.data_ptr(), **kw, to_pool=False),
                a.repeat,
            )
            # about the same bytes as whole pages (slices of them): an equal-page chunk
            npages = -(-count * unit // page)
            pages = rng.permutation(SLOTS)[:npages].astype(np.int64)
            pn, pt = (page * ROW, 1) if whole else (hi - lo, page)
            pblock = torch.empty(NBUF * npages * pt * pn, dtype=torch.uint8, device=dev)
            whole_kw = dict(slot_bytes=page * ROW, lo=lo, row=ROW, n=pn, tokens=pt)
            t_pages = _time(
                partial(
                    pages_mover.copy, addrs, pages, pblock.data_ptr(), **whole_kw, to_pool=False
                ),
                a.repeat,
            )
            pi = torch.from_numpy(u // per).to(dev)
            ki = torch.from_numpy(u % per).to(dev)
            view = pool.view(NBUF, SLOTS, per, unit, ROW)[..., lo:hi]
            t_torch = _time(partial(_index, view, pi, ki), a.repeat)
            row = {
                "page": page, "unit": unit, "slice": [lo, hi], "units": count,
                "mib": size / (1 << 20), "gather_ok": gather_ok, "scatter_ok": scatter_ok,
                "unit_mover_us": t_units, "page_mover_us": t_pages, "torch_index_us": t_torch,
                "page_mover_mib": pblock.numel() / (1 << 20),
                "unit_gbps": size / t_units / 1e3,
            }  # fmt: skip
            report.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    assert all(r["gather_ok"] and r["scatter_ok"] for r in report), "a byte was wrong"


if __name__ == "__main__":
    main()
