"""A host-pool (HiSparse) request of a hybrid model: the attention KV goes into decode's host
pool (token pages) while the state slots and the sliding window's pages go to decode's group
buffers directly; every byte checked against what prefill computed."""

from __future__ import annotations

import math

import numpy as np

from kvwire.layout import KVLayout, MemoryRegion, ModelSpec, RankPosition
from kvwire.session import KVManager, KVPoll
from kvwire.testing.hybrid import RankPools, ShardedCache, config, instances
from kvwire.testing.hybrid_model import STATES, HybridModel, HybridSpec
from kvwire.testing.pair import wait_for

SPEC = HybridSpec()


def test_host_pool_request_with_state_and_window_groups() -> None:
    prompt = [int(t) for t in np.random.default_rng(11).integers(0, SPEC.vocab, 13)]
    n, ps = len(prompt), SPEC.page_size
    num_pages = math.ceil(n / ps)
    first_wp = max(0, (n - SPEC.window) // ps)
    pre = [RankPools.build(SPEC, 1, 0, 8, 8, 4, draft=False)]
    dec = [RankPools.build(SPEC, 1, 0, 8, 8, 4, draft=False)]
    host_model = ModelSpec(num_layers=2, total_kv_heads=SPEC.kv_heads, head_dim=SPEC.head_dim,
                           dtype="float32", page_size=1)  # fmt: skip
    host = [np.zeros((64, 1, SPEC.kv_heads, SPEC.head_dim), np.float32) for _ in range(4)]
    host_layout = KVLayout.from_tensors(host_model, host, RankPosition())
    p_pages, p_swa = [5, 2, 7, 0], {0: 1, 1: 6, 2: 3, 3: 4}
    d_swa = [2, 5, 0]  # decode's pages for the window's pages first_wp..num_pages-1
    tokens = np.arange(20, 20 + n)  # host pool slots of the request's tokens
    with instances(config(), pre, []) as (pm, _, addr):
        aux = [MemoryRegion.from_tensor(dec[0].aux)]
        decode = KVManager(
            config(), "decode", dec[0].layout, aux_buffers=aux, pools={"host": host_layout}
        )
        try:
            rx = decode.receiver(3, addr)
            rx.init()
            rx.send_metadata(tokens, aux_index=0, pool="host",
                             state_indices={"state": 1, "window": d_swa})  # fmt: skip
            tx = pm[0].sender(3)
            wait_for(lambda: tx.poll() >= KVPoll.WaitingForInput)
            tx.init(num_pages, aux_index=0)
            HybridModel(SPEC).prefill(ShardedCache(pre, p_pages, p_swa, 2), prompt)
            window = [p_swa[p] for p in range(first_wp, num_pages)]
            tx.send(p_pages[:2], last=False)
            tx.send(p_pages[2:], last=True, state_indices={"state": 2, "window": window})
            wait_for(lambda: rx.poll() is KVPoll.Success and tx.poll() is KVPoll.Success)
            rx.clear()
            tx.clear()
        finally:
            decode.close()
    src, dst = pre[0], dec[0]
    for name in STATES:  # state slot 2 on prefill -> slot 1 on decode
        np.testing.assert_array_equal(dst.states[name][1], src.states[name][2])
        assert np.abs(src.states[name][2]).sum() > 0
    for part in (0, 1):  # the window's pages, K and V
        np.testing.assert_array_equal(dst.kv["swa"][part][d_swa], src.kv["swa"][part][window])
    for b, (layer, part) in enumerate([("attn0", 0), ("attn1", 0), ("attn0", 1), ("attn1", 1)]):
        want = src.kv[layer][part][p_pages].reshape(-1, SPEC.kv_heads, SPEC.head_dim)[:n]
        np.testing.assert_array_equal(host[b][tokens, 0], want)
