"""GPU check and timing of KV checksums over GPU pools (issue 26 item 1).

Run on the GPU machine (two GPUs: the peer copy crosses the link; one: it stays on the GPU):
    PYTHONPATH=core/src python3 scripts/gpu_checksum_bench.py [--json PATH]

The model of issue 27 (32 layers x K/V, 8 KV heads x 128 dims, bf16, 16-token pages: a page
is 64 rows of 32 KiB). For each request size it:
1. checks the device hasher's per-layer sums against the host hasher's over a host copy of
   the same pool (every layer, bit for bit), and that one flipped byte changes its layer's sum;
2. times the device hasher (median of repeats, wall clock around a call on a table already
   described on the device: what a transfer worker pays per chunk) and a torch peer copy of the
   same number of contiguous bytes from GPU 0 to the last GPU (the link's time);
3. prints the checksum time as a share of the peer copy's time: prefill and decode each pay
   one such call per chunk, so twice this share is the added time where the hash is not
   overlapped with the transfer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvwire.descriptors import make_table
from kvwire.integrity import RowHasher
from kvwire.integrity_device import DeviceRowHasher
from kvwire.layout import KVLayout, ModelSpec, RankPosition

MODEL = ModelSpec(num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
PAGE_BYTES = 2 << 20  # all layers, K and V


def rows_of(layout: KVLayout, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows (one per buffer and page) of ``pages`` and a destination key per row."""
    item = layout.buffers[0].item_len
    base = np.array([b.addr for b in layout.buffers], dtype=np.uint64)
    addr = (base[:, None] + pages[None, :].astype(np.uint64) * np.uint64(item)).reshape(-1)
    table = make_table(addr, np.full(addr.size, item, dtype=np.uint64))
    keys = (np.uint64(1 << 44) + np.arange(addr.size, dtype=np.uint64) * np.uint64(item)).astype(
        np.uint64
    )
    return table, keys


