"""KV checksums of GPU pools from a chunk's page form (issue 26 item 1): checked against the
host hasher, then timed beside the row form they replace, one run, one GPU.

The model of issue 27 (32 layers x K/V = 64 buffers, 16-token pages, 8 KV heads x 128 dims
bf16: a page is 2 MiB on an equal-TP rank). For three links, equal TP (whole pages: 64 rows of
32 KiB a page), TP 2 -> 1 and TP 1 -> 2 (head slices: 1,024 rows of 1 KiB a page), source and
destination pools on the GPU, the real mapper, and for each request size it

1. checks the device's page-form sums (``DeviceRowHasher.page_sums``, one launch) on both
   sides -- prefill's source pages keyed by the destination, decode's destination pages --
   against the host hasher's page-form sums over a host copy of the pools and against the
   device's row-form sums (``DeviceRowHasher.sums`` over the mapped rows), every layer bit for
   bit, and that one flipped byte changes its layer's sum only;
2. times, side by side (medians of ``--repeat`` calls, each waiting for its result: what a
   transfer worker or a checker thread pays per chunk), prefill's ``SentSums.chunk`` and
   decode's ``LandedSums.chunk`` from the page form and as rows (the link's page form
   switched off: map the chunk, sum the listed rows), with a fresh page array per call, and
   prints the ratio rows / pages; and the page form's time per call when two threads call at
   once (decode's two checker threads: the hasher's lock is held from a call's upload to its
   wait, so equal to one thread's time means the calls do not overlap).

    python3 scripts/gpu_page_sums_check.py --json $OUT/page_sums.json

``--device cpu`` is a dry run of the same steps on host memory under Triton's interpreter
(set ``TRITON_INTERPRET=1``; tiny model and sizes): it checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvwire.config import KVWireConfig
from kvwire.integrity import RowHasher, mismatched_layers
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.page_form import PageSide
from kvwire.session import checksums
from kvwire.session.checksums import LandedSums, SentSums
from kvwire.session.handshake import build_mapper

MiB = 1 << 20
LINKS = {"TP 1 -> 1": (1, 1, 0, 0), "TP 2 -> 1": (2, 1, 1, 0), "TP 1 -> 2": (1, 2, 0, 1)}


def pools(a: argparse.Namespace, model: ModelSpec, tp: int, rank: int, slots: int) -> Any:
    """A random pool on the device (its layout, flagged VRAM), the same bytes in host memory
    (its layout, DRAM), and what keeps their memory alive (the device buffers first, in the
    layout's order)."""
    heads = model.total_kv_heads // tp
    pos = RankPosition(tp_size=tp, tp_rank=rank)
    if a.device == "cuda":
        import torch

        shape = (slots, model.page_size, heads, model.head_dim)
        bufs = [
            torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16, device="cuda:0").view(
                torch.bfloat16
            )
            for _ in range(2 * model.num_layers)
        ]
        host = [b.cpu() for b in bufs]
        return (
            KVLayout.from_tensors(model, bufs, pos),
            KVLayout.from_tensors(model, host, pos),
            (bufs, host),
        )
    from kvwire.testing.kvfill import make_pool

    layout, arrs = make_pool(model, pos, slots)
    rng = np.random.default_rng(slots + tp + rank)
    for arr in arrs:
        arr.reshape(-1)[:] = rng.integers(-(1 << 31), 1 << 31, arr.size, dtype=np.int32)
    vram = layout.model_copy(
        update={"buffers": tuple(b.model_copy(update={"kind": 1}) for b in layout.buffers)}
    )
    return vram, layout, (arrs,)


