"""Buffer-group checksums on a GPU (protocol 1.14, issue 26 item 1): a gated-delta-net-like
state group in GPU memory (36 layers, 32 heads of 128 x 128 fp32: 2 MiB a slot and layer,
72 MiB a request), summed by prefill's :class:`~kvwire.session.group_sums.SentGroupSums`
(the device hasher) and checked against the host hasher over a host copy of the same bytes,
every (group, layer) key bit for bit; one flipped byte changes one key; then timed: the sums
of one request's group rows (median of ``--repeat``) beside a device copy of the same bytes.

    python3 scripts/gpu_group_sums_check.py --json $OUT/group_sums.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvwire.descriptors import ADDR
from kvwire.index.groups import GroupMapper
from kvwire.integrity import RowHasher, mismatched_layers
from kvwire.layout import BufferGroup, KVLayout, MemoryRegion, ModelSpec, RankPosition
from kvwire.session.group_sums import GroupBuffers, SentGroupSums

LAYERS, HEADS, ELEMS, SLOTS = 36, 32, 128 * 128, 6
MODEL = ModelSpec(num_layers=1, total_kv_heads=1, head_dim=64, dtype="bfloat16", page_size=16)


def layout(device: str, seed: int) -> tuple[KVLayout, list[Any]]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    states = [
        torch.randn((SLOTS, 1, HEADS, ELEMS), generator=gen).to(device) for _ in range(LAYERS)
    ]
    kv = [torch.zeros((4, 16, 1, 64), dtype=torch.bfloat16, device=device) for _ in range(2)]
    g = BufferGroup(
        name="gdn", kind="state", num_layers=LAYERS, total_heads=HEADS, head_elems=ELEMS,
        dtype="float32", buffers=tuple(MemoryRegion.from_tensor(t) for t in states),
    )  # fmt: skip
    lay = KVLayout.from_tensors(MODEL, kv, RankPosition(), groups=[g], group_tensors=states)
    return lay, states


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dev_lay, dev_states = layout("cuda", 1)
    host_lay, _ = layout("cpu", 1)  # the same values in host memory
    dst_lay, _ = layout("cpu", 2)  # keys: where rows land (the same for both)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0)}
    sent_dev = SentGroupSums(dev_lay, GroupMapper(dev_lay, dst_lay).build_tables())
    gm_host = GroupMapper(host_lay, dst_lay)
    host = RowHasher(GroupBuffers(host_lay))
    tables = gm_host.build_tables()
    slot = {"state": np.array([3])}
    s_rows, d_rows = gm_host.map_request(slot, {"state": np.array([1])})
    want = host.sums(tables.src, s_rows, tables.dst[d_rows, ADDR])
    got = sent_dev.sums(s_rows, d_rows)
    assert type(sent_dev.hasher).__name__ == "DeviceRowHasher", type(sent_dev.hasher)
    assert len(want) == LAYERS and got == want, "device sums differ from the host's"
    flat = dev_states[7].view(torch.uint8).view(-1)
    flat[3 * flat.numel() // SLOTS + 5] ^= 0x10  # slot 3 of layer 7
    torch.cuda.synchronize()
    bad = mismatched_layers(want, sent_dev.sums(s_rows, d_rows))
    assert bad == [GroupBuffers(dev_lay).offsets["gdn"] + 7], bad
    report["checks"] = "device sums equal the host's for every layer; a flip changes layer 7 only"
    nbytes = LAYERS * HEADS * ELEMS * 4
    times = []
    for _ in range(a.repeat):
        t = time.perf_counter()
        sent_dev.sums(s_rows, d_rows)
        times.append(time.perf_counter() - t)
    src = torch.cat([s[3].reshape(-1) for s in dev_states])
    dst = torch.empty_like(src)
    copies = []
    for _ in range(a.repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - t)
    report.update(
        request_mib=nbytes / 2**20,
        sums_ms=statistics.median(times) * 1e3,
        device_copy_ms=statistics.median(copies) * 1e3,
    )
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
