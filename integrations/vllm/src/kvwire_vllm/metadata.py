"""What the scheduler half hands the worker half each step, and the params on the wire.

The scheduler process builds one :class:`KVWireMetadata` per step (``build_connector_meta``);
vLLM serialises it to every worker, which acts on it in ``start_load_kv``. The request's
``kv_transfer_params`` carry the room and the bootstrap address from prefill, through the
router, to decode (keys below).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

#: kv_transfer_params keys (prefill's request_finished -> router -> decode's request).
ROOM = "kvwire_room"
BOOTSTRAP = "kvwire_bootstrap_addr"
NUM_TOKENS = "remote_num_tokens"
BLOCK_SIZE = "kvwire_block_size"
#: The router's request to prefill, and what prefill returns for decode (vLLM's own keys).
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"


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


@dataclass
class KVWireMetadata(KVConnectorMetadata):
    """One step's work for the worker half (scheduler -> every worker)."""

    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    #: Decode: requests finished (aborted) while their KV was still arriving.
    aborts: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        """Whether there is nothing to do this step."""
        return not (self.sends or self.recvs or self.aborts)


def params_room(params: dict[str, Any] | None) -> tuple[int, str, int] | None:
    """``(room, bootstrap address, prompt tokens)`` from decode's ``kv_transfer_params``, or
    None when the request is not a kvwire remote prefill."""
    if not params or not params.get(DO_REMOTE_PREFILL) or ROOM not in params:
        return None
    return int(params[ROOM]), str(params[BOOTSTRAP]), int(params[NUM_TOKENS])
