"""GPU check: regions and descriptor tables built from real CUDA tensors.

Run on a machine with a CUDA GPU (the lent device):
    PYTHONPATH=core/src python3 scripts/gpu_region_check.py
Prints a short table last: what was checked and whether it held.
"""

from __future__ import annotations

import numpy as np
import torch

from kvwire.index import EqualTPMapper, HeadSliceMapper
from kvwire.layout import KVLayout, MemKind, ModelSpec, RankPosition


def main() -> None:
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    model = ModelSpec(num_layers=4, total_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    rows: list[tuple[str, bool]] = []

    def pool(tp: int, rank: int) -> tuple[KVLayout, list[torch.Tensor]]:
        heads = model.total_kv_heads // tp
        ts = [torch.zeros(64, 16, heads, 128, dtype=torch.bfloat16, device=dev) for _ in range(8)]
        return KVLayout.from_tensors(model, ts, RankPosition(tp_size=tp, tp_rank=rank)), ts

    src, st = pool(1, 0)
    dst, dt = pool(1, 0)
    r = src.buffers[0]
    rows.append(("region kind is VRAM", r.kind is MemKind.VRAM))
    rows.append((f"region device id is {dev.index}", r.device_id == dev.index))
    rows.append(("region addr == data_ptr", r.addr == st[0].data_ptr()))
    tables = EqualTPMapper(src, dst).build_tables()
    want = np.array([t[s].data_ptr() for t in st for s in range(64)], dtype=np.uint64)
    rows.append(
        ("equal_tp src rows == tensor slot pointers", bool((tables.src[:, 0] == want).all()))
    )
    rows.append(("table device column", bool((tables.src[:, 2] == dev.index).all())))
    # Scatter a real copy through the table addresses with torch, then compare.
    for t in st:
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(torch.bfloat16))
    pages_s, pages_d = np.array([3, 9, 17]), np.array([40, 2, 33])
    si, di = EqualTPMapper(src, dst).map_chunk(pages_s, pages_d)
    n_pairs = len(st)
    ok = True
    for k in range(len(si)):
        b, s_slot = divmod(int(si[k]), 64)
        _, d_slot = divmod(int(di[k]), 64)
        dt[b][d_slot].copy_(st[b][s_slot])
    for b in range(n_pairs):
        ok &= bool(
            torch.equal(
                dt[b][torch.as_tensor(pages_d, device=dev)],
                st[b][torch.as_tensor(pages_s, device=dev)],
            )
        )
    rows.append(("chunk index arrays address the right slots", ok))
    hs_src, _ = pool(2, 1)
    hs_dst, _ = pool(1, 0)
    t2 = HeadSliceMapper(hs_src, hs_dst).build_tables()
    rows.append(
        (
            "head_slice dst offset = 4 heads x 256 B",
            int(t2.dst[0, 0] - hs_dst.buffers[0].addr) == 4 * 256,
        )
    )
    torch.cuda.synchronize()
    print(f"GPU: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    print(f"{'check':<48} result")
    for name, good in rows:
        print(f"{name:<48} {'ok' if good else 'FAILED'}")


if __name__ == "__main__":
    main()