def on_host(side: PageSide, dev: KVLayout, host: KVLayout) -> PageSide:
    """``side``'s pairs moved from the device pool's buffers to the host copy's (same offsets)."""
    starts = np.array([b.addr for b in dev.buffers], dtype=np.uint64)
    order = np.argsort(starts)
    at = order[np.searchsorted(starts[order], side.base, side="right") - 1]
    hosts = np.array([b.addr for b in host.buffers], dtype=np.uint64)
    base = side.base - starts[at] + hosts[at]
    return PageSide(base, side.slot, side.row, side.n, side.tokens, side.slots)


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median ms of ``fn()`` (which waits for its own result), after a warm-up call."""
    fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(out)


def two_threads(fn: Callable[[], Any], calls: int) -> None:
    """``calls`` calls of ``fn`` on two threads at once (as decode's two checker threads, or
    two transfer workers, call a link's hasher): per call, against one thread's time, how much
    the hasher's lock (held from a call's upload to its wait) lets them overlap."""
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: fn(), range(calls)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--sizes", default="16,128", help="MiB per chunk on an equal-TP link")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--profile",
        default="",
        help="write a cProfile of each side's calls (TP 1 -> 1, first size) under this folder, "
        "alone and beside a busy Python thread, and print their times",
    )
    a = ap.parse_args()
    from kvwire.integrity_device import DeviceRowHasher

    model = ModelSpec(num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    if a.device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1 (Triton's interpreter)")
        model = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype="int32", page_size=4)
        # the links' hashers run the kernels under the interpreter over host memory
        checksums.hasher_for = lambda layout: DeviceRowHasher(layout, device="cpu")  # type: ignore[assignment]
    page_bytes = (
        2
        * model.num_layers
        * model.page_size
        * model.total_kv_heads
        * (model.head_dim * model.dtype_size)
    )
    sizes = [int(x) for x in a.sizes.split(",")]
    pages_of = {s: max(1, s * MiB // page_bytes) for s in sizes}
    if a.device == "cpu":
        pages_of = {s: 1 + i for i, s in enumerate(sizes)}
    slots = 2 * max(pages_of.values()) + 4
    rng = np.random.default_rng(7)
    rows: list[dict[str, Any]] = []
    print(
        "| link | MiB | rows | side | sums equal | flip caught | rows ms | pages ms | rows/pages "
        "| pages ms, 2 threads |"
    )
    print("|---|---:|---:|---|---|---|---:|---:|---:|---:|")
    for name, (tps, tpd, rs, rd) in LINKS.items():
        src, src_host, keep_s = pools(a, model, tps, rs, slots)
        dst, dst_host, keep_d = pools(a, model, tpd, rd, slots)
        mapper = build_mapper(KVWireConfig(), src, dst)
        sent = SentSums(mapper, src)
        landed = LandedSums(KVWireConfig(), src, dst)
        assert sent.sides is not None and landed.side is not None, name
        s_side, d_side = sent.sides
        host_src, host_dst = RowHasher(src_host), RowHasher(dst_host)
        for mib in sizes:
            n = pages_of[mib]
            sp = rng.permutation(slots)[:n].astype(np.int64)
            dp = rng.permutation(slots)[:n].astype(np.int64)
            si, di = mapper.map_chunk(sp, dp)
            keys = sent.tables.dst[di, 0]
            moved = int(sent.tables.src[si, 1].sum()) / MiB
            # 1. the same sums every way, on both sides
            got_p = sent.chunk(sp, dp)
            want_p = host_src.page_sums(on_host(s_side, src, src_host), sp, d_side, dp)
            rows_p = sent.hasher.sums(sent.tables.src, si, keys)
            got_d = landed.chunk(n, dp, 0, (0, n))
            want_d = host_dst.page_sums(on_host(d_side, dst, dst_host), dp, d_side, dp)
            rows_d = landed.hasher.sums(landed.dst, di, landed.dst[di, 0])
            full = set(range(model.num_layers))
            equal = {
                "prefill": got_p == want_p == rows_p and set(got_p) == full,
                "decode": got_d == want_d == rows_d and set(got_d) == full,
            }
            # one flipped byte of the last pair's first page: its layer only, on each side
            caught = {}

            def prefill(sent: SentSums = sent, sp: Any = sp, dp: Any = dp) -> Any:
                return sent.chunk(sp.copy(), dp)  # a fresh page array: a new chunk

            def decode(landed: LandedSums = landed, n: int = n, dp: Any = dp) -> Any:
                return landed.chunk(n, dp.copy(), 0, (0, n))

            for side, hasher, side_pages, fn, want in (
                ("prefill", sent.hasher, sp, prefill, got_p),
                ("decode", landed.hasher, dp, decode, got_d),
            ):
                form = s_side if side == "prefill" else d_side
                layer = int(hasher._pairs(form)[1][-1])
                addr = int(form.base[-1]) + int(side_pages[0]) * form.slot + form.n - 1
                lay, mem = (src, keep_s[0]) if side == "prefill" else (dst, keep_d[0])
                flip(lay, mem, addr)
                caught[side] = mismatched_layers(want, fn()) == [layer]
                flip(lay, mem, addr)
                caught[side] = caught[side] and fn() == want
            if a.profile and name == "TP 1 -> 1" and mib == sizes[0]:
                profile_sides(a.profile, {"prefill": prefill, "decode": decode}, a.repeat)
            # 2. what each side pays per chunk, page form and rows, side by side
            for side, obj, attr, fn in (
                ("prefill", sent, "sides", prefill),
                ("decode", landed, "side", decode),
            ):
                form = getattr(obj, attr)
                paged = timed(fn, a.repeat)
                two = timed(lambda fn=fn: two_threads(fn, 8), max(1, a.repeat // 4)) / 8
                setattr(obj, attr, None)  # the row path
                listed = timed(fn, a.repeat)
                setattr(obj, attr, form)
                row = {
                    "link": name, "mib": mib, "moved_mib": moved, "rows": int(si.size),
                    "side": side, "sums_equal": equal[side], "flip_caught": caught[side],
                    "rows_ms": listed, "pages_ms": paged, "rows_over_pages": listed / paged,
                    "pages_ms_two_threads": two,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"| {name} | {moved:.3g} | {si.size} | {side} | {equal[side]} | "
                    f"{caught[side]} | {listed:.3f} | {paged:.3f} | {listed / paged:.2f} | "
                    f"{two:.3f} |",
                    flush=True,
                )
        del keep_s, keep_d
    ok = all(r["sums_equal"] and r["flip_caught"] for r in rows)
    if a.json:
        report: dict[str, Any] = {
            "command": "scripts/gpu_page_sums_check.py " + " ".join(sys.argv[1:]),
            "host": platform.node(),
            "device": a.device,
            "cases": rows,
        }
        if a.device == "cuda":
            import torch

            report["gpu"] = torch.cuda.get_device_name(0)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    print("verified" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


def profile_sides(folder: str, fns: dict[str, Callable[[], Any]], repeat: int) -> None:
    """Each side's call: its median time alone and beside a thread that runs Python without
    pause (an engine's scheduler loop holding the GIL between its own waits), then a cProfile
    of ``10 * repeat`` calls beside that thread, its top functions printed and saved."""
    import cProfile
    import io
    import pstats
    import threading

    os.makedirs(folder, exist_ok=True)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(200))

    for side, fn in fns.items():
        alone = timed(fn, repeat)
        t = threading.Thread(target=busy, daemon=True)
        t.start()
        try:
            beside = timed(fn, repeat)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(10 * repeat):
                fn()
            prof.disable()
        finally:
            stop.set()
            t.join()
            stop.clear()
        prof.dump_stats(os.path.join(folder, f"{side}.prof"))
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
        print(f"== {side}: {alone:.3f} ms alone, {beside:.3f} ms beside a busy thread")
        print("\n".join(out.getvalue().splitlines()[:40]))


def flip(layout: KVLayout, memory: list[Any], addr: int) -> None:
    """Flip the top bit of the byte at ``addr``, in the buffer of ``layout`` that holds it
    (``memory``: the buffers' tensors or arrays, in the layout's order)."""
    for region, mem in zip(layout.buffers, memory, strict=True):
        if region.addr <= addr < region.end:
            off = addr - region.addr
            if hasattr(mem, "numpy"):  # a torch tensor (on the GPU)
                flat = mem.view(-1).view(torch_uint8())
                flat[off] ^= 0x80
            else:
                mem.reshape(-1).view(np.uint8)[off] ^= 0x80
            return
    raise AssertionError(f"address {addr:#x} is in no buffer")


def torch_uint8() -> Any:
    import torch

    return torch.uint8


if __name__ == "__main__":
    main()
