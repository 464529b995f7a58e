"""What the scheduler half hands the worker half each step, and the params on the wire.

The scheduler process builds one :class:`KVWireMetadata` per step (``build_connector_meta``);
vLLM serialises it to every worker, which acts on it in ``start_load_kv``. The request's
``kv_transfer_params`` carry the room and the bootstrap address from prefill, through the
router, to decode (keys and their validation: :mod:`kvwire_vllm.params`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvwire_vllm.params import (
    BLOCK_SIZE,
    BOOTSTRAP,
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    NUM_TOKENS,
    PROMPT_HASH,
    ROOM,
)

__all__ = [
    "BLOCK_SIZE",
    "BOOTSTRAP",
    "DO_REMOTE_DECODE",
    "DO_REMOTE_PREFILL",
    "NUM_TOKENS",
    "PROMPT_HASH",
    "ROOM",
    "FailSpec",
    "KVWireMetadata",
    "RecvSpec",
    "SendSpec",
]


@dataclass(frozen=True)
class SendSpec:
    """Prefill: push the KV of a finished request (its first blocks, covering the prompt)."""

    req_id: str
    room: int
    block_ids: list[int]


@dataclass(frozen=True)
class RecvSpec:
    """Decode: receive a request's KV into ``block_ids`` (the blocks after the
    ``cached_blocks`` this instance already holds). ``report=False``: nothing to wait for in
    the scheduler (only tells prefill it may free its blocks)."""

    req_id: str
    room: int
    bootstrap_addr: str
    block_ids: list[int]
    cached_blocks: int
    report: bool = True


@dataclass(frozen=True)
class FailSpec:
    """Decode: a request whose KV load the scheduler refused (bad params, another prompt's
    KV): the workers report it failed at once, with ``block_ids`` as load errors, and vLLM's
    ``kv_load_failure_policy`` fails or recomputes it."""

    req_id: str
    reason: str
    block_ids: list[int]


@dataclass
class KVWireMetadata(KVConnectorMetadata):
    """One step's work for the worker half (scheduler -> every worker)."""

    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    #: Decode: requests finished (aborted) while their KV was still arriving.
    aborts: list[str] = field(default_factory=list)
    #: Decode: loads refused by the scheduler (reported failed by the workers).
    fails: list[FailSpec] = field(default_factory=list)

    def empty(self) -> bool:
        """Whether there is nothing to do this step."""
        return not (self.sends or self.recvs or self.aborts or self.fails)
