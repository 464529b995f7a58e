"""The head-major mover of bulk staging on a GPU: checked byte for byte, then timed beside
the torch indexed copies it replaces, the token-major movers on the same bytes and a torch
peer copy of the same bytes, one run.

The model of issue 27 (32 layers x K/V = 64 buffers, 128 dims bf16: 256-byte heads) in
head-major pools (slots ``[heads, page, 128]``) built as kvwire layouts and driven through
:class:`kvwire.staging.kernels.KVTensors`, the object bulk staging calls: its fused moves
(:class:`kvwire.movers.staged_moves.HeadMajorMoves`, one launch per gather or scatter)
against the same object with its moves off (torch indexed copies through a transpose, what a
head-major pool used before). Cases: TP 2 -> 2 (decode pages head-major, 4 heads, whole
rows), TP 2 -> 1 (4 of 8 heads), TP 1 -> 8 (1 of 8 heads: one piece per page and head),
decode pages of 32 tokens with units of 16 (whole rows) and of 1 token (4 of 8 heads). It

1. checks every byte of every gathered block against the NumPy reference
   (:func:`kvwire.movers.plan.head_runs` copied by ``copy_runs_reference`` on a host copy)
   and against the indexed copies, and every byte of the pool after a scatter of a fresh
   block into other units (nothing outside the selection changed) against both;
2. times, side by side (medians of ``--repeat``, synchronised; a call is what staging pays:
   host work, launch and the stream's sync): gather and scatter with the head-major mover,
   with the indexed copies, with the token-major page / unit mover on a token-major pool of
   the same geometry (the figure head-major staging should now match), and a torch copy of
   the block's bytes to GPU 1 (GPU 0 when there is one GPU; said in the output). Prints
   ratios: indexed / mover (speed-up), token-major / head-major, mover / peer copy.

    PYTHONPATH=core/src python3 scripts/gpu_headmajor_mover_check.py --json $OUT/hm_mover.json

``--dry`` runs the same code on the CPU with tiny shapes (Triton's interpreter for the mover,
NumPy for the indexed copies): a check of the script, no figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.movers import copy_runs_reference, head_runs
from kvwire.staging.kernels import KVTensors, block_view

MiB = 1 << 20

#: (name, KV heads in the pool, page tokens, unit tokens, first head, end head)
CASES = (
    ("TP 2 -> 2, decode head-major: whole rows", 4, 16, 16, 0, 4),
    ("TP 2 -> 1, decode head-major: 4 of 8 heads", 8, 16, 16, 4, 8),
    ("TP 1 -> 8, prefill head-major: 1 of 8 heads", 8, 16, 16, 3, 4),
    ("decode pages of 32, units of 16: whole rows", 4, 32, 16, 0, 4),
    ("decode pages of 32, units of 1: 4 of 8 heads", 8, 32, 1, 4, 8),
)


class Setup:
    """Sizes and device of a run (the issue-27 model on a GPU, tiny on the CPU)."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.layers, self.dim = (2, 8) if dry else (32, 128)
        self.dev = torch.device("cpu" if dry else "cuda:0")
        self.peer = self.dev
        if not dry and torch.cuda.device_count() > 1:
            self.peer = torch.device("cuda:1")

    def sync(self) -> None:
        if not self.dry:
            for d in {self.dev, self.peer}:
                torch.cuda.synchronize(d)

    def time(self, fn: Any, repeat: int) -> float:
        """Median wall µs of ``fn`` from a synchronised start to its synchronised end."""
        out = []
        for _ in range(repeat):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            out.append(time.perf_counter() - t0)
        return statistics.median(out) * 1e6


