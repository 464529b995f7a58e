"""Test harness: SGLang-shaped ranks of a hybrid / speculative model driving kvwire-sglang.

The model is kvwire's tiny random-weight hybrid (:mod:`kvwire.testing.hybrid_model`: full
attention, a Mamba-style layer with conv and SSM state, a sliding-window layer, a draft layer),
its per-rank pools :class:`kvwire.testing.hybrid.RankPools` (imported, not copied). Every rank
is its own spawned process and fills SGLang 0.5.23's real ``KVArgs`` from those arrays the way
SGLang's ``_init_kv_manager`` and ``setup_state_kv_args`` fill it:

* ``kv_data_*``: the full-attention pool, ``[K of each layer..., V of each layer...]``, page
  bytes per item; then the draft pool's ``[K, V]`` appended, ``num_draft_entries = 2``.
* ``state_types`` components, each with ``state_data_ptrs/lens/item_lens``,
  ``state_dim_per_tensor``, ``state_slice_outer_counts``, ``state_conv_shard_groups``,
  ``state_layer_ids`` (``append_state_component``'s lists):

  - ``"mamba"`` (``HybridLinearKVPool``/``MambaPool``): tensor-major then layer, the conv
    tensors first (``conv_x``, ``conv_bc``), then the temporal one (``ssm``); one entry per
    Mamba layer of ``[slots, dim, ...]``; dim = the per-rank size of the axis TP splits, 0 for
    the replicated ``conv_bc``; outer count 1; no conv sub-blocks; layer id of the Mamba layer.
  - ``"swa"`` (``SWAKVPool``, mode ``"swa"`` only): the window pool's ``[K, V]``, lists empty.

Mode ``"mamba"`` is what SGLang registers for a Mamba hybrid (the sliding-window layer then
keeps its KV in the full pool, model layers ``attn0, swa, attn1``). Mode ``"swa"`` registers
``["swa", "mamba"]``: SGLang 0.5.23 never builds that pair for one model (``setup_state_kv_args``
takes one branch per pool class), but each component is laid out exactly as SGLang lays it out
alone, and this model needs both caches.

Requests go through ``KvwireKVSender``/``KvwireKVReceiver`` in the order SGLang's scheduler
calls them (decode: ``init``, ``send_metadata(pages, aux, [per-component payloads],
decode_prefix_len)``; prefill: ``poll`` until ``WaitingForInput``, ``init``, one ``send`` per
prefill chunk ending on a page boundary with no state, the last with the rest of the pages
and the per-component ``state_indices``). Each process of one rank builds the pools of its
whole TP group and computes with every head (:class:`~kvwire.testing.hybrid.ShardedCache`);
only its own rank's arrays are registered with kvwire, so decode's tokens depend on exactly the
bytes kvwire moved.

One set of processes serves several :class:`Setup` s (backend, mode, draft facts): a rank
builds a manager per setup on first use, each with its own pools and bootstrap service.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import traceback
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
from sgl_harness import OutOfStep, real_utils_module, wait

from kvwire.testing.hybrid import (
    CORRUPTIONS,
    DecodeView,
    RankPools,
    ShardedCache,
    conv_sections,
)
from kvwire.testing.hybrid_model import HybridModel, HybridSpec

SPEC = HybridSpec()
SLOTS, STATE_SLOTS = 16, 4
MAMBA_LAYER, GDN_LAYER = 1, 2  # model layer ids: attn0 0, mamba 1, gdn 2, swa 3, attn1 4
P_SLOT, D_SLOT = 2, 1  # Mamba pool slots of the request on prefill and decode


@dataclass(frozen=True)
class Setup:
    """One kvwire-sglang configuration served by the rank processes."""

    backend: str = "tcp"
    mode: str = "mamba"  # "mamba": state_types ["mamba"]; "swa": ["swa", "mamba"]
    draft_facts: bool = True  # give the draft's KV heads (heads-sharded draft group)
    port: int = 0  # bootstrap service of this setup


@dataclass
class Request:
    """One request: ``corrupt`` names a :data:`kvwire.testing.hybrid.CORRUPTIONS` entry
    applied on decode after the transfer (negative control)."""

    room: int
    prompt: list[int]
    n_gen: int = 5
    chunk_pages: int = 2
    corrupt: str | None = None


def full_layers(mode: str) -> list[str]:
    """Attention caches in the full KV pool, in model-layer order."""
    return ["attn0", "swa", "attn1"] if mode == "mamba" else ["attn0", "attn1"]


def kv_args(setup: Setup, pools: RankPools, rank: int, prefill: bool) -> Any:
    """SGLang's real ``KVArgs`` of one rank, filled as SGLang 0.5.23 fills it."""
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType

    a = KVArgs()
    a.engine_rank, a.pp_rank, a.system_dp_rank, a.gpu_id = rank, 0, 0, 0
    layers = full_layers(setup.mode)
    kv = [pools.kv[n][0] for n in layers] + [pools.kv[n][1] for n in layers]
    kv += list(pools.kv["draft"])  # draft KV appended (prefill.py _init_kv_manager)
    a.kv_data_ptrs = [b.ctypes.data for b in kv]
    a.kv_data_lens = [b.nbytes for b in kv]
    a.kv_item_lens = [b[0].nbytes for b in kv]
    a.num_draft_entries = 2
    a.kv_cache_dtype_str = "float32"
    a.kv_layout = "nhd"
    a.page_size = SPEC.page_size
    if prefill:  # decode learns the heads from the plugin's engine facts
        a.kv_head_num, a.total_kv_head_num = int(pools.kv_heads.size), SPEC.kv_heads
    a.prefill_start_layer, a.prefill_end_layer = 0, len(layers)
    a.aux_data_ptrs, a.aux_data_lens = [pools.aux.ctypes.data], [pools.aux.nbytes]
    a.aux_item_lens = [pools.aux[0].nbytes]
    for f in ("types", "data_ptrs", "data_lens", "item_lens", "dim_per_tensor"):
        setattr(a, f"state_{f}", [])
    a.state_slice_outer_counts, a.state_conv_shard_groups, a.state_layer_ids = [], [], []
    a.swa_kv_cache_layout = None

    def component(
        st: Any, arrs: list[Any], dims: list[int], layer_ids: list[int], shards: Any = None
    ) -> None:
        a.state_types.append(st)
        a.state_data_ptrs.append([x.ctypes.data for x in arrs])
        a.state_data_lens.append([x.nbytes for x in arrs])
        a.state_item_lens.append([x[0].nbytes for x in arrs])
        a.state_dim_per_tensor.append(dims)
        a.state_slice_outer_counts.append([1] * len(dims))
        a.state_conv_shard_groups.append(shards or [None] * len(dims))
        a.state_layer_ids.append(layer_ids)

    if setup.mode == "swa":
        component(StateType.SWA, list(pools.kv["swa"]), [], [])
        a.swa_kv_cache_layout = "nhd"
    s = pools.states
    k1 = SPEC.conv_k - 1
    dims = [  # the split axis on this rank (heads); conv_bc: replicated (dim 0)
        s["conv_x"][0].size // (k1 * SPEC.mamba_p),
        0,
        s["ssm"][0].size // (SPEC.mamba_p * SPEC.mamba_n),
    ]
    component(StateType.MAMBA, [s["conv_x"], s["conv_bc"], s["ssm"]], dims, [MAMBA_LAYER] * 3)
    # the gated-delta-net layer, as SGLang registers a GDN pool (its own component here: SGLang
    # never has two kinds of linear-attention layers in one model): the conv state's channel
    # axis is the q, k and v blocks, each split across TP (state_conv_shard_groups gives their
    # full channel counts), then the delta-rule state split by v heads
    full = [total * dim for total, dim in conv_sections(SPEC)]
    component(
        StateType.MAMBA,
        [s["conv_qkv"], s["delta"]],
        [  # the split axis on this rank: conv channels, delta v heads
            s["conv_qkv"][0].size // k1,
            s["delta"][0].size // (SPEC.gdn_v_dim * SPEC.gdn_k_dim),
        ],
        [GDN_LAYER] * 2,
        [full, None],
    )
    return a