def timed(fn: object, repeat: int) -> float:
    """Median seconds of ``fn()`` (which must wait for its own work)."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def breakdown(
    hasher: DeviceRowHasher, table: np.ndarray, keys: np.ndarray, repeat: int
) -> dict[str, float]:
    """Where a call's time goes: the first call on a new table (it describes the table on
    the device, once per link in a transfer), a call per chunk (the table described: indices
    and keys uploaded, launch, wait; what :func:`timed` measures in ``main``), a layer-wise
    group (a layer range selected on the device) and the kernel alone (CUDA events around the
    upload and launch of a call)."""
    idx = np.arange(table.shape[0])
    first = []
    for _ in range(3):
        t = table.copy()  # a new table object: described again
        t0 = time.perf_counter()
        hasher.sums(t, idx, keys)
        first.append(time.perf_counter() - t0)
    hasher.sums(table, idx, keys)
    call = timed(lambda: hasher.sums(table, idx, keys), repeat)
    layers = range(0, MODEL.num_layers // 4)
    group = timed(lambda: hasher.sums(table, idx, keys, layers), repeat)
    info = hasher._described(table)
    n = idx.size
    host = hasher._call_host.numpy()
    host[:n] = idx
    host[n : 2 * n] = keys.view(np.int64)
    stream = hasher._stream
    assert stream is not None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    kernel = []
    for _ in range(repeat):
        with torch.cuda.stream(stream):
            start.record()
            hasher._launch(info, table.shape[0], 2 * n, n, 0, MODEL.num_layers, indexed=True)
            end.record()
        end.synchronize()
        kernel.append(start.elapsed_time(end))
    return {
        "first_call": statistics.median(first) * 1e3,
        "call": call * 1e3,
        "group": group * 1e3,
        "kernel": statistics.median(kernel),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", default="2,16,128,512")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--variants",
        default="1024:4:0,1024:4:1,2048:8:0,2048:8:1,512:4:0,4096:8:1",
        help="kernel variants block:num_warps:inline_weights, timed beside the default",
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.mib.split(",")]
    dev0 = torch.device("cuda", 0)
    dev1 = torch.device("cuda", torch.cuda.device_count() - 1)
    slots = max(sizes) * (1 << 20) // PAGE_BYTES + 8
    shape = (slots, MODEL.page_size, MODEL.total_kv_heads, MODEL.head_dim)
    tensors = [torch.randn(shape, dtype=torch.bfloat16, device=dev0) for _ in range(64)]
    layout = KVLayout.from_tensors(MODEL, tensors, RankPosition())
    hasher = DeviceRowHasher(layout)
    host_t = [t.cpu() for t in tensors]
    host_layout = KVLayout.from_tensors(MODEL, host_t, RankPosition())
    host = RowHasher(host_layout)
    dev_addr = np.array([b.addr for b in layout.buffers], dtype=np.uint64)
    host_addr = np.array([b.addr for b in host_layout.buffers], dtype=np.uint64)
    order = np.argsort(dev_addr)
    results = []
    rng = np.random.default_rng(0)
    print(f"GPU: {torch.cuda.get_device_name(dev0)}; peer copy GPU{dev0.index} -> GPU{dev1.index}")
    for mib in sizes:
        n_pages = mib * (1 << 20) // PAGE_BYTES
        pages = rng.permutation(slots)[:n_pages]
        table, keys = rows_of(layout, pages)
        idx = np.arange(table.shape[0])
        got = hasher.sums(table, idx, keys)
        # the same rows in the host copy: each address moves from its device tensor to the
        # host copy of that tensor, at the same offset
        htable = table.copy()
        ti = order[np.searchsorted(dev_addr[order], htable[:, 0], side="right") - 1]
        htable[:, 0] = htable[:, 0] - dev_addr[ti] + host_addr[ti]
        want = host.sums(htable, idx, keys)
        equal = got == want and len(got) == MODEL.num_layers
        # one flipped byte of layer 7's V at the first page changes layer 7's sum only
        t = tensors[32 + 7]
        flat = t.view(torch.uint8).view(-1)
        at = int(pages[0]) * (t.numel() // slots) * 2 + 100
        flat[at] ^= 0x01
        flipped = hasher.sums(table, idx, keys)
        flat[at] ^= 0x01
        caught = [k for k in got if got[k] != flipped.get(k)] == [7]
        hash_s = timed(lambda t=table, i=idx, k=keys: hasher.sums(t, i, k), args.repeat)
        nbytes = n_pages * PAGE_BYTES
        a = torch.empty(nbytes, dtype=torch.uint8, device=dev0)
        b = torch.empty(nbytes, dtype=torch.uint8, device=dev1)

        def copy(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
            b.copy_(a, non_blocking=True)
            torch.cuda.synchronize(dev0)
            torch.cuda.synchronize(dev1)

        copy()
        copy_s = timed(copy, args.repeat)
        row: dict[str, Any] = {
            "mib": mib,
            "rows": int(table.shape[0]),
            "sums_equal_host": bool(equal),
            "flip_caught_in_its_layer": bool(caught),
            "checksum_ms": hash_s * 1e3,
            "checksum_gbs": nbytes / hash_s / 1e9,
            "peer_copy_ms": copy_s * 1e3,
            "peer_copy_gbs": nbytes / copy_s / 1e9,
            "share_of_peer_copy": hash_s / copy_s,
        }
        row["breakdown_ms"] = breakdown(hasher, table, keys, args.repeat)
        for v in args.variants.split(","):
            blk, warps, inline = (int(x) for x in v.split(":"))
            alt = DeviceRowHasher(layout, block=blk, num_warps=warps, inline_weights=bool(inline))
            same = alt.sums(table, idx, keys) == want
            alt_s = timed(lambda t=table, i=idx, k=keys, h=alt: h.sums(t, i, k), args.repeat)
            row[f"variant {v}"] = {"equal": same, "ms": alt_s * 1e3, "share": alt_s / copy_s}
        results.append(row)
        del a, b
    print(
        f"{'MiB':>5} {'rows':>6} {'equal':>5} {'flip':>5} {'sum ms':>8} {'sum GB/s':>9} "
        f"{'copy ms':>8} {'copy GB/s':>9} {'sum/copy':>8}"
    )
    for r in results:
        print(
            f"{r['mib']:>5} {r['rows']:>6} {r['sums_equal_host']!s:>5} "
            f"{r['flip_caught_in_its_layer']!s:>5} {r['checksum_ms']:>8.3f} "
            f"{r['checksum_gbs']:>9.1f} {r['peer_copy_ms']:>8.3f} {r['peer_copy_gbs']:>9.1f} "
            f"{r['share_of_peer_copy']:>8.3f}"
        )
    print("breakdown ms: first call on a table / a call / a layer group / kernel + upload")
    for r in results:
        b = r["breakdown_ms"]
        print(
            f"{r['mib']:>5} {b['first_call']:.3f} / {b['call']:.3f} / {b['group']:.3f} / "
            f"{b['kernel']:.3f}"
        )
    print("variants (block:warps:inline) ms and share of the peer copy")
    for r in results:
        cells = [
            f"{k[8:]}={v['ms']:.3f}/{v['share']:.2f}{'' if v['equal'] else ' WRONG'}"
            for k, v in r.items()
            if k.startswith("variant ")
        ]
        print(f"{r['mib']:>5} " + " ".join(cells))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev0), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