def make_pool(s: Setup, heads: int, page: int, slots: int, head_major: bool) -> Any:
    """A stacked pool ``[buffers, slots, ...]`` of random bf16 bits, its layout and
    ``KVTensors`` (fused moves on; on the CPU attached for Triton's interpreter)."""
    model = ModelSpec(num_layers=s.layers, total_kv_heads=heads, head_dim=s.dim,
                      dtype="bfloat16", page_size=page)  # fmt: skip
    inner = (heads, page) if head_major else (page, heads)
    shape = (2 * s.layers, slots, *inner, s.dim)
    big = torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16, device=s.dev)
    if not s.dry:  # (NumPy, the host path's view, has no bfloat16)
        big = big.view(torch.bfloat16)
    views = [big[i] for i in range(shape[0])]
    layout = KVLayout.from_tensors(model, views, RankPosition(), head_major=head_major)
    kv = KVTensors(layout, big)
    s.sync()  # the pool's bytes are written on the default stream; staging uses its own
    if s.dry:
        kv.moves = kv.fused_moves("cpu")
    assert kv.moves is not None, "no fused moves (is Triton installed?)"
    return big, layout, kv


def indexed(layout: Any, big: Any) -> KVTensors:
    """The same pool with its fused moves off: torch indexed copies (NumPy on the CPU)."""
    kv = KVTensors(layout, big)
    kv.moves = None
    return kv


def host_bytes(t: Any) -> Any:
    return t.detach().view(torch.uint8).cpu().numpy().reshape(-1)


