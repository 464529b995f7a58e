"""``KVWireConnector``: vLLM's ``KVConnectorBase_V1`` on top of kvwire (push mode).

Loaded by vLLM from ``--kv-transfer-config``::

    {"kv_connector": "KVWireConnector",
     "kv_connector_module_path": "kvwire_vllm.connector",
     "kv_role": "kv_producer",            # prefill; "kv_consumer" on decode
     "kv_connector_extra_config": {"transfer_backend": "nixl"}}

vLLM builds the class twice per instance: once with ``KVConnectorRole.SCHEDULER`` in the
engine-core process (:class:`~kvwire_vllm.scheduler.SchedulerHalf` does the work) and once
with ``KVConnectorRole.WORKER`` in every worker (:class:`~kvwire_vllm.worker.WorkerHalf`).
Each method below says which half calls it; calling a method of the other half raises.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvwire.errors import ConfigError
from kvwire.layout import RankPosition
from kvwire.session import Role
from kvwire_vllm.config import parse_extra_config
from kvwire_vllm.layout import head_facts
from kvwire_vllm.logs import adopt_vllm_logging
from kvwire_vllm.metadata import KVWireMetadata
from kvwire_vllm.rooms import instance_prefix
from kvwire_vllm.scheduler import SchedulerHalf, flat_blocks
from kvwire_vllm.worker import WorkerHalf

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _tp_rank(vllm_config: Any) -> RankPosition:
    """This worker's TP position (vLLM's TP group when it exists, else rank 0 of 1)."""
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    rank = 0
    if tp > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    return RankPosition(tp_size=tp, tp_rank=rank)


class KVWireConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector that pushes prefill's KV into decode's blocks through kvwire."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        adopt_vllm_logging()  # kvwire's records in vLLM's log, with its format and level
        ktc = self._kv_transfer_config
        if ktc.kv_role not in ("kv_producer", "kv_consumer"):
            raise ConfigError(
                f"kvwire-vllm: kv_role {ktc.kv_role!r} is not supported; use kv_producer on "
                "prefill instances and kv_consumer on decode instances"
            )
        pc = vllm_config.parallel_config
        if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
            raise ConfigError("kvwire-vllm: pipeline parallelism is not supported yet")
        if int(getattr(pc, "data_parallel_size", 1)) > 1:
            raise ConfigError("kvwire-vllm: data parallelism is not supported yet")
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if len(groups) > 1:
            raise ConfigError(
                f"kvwire-vllm moves one KV cache group; this model has {len(groups)} "
                "(hybrid or sliding-window models are not supported yet)"
            )
        self._opts, self._config = parse_extra_config(ktc.kv_connector_extra_config)
        producer = ktc.kv_role == "kv_producer"
        block_size = int(vllm_config.cache_config.block_size)
        # both halves derive the instance's room prefix from the one engine_id they share
        prefix = instance_prefix(str(ktc.engine_id))
        self._sched: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerHalf(
                self._opts, self._config, block_size, producer, not producer, prefix
            )
        else:
            rank = _tp_rank(vllm_config)
            self._worker = WorkerHalf(
                self._opts,
                self._config,
                Role.PREFILL if producer else Role.DECODE,
                rank,
                int(kv_cache_config.num_blocks),
                head_facts(vllm_config, kv_cache_config, self._opts, rank.tp_size),
                room_prefix=prefix,
                recompute=getattr(ktc, "kv_load_failure_policy", "fail") == "recompute",
            )

    # ------------------------------------------------------------------ halves
    @property
    def scheduler_half(self) -> SchedulerHalf:
        """The scheduler half (scheduler role only)."""
        if self._sched is None:
            raise RuntimeError("called a scheduler-side method on a worker connector")
        return self._sched

    @property
    def worker_half(self) -> WorkerHalf:
        """The worker half (worker role only)."""
        if self._worker is None:
            raise RuntimeError("called a worker-side method on a scheduler connector")
        return self._worker

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once after the KV cache is allocated: start this rank's kvwire manager."""
        self.worker_half.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Worker, every step: open the step's sends and receives (never blocks)."""
        meta = self._connector_metadata
        self.worker_half.start_load_kv(meta if isinstance(meta, KVWireMetadata) else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker: nothing to wait for (decode loads whole requests before scheduling them)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Worker: nothing per layer (prefill pushes a request's blocks once it finished)."""

    def wait_for_save(self) -> None:
        """Worker: nothing (pushes run on kvwire's threads; blocks are held until reported)."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Worker, every step: requests whose push or load completed (or failed) here."""
        r = self.worker_half.get_transfer_results()
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=r.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker: the older form of :meth:`get_transfer_results` (sent, received)."""
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step after the transfer results: blocks of failed receives (with
        ``kv_load_failure_policy="recompute"``, only those that did not land whole)."""
        return self.worker_half.take_load_errors()

    def shutdown(self) -> None:
        """Worker: close the kvwire manager (peers learn of it; live requests fail)."""
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Scheduler, decode: prompt tokens prefill pushes, loaded asynchronously."""
        return self.scheduler_half.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Scheduler, decode: the request's blocks exist; queue its receive."""
        self.scheduler_half.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Scheduler, every step: the workers' work for this step."""
        return self.scheduler_half.build_connector_meta()

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler, every step: the workers' reports (reduced over ranks by vLLM)."""
        self.scheduler_half.update_connector_output(
            connector_output.finished_sending, connector_output.finished_recving
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per finished request: prefill holds its blocks and returns the
        params for decode; decode aborts a receive in flight."""
        return self.scheduler_half.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler: :meth:`request_finished` for HMA-aware schedulers (one group only)."""
        return self.scheduler_half.request_finished(request, flat_blocks(block_ids))

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """Scheduler: a load restores the request's own blocks of every transfer group."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def has_pending_push_work(self) -> bool:
        """Scheduler: keep the engine stepping while pushes or aborts are unreported."""
        return self._sched is not None and self._sched.has_pending_push_work()
