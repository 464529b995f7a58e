"""The scheduler half of ``KVWireConnector`` in this process, with vLLM's own classes.

``VllmConfig`` + ``KVTransferConfig`` and ``KVConnectorFactory`` build the connector with
``KVConnectorRole.SCHEDULER`` (no worker, no network: the scheduler half only queues work);
a ``KVCacheManager`` allocates blocks; ``Request`` / ``SamplingParams`` carry the
``kv_transfer_params``. :meth:`Rig.admit` calls the hooks in the order vLLM's ``Scheduler``
does for a waiting request (``get_num_new_matched_tokens`` -> ``allocate_slots`` ->
``update_state_after_alloc``), then ``build_connector_meta``; :meth:`Rig.finish` calls
``request_finished`` as ``Scheduler._free_request`` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

BLOCK = 4
NUM_BLOCKS = 256


@dataclass
class Admitted:
    """What the connector answered for one request."""

    request: Any
    #: Prompt tokens found in the local prefix cache.
    local: int
    external: int
    is_async: bool
    meta: Any


class Rig:
    """One instance's scheduler-side connector over vLLM's block manager."""

    def __init__(self, role: str, extra: dict[str, Any] | None = None) -> None:
        # vLLM's platform detection (CUDA/ROCm/...) finds none here: it is a CPU host
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        import torch
        from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )

        ktc = KVTransferConfig(
            kv_connector="KVWireConnector",
            kv_connector_module_path="kvwire_vllm.connector",
            kv_role="kv_producer" if role == "prefill" else "kv_consumer",
            kv_connector_extra_config=extra or {"transfer_backend": "tcp"},
        )
        cfg = VllmConfig(kv_transfer_config=ktc, cache_config=CacheConfig(block_size=BLOCK))
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)
        names = ["model.layers.0.self_attn.attn"]
        page = spec.page_size_bytes
        kcc = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * NUM_BLOCKS, layers=names, layer_stride=page, block_stride=page
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        )
        self.conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kcc)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.kvm = KVCacheManager(
            kcc,
            max_model_len=NUM_BLOCKS * BLOCK,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
        )
        self.free0 = self.kvm.block_pool.get_num_free_blocks()

    def request(self, rid: str, prompt: list[int], params: Any, max_tokens: int = 4) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens)
        req = Request(rid, prompt, sp, None, block_hasher=self.hasher)
        # Set directly, not through SamplingParams.extra_args: vLLM's own checks there (e.g.
        # integers within 64 bits) would stop some hostile values before the connector.
        req.kv_transfer_params = params
        return req

    def admit(self, rid: str, prompt: list[int], params: Any) -> Admitted:
        """A waiting request is scheduled (vLLM's order of connector calls)."""
        req = self.request(rid, prompt, params)
        blocks, local, *_ = self.kvm.get_computed_blocks(req)
        ext, is_async = self.conn.get_num_new_matched_tokens(req, local)
        assert isinstance(ext, int) and isinstance(is_async, bool)
        if is_async:
            new = self.kvm.allocate_slots(
                req, 0, local, blocks, num_external_computed_tokens=ext, delay_cache_blocks=True
            )
        else:
            new = self.kvm.allocate_slots(req, len(prompt) - local, local, blocks)
        assert new is not None, "out of blocks"
        self.conn.update_state_after_alloc(req, self.kvm.get_blocks(rid), ext)
        return Admitted(req, local, ext, is_async, self.conn.build_connector_meta(None))

    def finish(self, req: Any, status: Any) -> tuple[bool, dict[str, Any] | None]:
        """The request ends (``Scheduler._free_request``): the connector may hold its
        blocks; freed here otherwise."""
        req.status = status
        delay, params = self.conn.request_finished(req, self.kvm.get_block_ids(req.request_id)[0])
        if not delay:
            self.kvm.free(req)
        return delay, params

    def release(self, req: Any) -> None:
        """The workers reported the request (sent, or its load ended): free its blocks."""
        self.kvm.free(req)
