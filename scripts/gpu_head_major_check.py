"""GPU check of the bulk staging kernels on head-major pools (CI has no GPU): gather a head
slice of CUDA pages in token order and scatter it into another pool's page order, stacked and
per-buffer tensors, compared with NumPy on the host.

    PYTHONPATH=core/src python3 scripts/gpu_head_major_check.py
"""

from __future__ import annotations

import numpy as np
import torch

from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.staging.kernels import KVTensors


def pool(model: ModelSpec, head_major: bool, stacked: bool) -> tuple[KVLayout, object, list]:
    heads, ps, hd, slots = model.total_kv_heads, model.page_size, model.head_dim, 16
    shape = (slots, heads, ps, hd) if head_major else (slots, ps, heads, hd)
    nbuf = 2 * model.num_layers
    big = torch.randint(0, 1 << 30, (nbuf, *shape), dtype=torch.int32, device="cuda")
    views = [big[i] for i in range(nbuf)]
    layout = KVLayout.from_tensors(model, views, RankPosition(), head_major=head_major)
    return layout, (big if stacked else views), views


def main() -> None:
    model = ModelSpec(num_layers=3, total_kv_heads=4, head_dim=16, dtype="int32", page_size=8)
    hb = model.head_dim * 4
    pages = np.array([5, 1, 9], dtype=np.int64)
    bufs = np.arange(2 * model.num_layers, dtype=np.int64)
    ok = 0
    for src_hm in (False, True):
        for dst_hm in (False, True):
            for stacked in (False, True):
                slay, stens, sviews = pool(model, src_hm, stacked)
                dlay, dtens, dviews = pool(model, dst_hm, stacked)
                src, dst = KVTensors(slay, stens), KVTensors(dlay, dtens)
                lo, hi = 1 * hb, 3 * hb  # heads 1 and 2
                out = torch.zeros((len(bufs), len(pages), model.page_size, hi - lo),
                                  dtype=torch.uint8, device="cuda")  # fmt: skip
                src.gather(bufs, pages, lo, hi, out)
                dst.scatter(bufs, pages, lo, hi, out)
                torch.cuda.synchronize()
                for b in range(len(bufs)):
                    s = sviews[b].cpu().numpy()[pages]
                    d = dviews[b].cpu().numpy()[pages]
                    s = s.transpose(0, 2, 1, 3) if src_hm else s  # token order
                    d = d.transpose(0, 2, 1, 3) if dst_hm else d
                    assert (s[:, :, 1:3] == d[:, :, 1:3]).all(), (src_hm, dst_hm, stacked, b)
                    got = (
                        out[b]
                        .cpu()
                        .numpy()
                        .view(np.int32)
                        .reshape(len(pages), model.page_size, 2, -1)
                    )
                    assert (got == s[:, :, 1:3]).all(), (src_hm, dst_hm, stacked, b)
                ok += 1
    print(f"head-major staging kernels on {torch.cuda.get_device_name()}: {ok} of 8 cases ok")


if __name__ == "__main__":
    main()