def run_case(s: Setup, case: tuple[Any, ...], tokens: int, repeat: int, rng: Any) -> dict:
    name, heads, page, unit, h0, h1 = case
    hb = s.dim * 2
    per = page // unit
    nunits = tokens // unit
    slots = 2 * -(-tokens // page) + 4
    big, layout, kv = make_pool(s, heads, page, slots, True)
    kv_t = indexed(layout, big)
    nbuf = 2 * s.layers
    bufs = np.arange(nbuf, dtype=np.int64)
    lo, hi = h0 * hb, h1 * hb
    units = rng.permutation(slots * per)[:nunits].astype(np.int64)
    other = rng.permutation(slots * per)[:nunits].astype(np.int64)
    shape = (nbuf, nunits, unit, hi - lo)
    size = int(np.prod(shape))
    blk_m = torch.zeros(size, dtype=torch.uint8, device=s.dev)
    blk_t = torch.zeros(size, dtype=torch.uint8, device=s.dev)
    out_m, out_t = block_view(blk_m, 0, shape), block_view(blk_t, 0, shape)
    if s.dry:  # the host path writes NumPy views
        out_m, out_t = out_m.numpy(), out_t.numpy()
    # the reference's geometry, written out (apart from the code under test)
    kw = dict(slot_bytes=heads * page * hb, per_page=per, unit_bytes=unit * hb, lo=h0 * page * hb,
              head_stride=page * hb, token_stride=hb, n=hb, heads=h1 - h0, tokens=unit)  # fmt: skip
    rel = kv.addrs - kv.addrs[0]
    # 1. gather: mover, indexed copies, reference (the blocks' zeroing done first)
    s.sync()
    kv.gather(bufs, units, lo, hi, out_m, unit)
    kv_t.gather(bufs, units, lo, hi, out_t, unit)
    host = host_bytes(big)
    mem = np.concatenate([host, np.zeros(size, dtype=np.uint8)])
    copy_runs_reference(mem, *head_runs(rel, units, host.size, **kw))
    got = host_bytes(blk_m)
    gather_ref = int(np.count_nonzero(mem[host.size :] != got))
    gather_idx = int(np.count_nonzero(host_bytes(blk_t) != got))
    # 2. scatter a fresh block into other units: mover, indexed copies, reference
    fresh = torch.randint(0, 256, (size,), dtype=torch.uint8, device=s.dev)
    blk_m.copy_(fresh)
    before = big.clone()
    s.sync()  # default-stream copies done before a staging stream reads them
    kv_t.scatter(bufs, other, lo, hi, out_m, unit)
    by_index = host_bytes(big)
    big.copy_(before)
    s.sync()
    kv.scatter(bufs, other, lo, hi, out_m, unit)
    s.sync()
    after = host_bytes(big)
    mem = np.concatenate([host_bytes(before), host_bytes(fresh)])
    pool, blk, ln = head_runs(rel, other, host.size, **kw)
    copy_runs_reference(mem, blk, pool, ln)
    scatter_ref = int(np.count_nonzero(mem[: host.size] != after))
    scatter_idx = int(np.count_nonzero(by_index != after))
    changed = int(np.count_nonzero(host_bytes(before) != after))
    # 3. timings
    t = {
        "hm_gather_us": s.time(lambda: kv.gather(bufs, units, lo, hi, out_m, unit), repeat),
        "idx_gather_us": s.time(lambda: kv_t.gather(bufs, units, lo, hi, out_t, unit), repeat),
        "hm_scatter_us": s.time(lambda: kv.scatter(bufs, other, lo, hi, out_m, unit), repeat),
        "idx_scatter_us": s.time(lambda: kv_t.scatter(bufs, other, lo, hi, out_t, unit), repeat),
    }
    _, _, tkv = make_pool(s, heads, page, slots, False)  # token-major, same geometry
    t["tm_gather_us"] = s.time(lambda: tkv.gather(bufs, units, lo, hi, out_t, unit), repeat)
    t["tm_scatter_us"] = s.time(lambda: tkv.scatter(bufs, other, lo, hi, out_t, unit), repeat)
    dst = torch.empty(size, dtype=torch.uint8, device=s.peer)
    t["peer_us"] = s.time(lambda: dst.copy_(blk_m), repeat)
    gb = {k.replace("_us", "_gbps"): size / v / 1e3 for k, v in t.items()}
    return {
        "case": name, "tokens": tokens, "mib": size / MiB, "peer": str(s.peer),
        "gather_bad_vs_reference": gather_ref, "gather_bad_vs_indexed": gather_idx,
        "scatter_bad_vs_reference": scatter_ref, "scatter_bad_vs_indexed": scatter_idx,
        "scatter_changed_bytes": changed, **t, **gb,
        "speedup_gather": t["idx_gather_us"] / t["hm_gather_us"],
        "speedup_scatter": t["idx_scatter_us"] / t["hm_scatter_us"],
        "hm_vs_tm_gather": t["tm_gather_us"] / t["hm_gather_us"],
        "hm_vs_tm_scatter": t["tm_scatter_us"] / t["hm_scatter_us"],
        "gather_vs_peer": t["peer_us"] / t["hm_gather_us"],
        "scatter_vs_peer": t["peer_us"] / t["hm_scatter_us"],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,1024", help="tokens per chunk (8 and 64 pages)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", default="")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes, interpreter")
    a = ap.parse_args()
    if a.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    s = Setup(a.dry)
    counts = [32] if a.dry else [int(x) for x in a.tokens.split(",")]
    repeat = 2 if a.dry else a.repeat
    rng = np.random.default_rng(0)
    device = "cpu (dry run)" if a.dry else torch.cuda.get_device_name(0)
    print(f"head-major mover on {device}; peer copy to {s.peer}")
    print("| case | tokens | MiB | gather us mover / indexed / token-major | scatter us mover / "
          "indexed / token-major | peer us | x indexed (g / s) | x token-major (g / s) | "
          "/ peer (g / s) | bad bytes |")  # fmt: skip
    report = []
    for case in CASES:
        for tokens in counts:
            r = run_case(s, case, tokens, repeat, rng)
            report.append(r)
            bad = sum(r[k] for k in r if k.startswith(("gather_bad", "scatter_bad")))
            print(
                f"| {r['case']} | {tokens} | {r['mib']:.1f} | {r['hm_gather_us']:.0f} / "
                f"{r['idx_gather_us']:.0f} / {r['tm_gather_us']:.0f} | {r['hm_scatter_us']:.0f} / "
                f"{r['idx_scatter_us']:.0f} / {r['tm_scatter_us']:.0f} | {r['peer_us']:.0f} | "
                f"{r['speedup_gather']:.2f} / {r['speedup_scatter']:.2f} | "
                f"{r['hm_vs_tm_gather']:.2f} / {r['hm_vs_tm_scatter']:.2f} | "
                f"{r['gather_vs_peer']:.2f} / {r['scatter_vs_peer']:.2f} | {bad} |",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": device, "peer": str(s.peer), "cases": report}, f, indent=2)
    ok = all(
        r[k] == 0 for r in report for k in r if k.startswith(("gather_bad", "scatter_bad"))
    ) and all(r["scatter_changed_bytes"] > 0 for r in report)
    print("verified: every byte right" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
