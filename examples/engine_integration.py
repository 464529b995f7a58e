"""How an inference engine drives kvwire: one prefill rank and one decode rank.

Run it: ``uv run python examples/engine_integration.py --transfer-backend tcp``.

In production the two managers live in different processes (usually different hosts); here they
share a process so the example is self-contained. Each ``step`` function is what the engine's
scheduler does once per iteration for that request.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvwire.config import add_cli_args, config_from_args
from kvwire.layout import KVLayout, MemoryRegion, ModelSpec, RankPosition
from kvwire.session import KVManager, KVPoll, Role

# --- 1. startup, every rank: describe the KV pool and build a manager -------------------------
MODEL = ModelSpec(num_layers=4, total_kv_heads=8, head_dim=64, dtype="bfloat16", page_size=16)
SLOTS = 128  # page slots per buffer


def kv_pool() -> tuple[KVLayout, list[np.ndarray]]:
    """An engine's paged KV pool: a K and a V buffer per layer, [slots, page, heads, dim].
    (Engines pass their torch tensors; NumPy stands in here. bfloat16 = 2 bytes.)"""
    shape = (SLOTS, MODEL.page_size, MODEL.total_kv_heads, MODEL.head_dim)
    buffers = [np.zeros(shape, dtype=np.uint16) for _ in range(2 * MODEL.num_layers)]
    layout = KVLayout.from_tensors(MODEL, buffers, RankPosition(tp_size=1, tp_rank=0))
    return layout, buffers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_cli_args(parser)  # --transfer-backend, --control-option, ...
    config = config_from_args(parser.parse_args())

    p_layout, p_kv = kv_pool()
    d_layout, d_kv = kv_pool()
    # Aux rows: per-request metadata (here: the first output token), same shape on both sides.
    p_aux, d_aux = np.zeros((64, 16), np.int32), np.zeros((64, 16), np.int32)

    prefill = KVManager(
        config, Role.PREFILL, p_layout, aux_buffers=[MemoryRegion.from_tensor(p_aux)]
    )
    decode = KVManager(config, Role.DECODE, d_layout, aux_buffers=[MemoryRegion.from_tensor(d_aux)])
    bootstrap = prefill.bootstrap_addr  # prefill rank 0 runs the bootstrap service
    assert bootstrap is not None
    try:
        # --- 2. a request arrives; the router gives both sides a room id and the bootstrap address
        room = 0x5EED
        num_pages = 5

        # decode: receiver, allocate destination pages, send metadata (non-blocking)
        receiver = decode.receiver(room, bootstrap)
        receiver.init()
        dst_pages = np.array([40, 41, 7, 99, 3])
        receiver.send_metadata(dst_pages, aux_index=11)

        # prefill: sender; wait (in the scheduler loop) until decode asked for the KV
        sender = prefill.sender(room)
        src_pages = np.array([0, 1, 2, 3, 4])
        while sender.poll() < KVPoll.WaitingForInput:
            time.sleep(0.001)
        sender.init(num_pages, aux_index=3)

        # chunked prefill: after each chunk's forward pass, send its pages (never blocks)
        for k, v in zip(p_kv[: MODEL.num_layers], p_kv[MODEL.num_layers :], strict=True):
            k[src_pages] = 1234  # the forward pass wrote the KV
            v[src_pages] = 5678
        sender.send(src_pages[:3])
        p_aux[3, 0] = 42  # the first output token, before the last chunk
        sender.send(src_pages[3:], last=True)

        # --- 3. both schedulers poll (engines MIN-reduce polls across their TP ranks)
        deadline = time.monotonic() + 30
        while not (receiver.poll() is KVPoll.Success and sender.poll() is KVPoll.Success):
            if KVPoll.Failed in (receiver.poll(), sender.poll()):
                receiver.failure_exception()  # re-raises the original error
                sender.failure_exception()
            if time.monotonic() > deadline:
                raise TimeoutError("transfer did not finish")
            time.sleep(0.001)

        ok = all(
            (d_kv[i][dst_pages] == (1234 if i < MODEL.num_layers else 5678)).all()
            for i in range(2 * MODEL.num_layers)
        )
        ok &= int(d_aux[11, 0]) == 42
        print(
            f"room {room:#x}: {sender.metrics.bytes} bytes in {sender.metrics.descriptors} "
            f"descriptors, decode saw Success; data {'verified' if ok else 'WRONG'}"
        )

        # --- 4. every terminal path ends with clear() on both sides
        receiver.clear()
        sender.clear()
        return 0 if ok else 1
    finally:
        decode.close()
        prefill.close()


if __name__ == "__main__":
    raise SystemExit(main())
