"""A prefill and a decode "vLLM instance" in two processes, driving ``KVWireConnector``.

Each process plays one instance the way vLLM's engine core and a worker use a KV connector,
with vLLM's own classes wherever they construct on CPU:

* ``VllmConfig`` + ``KVTransferConfig`` (``kv_connector_module_path="kvwire_vllm.connector"``)
  and ``KVConnectorFactory.create_connector`` build both halves of the connector;
* a ``KVCacheConfig`` of ``FullAttentionSpec`` layers; the KV pool is one int8 buffer viewed
  per layer by vLLM's ``create_kv_cache_views`` in the requested ``KVCacheLayout`` (so the
  tensors have vLLM's real shapes and strides), handed to ``register_kv_caches``;
* a ``KVCacheManager`` (block allocation, prefix caching with ``Request`` block hashes),
  ``Request`` / ``SamplingParams`` carrying ``kv_transfer_params``, ``KVConnectorOutput``.

What stands in for vLLM's ``Scheduler`` and model runner is :class:`Engine`: it calls the
connector hooks in the order vLLM's scheduler and ``KVConnectorModelRunnerMixin`` do
(``get_num_new_matched_tokens`` -> ``allocate_slots`` -> ``update_state_after_alloc``;
each step ``build_connector_meta`` -> ``bind_connector_metadata`` -> ``start_load_kv`` ->
``wait_for_save`` -> ``get_transfer_results`` -> ``get_block_ids_with_load_errors`` ->
``update_connector_output``; ``request_finished`` when a request ends), and runs the tiny
GQA model of :mod:`vllm_pd_model` on the KV in the vLLM tensors through the block table.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import numpy as np
from prometheus_client import REGISTRY
from vllm_pd_model import F32, Cache, GQAModel, GQASpec

SPEC = GQASpec()
BLOCK = 4
NUM_BLOCKS = 48
MODEL_LEN = 128


class BlockCache(Cache):
    """One request's K/V in vLLM's per-layer ``[B, H, N, K|V]`` views of every TP rank (rank
    ``r`` holds KV heads ``[r*h, (r+1)*h)``), via its block ids."""

    def __init__(
        self, rank_views: list[list[F32]], block_ids: list[int], block: int = BLOCK
    ) -> None:
        self.rank_views, self.ids = rank_views, np.asarray(block_ids, dtype=np.int64)
        self.block = block
        self.h = SPEC.kv_heads // len(rank_views)

    def write(self, layer: int, pos: int, k: F32, v: F32) -> None:
        d, h = SPEC.head_dim, self.h
        b, t = self.ids[pos // self.block], pos % self.block
        for r, views in enumerate(self.rank_views):
            views[layer][b, :, t, :d] = k[r * h : (r + 1) * h]
            views[layer][b, :, t, d:] = v[r * h : (r + 1) * h]

    def read(self, layer: int, hi: int) -> tuple[F32, F32]:
        pos = np.arange(hi)
        blk, tok = self.ids[pos // self.block], pos % self.block
        rows = np.concatenate([v[layer][blk, :, tok, :] for v in self.rank_views], axis=1)
        d = SPEC.head_dim
        return rows[..., :d], rows[..., d:]


class Engine:
    """One instance (scheduler + ``tp`` workers) with its connector halves and KV pools.

    vLLM's TP process group does not exist in these processes, so the rank a worker
    connector would read from it (``kvwire_vllm.connector._tp_rank``) is patched in while
    that worker's connector is built; everything else is as with real TP workers: one
    connector and one kvwire manager per rank, each over its own pool holding its KV heads,
    and their reports reduced by vLLM's ``KVOutputAggregator``.
    """

    def __init__(
        self, role: str, layout_name: str, extra: dict[str, Any], tp: int = 1, block: int = BLOCK
    ) -> None:
        import torch
        from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheLayout,
            KVCacheTensor,
            create_kv_cache_views,
        )

        import kvwire_vllm.connector as kc
        from kvwire.layout import RankPosition

        self.role = role
        ktc = KVTransferConfig(
            kv_connector="KVWireConnector",
            kv_connector_module_path="kvwire_vllm.connector",
            kv_role="kv_producer" if role == "prefill" else "kv_consumer",
            kv_connector_extra_config=extra,
        )
        self.vllm_config = VllmConfig(
            kv_transfer_config=ktc, cache_config=CacheConfig(block_size=block)
        )
        spec = FullAttentionSpec(
            block_size=block,
            num_kv_heads=SPEC.kv_heads // tp,
            head_size=SPEC.head_dim,
            dtype=torch.float32,
        )
        names = [f"model.layers.{i}.self_attn.attn" for i in range(SPEC.layers)]
        layout = KVCacheLayout[layout_name]
        page = spec.page_size_bytes
        if layout.is_layer_compact:
            tensor = KVCacheTensor(
                size=page * NUM_BLOCKS * len(names),
                layers=names,
                layer_stride=page * NUM_BLOCKS,
                block_stride=page,
            )
        else:
            tensor = KVCacheTensor(
                size=page * NUM_BLOCKS * len(names),
                layers=names,
                layer_stride=page,
                block_stride=page * len(names),
            )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[tensor],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)],
            kv_cache_layout=layout.name,
        )
        self.sched = KVConnectorFactory.create_connector(
            self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config
        )
        self.raws, self.rank_views, self.workers = [], [], []
        real_rank = kc._tp_rank
        for r in range(tp):
            raw = torch.zeros(tensor.size, dtype=torch.int8)
            tviews = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)
            kc._tp_rank = lambda _cfg, r=r: RankPosition(tp_size=tp, tp_rank=r)
            try:
                worker = KVConnectorFactory.create_connector(
                    self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
                )
            finally:
                kc._tp_rank = real_rank
            worker.register_kv_caches(dict(zip(names, tviews, strict=True)))
            self.raws.append(raw)
            self.rank_views.append([t.numpy() for t in tviews])  # same memory, float32
            self.workers.append(worker)
        self.aggregator = KVOutputAggregator(tp)
        init_none_hash(sha256)
        self.block = block
        self.hasher = get_request_block_hasher(block, sha256)
        self.kvm = KVCacheManager(
            self.kv_cache_config,
            max_model_len=MODEL_LEN,
            scheduler_block_size=block,
            hash_block_size=block,
            enable_caching=True,
        )
        self.free0 = self.kvm.block_pool.get_num_free_blocks()
        self.model = GQAModel(SPEC)
        self.requests: dict[str, Any] = {}
        self.waiting: dict[str, dict[str, Any]] = {}  # decode requests waiting for their KV
        self.reports: dict[str, dict[str, Any]] = {}  # what each request saw (for the tests)

    # ------------------------------------------------------------------ helpers
    def _request(self, rid: str, prompt: list[int], params: dict[str, Any], max_tokens: int) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params})
        req = Request(rid, prompt, sp, None, block_hasher=self.hasher)
        self.requests[rid] = req
        return req

    def _cache(self, rid: str) -> BlockCache:
        return BlockCache(self.rank_views, self.kvm.get_block_ids(rid)[0], self.block)

    def _finish(self, req: Any, status: Any) -> tuple[bool, dict[str, Any] | None]:
        req.status = status
        delay, params = self.sched.request_finished(req, self.kvm.get_block_ids(req.request_id)[0])
        if not delay:
            self.kvm.free(req)
        return delay, params

    # ------------------------------------------------------------------ prefill
    def prefill(self, rid: str, prompt: list[int], bad_blocks: bool = False) -> dict[str, Any]:
        """The router's first leg: compute the prompt (prefix cache honoured), finish the
        request after one token, return the kv_transfer_params for decode."""
        from vllm.v1.request import RequestStatus

        req = self._request(rid, prompt, {"do_remote_decode": True}, max_tokens=1)
        blocks, local, *_ = self.kvm.get_computed_blocks(req)
        ext, is_async = self.sched.get_num_new_matched_tokens(req, local)
        assert (ext, is_async) == (0, False), (ext, is_async)
        new = self.kvm.allocate_slots(req, len(prompt) - local, local, blocks)
        assert new is not None, "out of blocks"
        self.sched.update_state_after_alloc(req, self.kvm.get_blocks(rid), 0)
        first = self.model.prefill(self._cache(rid), prompt, start=local)
        req.num_computed_tokens = len(prompt)
        self.kvm.cache_blocks(req, len(prompt))
        req.append_output_token_ids(first)
        delay, params = self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
        if bad_blocks:  # a scheduler bug handing the worker block ids outside the pool
            meta = self.sched.scheduler_half._meta
            s = meta.sends[-1]
            meta.sends[-1] = type(s)(s.req_id, s.room, [NUM_BLOCKS + 3, *s.block_ids[1:]])
        self.reports[rid] = {"delay_free": delay, "local_hit": local}
        return {"params": params, "first": first, "delay_free": delay}

    # ------------------------------------------------------------------ decode
    def decode(
        self,
        rid: str,
        prompt: list[int],
        params: dict[str, Any],
        n: int,
        corrupt: bool = False,
        bad_blocks: bool = False,
    ) -> dict[str, Any]:
        """The router's second leg: admit the request with prefill's params; it waits for
        its KV (``WAITING_FOR_REMOTE_KVS``) and is finished by :meth:`step`."""
        from vllm.v1.request import RequestStatus

        req = self._request(rid, prompt, dict(params), max_tokens=n + 1)
        blocks, local, *_ = self.kvm.get_computed_blocks(req)
        ext, is_async = self.sched.get_num_new_matched_tokens(req, local)
        if not is_async:  # nothing to load: an ordinary local prefill (vLLM's normal path)
            new = self.kvm.allocate_slots(req, len(prompt) + n - local, local, blocks)
            assert new is not None, "out of blocks"
            self.sched.update_state_after_alloc(req, self.kvm.get_blocks(rid), 0)
            cache = self._cache(rid)
            first = self.model.prefill(cache, prompt, start=local)
            tokens = self.model.decode(cache, first, len(prompt), n)
            self.reports[rid] = {
                "local_hit": local,
                "external": 0,
                "async": False,
                "failed": False,
                "tokens": tokens,
            }
            self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
            return {"local_hit": local, "external": 0}
        new = self.kvm.allocate_slots(
            req, 0, local, blocks, num_external_computed_tokens=ext, delay_cache_blocks=is_async
        )
        assert new is not None, "out of blocks"
        self.sched.update_state_after_alloc(req, self.kvm.get_blocks(rid), ext)
        if bad_blocks:
            meta = self.sched.scheduler_half._meta
            r = meta.recvs[-1]
            meta.recvs[-1] = type(r)(
                r.req_id, r.room, r.bootstrap_addr, [-1, *r.block_ids[1:]], r.cached_blocks
            )
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.num_computed_tokens = local + ext
        self.reports[rid] = {"local_hit": local, "external": ext, "async": is_async}
        self.waiting[rid] = {"n": n, "corrupt": corrupt, "t0": time.monotonic()}
        return {"local_hit": local, "external": ext}

    def _loaded(self, rid: str, failed: bool) -> None:
        """The KV arrived (or failed): compute the last prompt token and decode."""
        from vllm.v1.request import RequestStatus

        job = self.waiting.pop(rid)
        req = self.requests[rid]
        rep = self.reports[rid]
        rep["failed"] = failed
        if failed:
            req.status = RequestStatus.FINISHED_ERROR  # kv_load_failure_policy="fail"
            self._finish(req, RequestStatus.FINISHED_ERROR)
            return
        n_prompt = req.num_prompt_tokens
        self.kvm.cache_blocks(req, req.num_computed_tokens)
        ids = self.kvm.get_block_ids(rid)[0]
        if job["corrupt"]:  # negative control: damage what arrived
            rng = np.random.default_rng(7)
            for views in self.rank_views:
                for v in views:
                    v[ids] += rng.standard_normal(v[ids].shape).astype(np.float32)
        req.num_computed_tokens = n_prompt - 1  # a full hit recomputes the last token
        need = n_prompt + job["n"]
        grow = self.kvm.allocate_slots(req, need - req.num_computed_tokens)
        assert grow is not None, "out of blocks"
        cache = self._cache(rid)
        first = self.model.prefill(cache, req.prompt_token_ids, start=n_prompt - 1)
        rep["tokens"] = self.model.decode(cache, first, n_prompt, job["n"])
        self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)

    def abort(self, rid: str) -> dict[str, Any]:
        """The client went away while the request waited for its KV."""
        from vllm.v1.request import RequestStatus

        req = self.requests[rid]
        self.waiting.pop(rid, None)
        delay, _ = self._finish(req, RequestStatus.FINISHED_ABORTED)
        # vLLM's scheduler holds the blocks of a request aborted in WAITING_FOR_REMOTE_KVS
        # until the connector reports it in finished_recving (Scheduler.finish_requests).
        self.reports[rid]["abort_pending"] = True
        return {"delay": delay}

    # ------------------------------------------------------------------ engine step
    def step(self) -> None:
        """One engine step's connector calls, in vLLM's order."""
        from types import SimpleNamespace

        from vllm.v1.outputs import KVConnectorOutput

        meta = self.sched.build_connector_meta(None)
        outputs = []
        for worker in self.workers:  # what each worker's model runner does this step
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.wait_for_save()
            res = worker.get_transfer_results(set())
            bad = worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            kv_out = KVConnectorOutput(
                finished_sending=res.finished_sending,
                finished_recving=res.finished_recving,
                failed_recving=res.failed_recving,
                invalid_block_ids=bad,
            )
            outputs.append(SimpleNamespace(kv_connector_output=kv_out))
        out = self.aggregator.aggregate(outputs).kv_connector_output  # the executor's reduce
        self.sched.update_connector_output(out)
        bad = out.invalid_block_ids
        res = SimpleNamespace(
            finished_sending=out.finished_sending or set(),
            finished_recving=out.finished_recving or set(),
            failed_recving=out.failed_recving,
        )
        for rid in res.finished_sending:
            self.reports.setdefault(rid, {})["sent"] = True
            self.kvm.free(self.requests[rid])
        for rid in res.finished_recving:
            rep = self.reports[rid]
            rep["invalid_blocks"] = sorted(bad)
            if rep.get("abort_pending"):
                rep["abort_reported"] = True
                self.kvm.free(self.requests[rid])
            else:
                self._loaded(rid, rid in res.failed_recving)

    def busy(self) -> bool:
        return bool(self.waiting) or self.sched.has_pending_push_work()

    def status(self) -> dict[str, Any]:
        halves = [w.worker_half for w in self.workers]
        rooms: dict[str, int] = {}
        for wh in halves:
            for k, n in (wh.mgr.room_tables() if wh.mgr else {}).items():
                rooms[k] = rooms.get(k, 0) + n
        return {
            "free_blocks": self.kvm.block_pool.get_num_free_blocks(),
            "free0": self.free0,
            "pending": self.sched.has_pending_push_work(),
            "waiting": sorted(self.waiting),
            "errors": {k: v for wh in halves for k, v in wh.errors.items()},
            "live": sum(len(wh.sends) + len(wh.recvs) for wh in halves),
            "rooms": rooms,
            "backend": halves[0].mgr.backend_name if halves[0].mgr else None,
            "ranks": [wh.rank.tp_rank for wh in halves],
            "reports": self.reports,
            # chunks this process received through a bulk staging ring (every engine's)
            "staged_chunks": REGISTRY.get_sample_value("kvwire_staged_chunks_total") or 0.0,
        }


def serve(conn: Any, role: str, engines: dict[str, dict[str, Any]]) -> None:
    """Process main: build the engines, then run commands and engine steps on one thread
    (as vLLM's engine core does) until told to stop."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        eng = {
            name: Engine(role, e["layout"], e["extra"], e.get("tp", 1), e.get("block", BLOCK))
            for name, e in engines.items()
        }
        conn.send(("ready", {n: e.workers[0].worker_half.pool.summary for n, e in eng.items()}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        if conn.poll(0.001 if any(e.busy() for e in eng.values()) else 0.02):
            name, cmd, kwargs = conn.recv()
            if cmd == "stop":
                for e in eng.values():
                    for w in e.workers:
                        w.shutdown()
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(eng[name], cmd)(**kwargs)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
        for e in eng.values():
            e.step()