def facts(setup: Setup, tp: int, pools: RankPools) -> Any:
    """What the plugin's scheduler hook reads for this rank."""
    from kvwire_sglang.facts import EngineFacts

    heads = int(pools.kv_heads.size)
    return EngineFacts(
        attn_tp_size=tp,
        num_layers=len(full_layers(setup.mode)),
        total_kv_heads=SPEC.kv_heads,
        local_kv_heads=heads,
        sliding_window=SPEC.window,
        draft_total_kv_heads=SPEC.kv_heads if setup.draft_facts else None,
        draft_local_kv_heads=heads if setup.draft_facts else None,
    )


def window_start(n: int, prefix: int = 0) -> int:
    """First page of the window SGLang sends (both sides: page-aligned
    ``max(prefix, n - window)``)."""
    return max(prefix, n - SPEC.window) // SPEC.page_size


class Rank:
    """One rank's state for one setup: its TP group's pools, its manager."""

    def __init__(self, setup: Setup, role: str, tp: int, rank: int) -> None:
        from kvwire_sglang.conn import KvwireKVManager
        from kvwire_sglang.facts import engine_facts

        os.environ["KVWIRE_TRANSFER_BACKEND"] = setup.backend  # read by KVWireConfig()
        self.setup, self.role, self.tp, self.rank = setup, role, tp, rank
        self.group = [RankPools.build(SPEC, tp, r, SLOTS, SLOTS, STATE_SLOTS) for r in range(tp)]
        self.mine = self.group[rank]
        self.addr = f"127.0.0.1:{setup.port}"
        server_args = types.SimpleNamespace(
            host="127.0.0.1", disaggregation_bootstrap_port=setup.port
        )
        with engine_facts(facts(setup, tp, self.mine)):
            mode = real_utils_module().DisaggregationMode(role)
            args = kv_args(setup, self.mine, rank, role == "prefill")
            self.mgr = KvwireKVManager(args, mode, server_args, False)

    def tables(self, req: Request, seed: int) -> tuple[list[int], dict[int, int]]:
        """Page table and SWA page table (page -> slot) of the request on this instance."""
        n, ps = len(req.prompt), SPEC.page_size
        total = math.ceil((n + (req.n_gen if self.role == "decode" else 0)) / ps)
        rng = np.random.default_rng(req.room + seed)
        pages = rng.permutation(SLOTS)[:total].tolist()
        if self.setup.mode == "mamba":  # the window layer lives in the full pool
            return pages, dict(enumerate(pages))
        first = 0 if self.role == "prefill" else window_start(n)
        return pages, dict(zip(range(first, total), rng.permutation(SLOTS).tolist(), strict=False))

    def state_indices(self, req: Request, swa: dict[int, int], slot: int) -> list[Any]:
        """SGLang's per-component payloads: window pages of the SWA pool, the Mamba slot."""
        n = len(req.prompt)
        mamba = [np.array([slot], dtype=np.int64)]
        gdn = [np.array([slot], dtype=np.int64)]  # the GDN pool: same slot numbering
        if self.setup.mode == "mamba":
            return [mamba, gdn]
        first, last = window_start(n), math.ceil(n / SPEC.page_size)
        return [np.array([swa[p] for p in range(first, last)], dtype=np.int64), mamba, gdn]

    def describe(self) -> dict[str, Any]:
        """What kvwire-sglang built from ``KVArgs``: backend and ``{group: (kind, sharding,
        total_heads, index)}``."""
        groups = {
            g.name: (g.kind, g.sharding, g.total_heads, g.index) for g in self.mgr.layout.groups
        }
        return {"backend": self.mgr.kv.backend_name, "groups": groups}

    def prefill(self, req: Request) -> dict[str, Any]:
        from sglang.srt.disaggregation.base.conn import KVPoll

        from kvwire_sglang.conn import KvwireKVSender

        for r in self.group:  # a fresh request: empty state slot
            for s in r.states.values():
                s[P_SLOT] = 0
        pages, swa = self.tables(req, 0)
        n, ps = len(req.prompt), SPEC.page_size
        tx = KvwireKVSender(self.mgr, self.addr, req.room)
        wait(tx, (KVPoll.WaitingForInput, KVPoll.Failed))
        tx.init(math.ceil(n / ps), aux_index=5)
        model, cache = HybridModel(SPEC), ShardedCache(self.group, pages, swa, P_SLOT)
        sent, step = 0, req.chunk_pages * ps
        for start in range(0, n, step):
            end = min(n, start + step)
            first = model.prefill(cache, req.prompt[start:end], start)
            last = end == n
            upto = n if last else end - end % ps  # a partial page waits for the next send
            chunk = np.asarray(pages[sent // ps : math.ceil(upto / ps)], dtype=np.int64)
            if last:
                for r in self.group:
                    r.aux[5, 0] = first  # the first output token rides in the aux row
            if tx.should_send_kv_chunk(len(chunk), last):
                tx.send(chunk, self.state_indices(req, swa, P_SLOT) if last else None)
            sent = upto
        status = wait(tx, (KVPoll.Success, KVPoll.Failed))
        out: dict[str, Any] = {
            "status": status,
            "bytes": tx.get_transfer_metric().transfer_total_bytes,
        }
        if status == KVPoll.Failed:
            out["error"] = _failure(tx)
        tx.clear()
        return out

    def decode(self, req: Request) -> dict[str, Any]:
        from sglang.srt.disaggregation.base.conn import KVPoll

        from kvwire_sglang.conn import KvwireKVReceiver

        pages, swa = self.tables(req, 1)
        n = len(req.prompt)
        rx = KvwireKVReceiver(self.mgr, self.addr, req.room)
        rx.init(0)
        dst = np.asarray(pages[: math.ceil(n / SPEC.page_size)], dtype=np.int64)
        rx.send_metadata(dst, 3, self.state_indices(req, swa, D_SLOT), decode_prefix_len=0)
        status = wait(rx, (KVPoll.Success, KVPoll.Failed))
        if status != KVPoll.Success:
            error = _failure(rx)
            rx.clear()
            return {"status": status, "error": error}
        if req.corrupt is not None:
            CORRUPTIONS[req.corrupt](DecodeView(self.group, pages, swa, D_SLOT, n))
        first = int(self.mine.aux[3, 0])
        model, cache = HybridModel(SPEC), ShardedCache(self.group, pages, swa, D_SLOT)
        tokens = model.decode(cache, first, n, req.n_gen)
        rx.clear()
        return {"status": status, "tokens": tokens}


def _failure(h: Any) -> str:
    try:
        h.failure_exception()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "failed without an exception"


def rank_main(role: str, tp: int, rank: int, conn: Any) -> None:
    """A rank process: serve ``(setup, request)`` until None (a setup's manager on first use)."""
    ranks: dict[Setup, Rank] = {}
    try:
        conn.send(("ok", None))
        while (msg := conn.recv()) is not None:
            setup, req = msg
            try:
                if setup not in ranks:
                    ranks[setup] = Rank(setup, role, tp, rank)
                r = ranks[setup]
                out = r.prefill(req) if role == "prefill" else r.decode(req)
                conn.send(("ok", {**out, **r.describe()}))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        for r in ranks.values():
            r.mgr.close()


class HybridCluster:
    """``prefill_tp`` prefill rank processes and ``decode_tp`` decode rank processes; a
    bootstrap service per setup in this process (SGLang's ``KvwireKVBootstrapServer``)."""

    def __init__(self, prefill_tp: int, decode_tp: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[tuple[Any, Any]] = []
        self.servers: dict[Setup, Any] = {}
        roles = [("prefill", prefill_tp, r) for r in range(prefill_tp)]
        for role, tp, rank in roles + [("decode", decode_tp, r) for r in range(decode_tp)]:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(role, tp, rank, child), daemon=True)
            p.start()
            self.procs.append((p, parent))
        self.n_prefill = prefill_tp
        self.pipes = OutOfStep()
        self.pipes.replies([(c, p) for p, c in self.procs])

    def run(self, setup: Setup, req: Request) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """One request through every rank; returns (prefill results, decode results)."""
        if setup not in self.servers:
            from kvwire_sglang.conn import KvwireKVBootstrapServer

            self.servers[setup] = KvwireKVBootstrapServer("127.0.0.1", setup.port)
        self.pipes.check()
        for _, c in self.procs:
            c.send((setup, req))
        results = self.pipes.replies([(c, p) for p, c in self.procs])
        return results[: self.n_prefill], results[self.n_prefill :]

    def close(self) -> None:
        for p, c in self.procs:
            with contextlib.suppress(OSError):
                c.send(None)
            p.join(20)
            if p.is_alive():
                p.kill()
        for s in self.servers.values():
            s.close()
