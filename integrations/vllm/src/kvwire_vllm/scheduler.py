"""Scheduler half of the connector (vLLM's engine-core process, scheduler thread).

Push mode, one request, as vLLM's PD router drives it:

1. The router sends the request to **prefill** with ``kv_transfer_params =
   {"do_remote_decode": true}`` and ``max_tokens=1``. Prefill computes the prompt; when the
   request finishes, :meth:`SchedulerHalf.request_finished` picks the next room id
   (:mod:`kvwire_vllm.rooms`), keeps
   the blocks (returns ``True``: vLLM frees them only when the worker reports the request in
   ``finished_sending``), queues a :class:`~kvwire_vllm.metadata.SendSpec` for the workers,
   and returns the params the router forwards to decode: ``do_remote_prefill``, the room,
   the bootstrap address and the prompt length.
2. The router sends the request with those params to **decode**.
   :meth:`get_num_new_matched_tokens` answers "the prompt minus my local prefix hit, loaded
   asynchronously"; vLLM allocates blocks and calls :meth:`update_state_after_alloc`, which
   queues a :class:`~kvwire_vllm.metadata.RecvSpec` with the blocks after the cached prefix.
   Decode's workers then ask prefill's workers (through kvwire) for the KV, prefill's workers
   push it, and decode's workers report the request in ``finished_recving`` (and
   ``failed_recving`` if it failed), after which vLLM schedules it (recomputing the last
   prompt token, as for a full prefix hit).

Bad params never raise here (vLLM would lose its engine): they are validated
(:mod:`kvwire_vllm.params`) and a request whose params cannot be used (malformed, or KV of
another prompt) takes vLLM's load-failure path: :meth:`get_num_new_matched_tokens` still
answers "load asynchronously", :meth:`update_state_after_alloc` queues a
:class:`~kvwire_vllm.metadata.FailSpec`, the workers report the request in
``failed_recving`` at the next step, and vLLM's ``kv_load_failure_policy`` fails it
(``fail``, the default) or computes it locally (``recompute``). The log names the field.

Nothing here touches the network: the workers do (``kvwire_vllm.worker``).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.request import RequestStatus

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError
from kvwire_vllm.config import ConnectorOptions, bootstrap_address
from kvwire_vllm.metadata import (
    BLOCK_SIZE,
    BOOTSTRAP,
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    NUM_TOKENS,
    PROMPT_HASH,
    ROOM,
    FailSpec,
    KVWireMetadata,
    RecvSpec,
    SendSpec,
)
from kvwire_vllm.params import (
    Refusal,
    RemotePrefill,
    prompt_hash,
    read_decode_params,
    read_prefill_request,
)
from kvwire_vllm.rooms import RoomCounter

logger = logging.getLogger(__name__)

#: Finish states after which prefill's KV is complete and worth pushing.
_PUSHABLE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def flat_blocks(block_ids: Any) -> list[int]:
    """The block ids of a request's one KV cache group (vLLM passes a list, or a tuple of one
    list per group to HMA-aware connectors)."""
    if isinstance(block_ids, tuple):
        if len(block_ids) != 1:
            raise ConfigError(
                f"kvwire-vllm moves one KV cache group; this model has {len(block_ids)}"
            )
        block_ids = block_ids[0]
    return list(block_ids)


def _clear_remote_prefill(params: Any) -> None:
    """The load is registered (or refused): a re-entry (preemption) must not repeat it."""
    if isinstance(params, dict):
        params[DO_REMOTE_PREFILL] = False


def _rid(request: Any) -> str:
    return str(getattr(request, "request_id", "?"))


class SchedulerHalf:
    """State of the scheduler-side connector; see the module docstring for the flow.

    Called on vLLM's scheduler thread only (no lock). Every method that reads a request's
    ``kv_transfer_params`` never raises on them.
    """

    def __init__(
        self,
        opts: ConnectorOptions,
        config: KVWireConfig,
        block_size: int,
        is_producer: bool,
        is_consumer: bool,
        room_prefix: int = 0,
    ) -> None:
        self.block_size = block_size
        #: Prefill: issues room ids in order (see :mod:`kvwire_vllm.rooms`).
        self.rooms = RoomCounter(room_prefix)
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.bootstrap_addr = bootstrap_address(opts, config)
        self._meta = KVWireMetadata()
        #: Prefill: requests whose blocks are held until the workers report them sent.
        self.sending: set[str] = set()
        #: Decode: requests whose KV is arriving (reported in finished_recving).
        self.receiving: set[str] = set()
        #: Decode: requests aborted while receiving; vLLM holds their blocks until reported.
        self.aborting: set[str] = set()

    # ---------------------------------------------------------------- decode side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Decode: how many prompt tokens prefill will push beyond the local prefix hit
        (loaded asynchronously), or ``(0, False)`` for requests that are not kvwire remote
        prefills. A kvwire request with unusable params is answered like a good one: its
        load then fails (see the module docstring). Side-effect free (vLLM may call it
        several times per request)."""
        if not self.is_consumer:
            return 0, False
        try:
            if read_decode_params(request.kv_transfer_params) is None:
                return 0, False
            count = int(request.num_prompt_tokens) - int(num_computed_tokens)
        except Exception:  # not a request vLLM would build; nothing to load
            logger.exception("request %s: cannot read it; no KV load", _rid(request))
            return 0, False
        return (count, True) if count > 0 else (0, False)

    def _verdict(self, request: Any, got: RemotePrefill | Refusal) -> RemotePrefill | Refusal:
        """Whether valid params fit this request: its prompt's length and hash (a hash of
        up to a few thousand token ids: once per request, in update_state_after_alloc)."""
        if isinstance(got, Refusal):
            return got
        n = int(request.num_prompt_tokens)
        if got.remote_num_tokens != n:
            return Refusal(
                f"prefill computed {got.remote_num_tokens} prompt tokens "
                f"({NUM_TOKENS}), this request's prompt has {n}",
                got.target,
            )
        ours = prompt_hash(request.prompt_token_ids)
        if got.kvwire_prompt_hash != ours:
            return Refusal(
                f"the KV is of another prompt: prefill's prompt hashes to "
                f"{got.kvwire_prompt_hash} ({PROMPT_HASH}), this request's to {ours} (did the "
                "router pair the wrong prompts?)",
                got.target,
            )
        return got

    def _release(self, rid: str, target: tuple[int, str] | None) -> None:
        """Tell prefill, which holds the request's blocks for us, to free them (an empty
        receive; nothing is reported to vLLM)."""
        if target is not None:
            room, addr = target
            self._meta.recvs.append(RecvSpec(rid, room, addr, [], 0, report=False))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Decode: blocks are allocated for the request; queue the receive for the workers
        (or, for unusable params, the failure). Only the first call per request acts (the
        params' ``do_remote_prefill`` is cleared, as vLLM's own push connector does, so a
        re-entry after preemption does not re-register). Never raises: an unexpected error
        fails the request's load."""
        if not self.is_consumer:
            return
        rid = _rid(request)
        try:
            self._after_alloc(request, rid, blocks, num_external_tokens)
        except Exception as exc:
            logger.exception("request %s: failing its KV load", rid)
            if num_external_tokens > 0:
                self._meta.fails.append(FailSpec(rid, f"{type(exc).__name__}: {exc}", []))
                self.receiving.add(rid)

    def _after_alloc(self, request: Any, rid: str, blocks: Any, num_external: int) -> None:
        params = request.kv_transfer_params
        got = read_decode_params(params)
        if got is None:
            return
        _clear_remote_prefill(params)
        verdict = self._verdict(request, got)
        if num_external <= 0:
            # Nothing to load (a full local hit, or vLLM skipped the load): still tell
            # prefill, which holds the blocks for us, that it may free them.
            if isinstance(verdict, Refusal):
                logger.warning(
                    "request %s: %s (nothing to load: computed here)", rid, verdict.reason
                )
            self._release(rid, verdict.target)
            return
        ids = flat_blocks(blocks.get_block_ids())
        bs = self.block_size
        n = int(request.num_prompt_tokens)
        cached = n - num_external
        first, last = cached // bs, _cdiv(n, bs)
        if isinstance(verdict, RemotePrefill) and len(ids) < last:
            verdict = Refusal(
                f"{len(ids)} blocks allocated for a {n}-token prompt of {last} blocks",
                verdict.target,
            )
        if isinstance(verdict, Refusal):
            logger.error(
                "kvwire-vllm: request %s: refusing its KV: %s (vLLM's kv_load_failure_policy "
                "fails the request or computes it here)",
                rid,
                verdict.reason,
            )
            self._meta.fails.append(FailSpec(rid, verdict.reason, ids[first:last]))
            self.receiving.add(rid)
            self._release(rid, verdict.target)
            return
        room, addr = verdict.target
        self._meta.recvs.append(RecvSpec(rid, room, addr, ids[first:last], first))
        self.receiving.add(rid)

    # ---------------------------------------------------------------- both sides
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Called once per request when it finishes, before vLLM frees its blocks.

        Prefill: for a finished remote-decode request, hold the blocks and return the params
        for decode. Decode: a request aborted while its KV arrives is aborted on the workers
        too (vLLM keeps its blocks until the workers report it: they wait until no prefill
        write is in flight); one aborted before it was scheduled releases prefill's blocks.
        Never raises (an unexpected error: nothing held, no params).
        """
        try:
            return self._finished(request, block_ids)
        except Exception:
            logger.exception("request %s: finishing it in the connector", _rid(request))
            return False, None

    def _finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        rid = _rid(request)
        if self.is_consumer:
            got = read_decode_params(params)
            if got is not None:  # never allocated: release prefill's blocks
                _clear_remote_prefill(params)
                self._release(rid, got.target)
                return False, None
            if rid in self.receiving:
                self.receiving.discard(rid)
                self.aborting.add(rid)
                self._meta.aborts.append(rid)
            return False, None
        if not self.is_producer:
            return False, None
        asked = read_prefill_request(params)
        if asked is None:
            return False, None
        if isinstance(asked, Refusal):
            logger.error("kvwire-vllm: request %s: not pushing its KV: %s", rid, asked.reason)
            return False, None
        if not asked.do_remote_decode:
            return False, None
        if request.status not in _PUSHABLE:
            logger.info("request %s finished as %s; nothing to push", rid, request.status)
            return False, None
        num_tokens = int(request.num_prompt_tokens)
        ids = flat_blocks(block_ids)[: _cdiv(num_tokens, self.block_size)]
        if len(ids) * self.block_size < num_tokens:
            logger.error(
                "request %s: %d blocks cannot hold its %d prompt tokens; not pushing",
                rid,
                len(ids),
                num_tokens,
            )
            return False, None
        room = self.rooms.next()
        self._meta.sends.append(SendSpec(rid, room, ids))
        self.sending.add(rid)
        return True, {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            ROOM: room,
            BOOTSTRAP: self.bootstrap_addr,
            NUM_TOKENS: num_tokens,
            BLOCK_SIZE: self.block_size,
            PROMPT_HASH: prompt_hash(request.prompt_token_ids),
        }

    def build_connector_meta(self) -> KVWireMetadata:
        """This step's work for the workers; the queue starts empty again."""
        meta, self._meta = self._meta, KVWireMetadata()
        return meta

    def update_connector_output(
        self, finished_sending: set[str] | None, finished_recving: set[str] | None
    ) -> None:
        """The workers' reports of the last step (already reduced over TP ranks by vLLM)."""
        for rid in finished_sending or ():
            self.sending.discard(rid)
        for rid in finished_recving or ():
            self.receiving.discard(rid)
            self.aborting.discard(rid)

    def has_pending_push_work(self) -> bool:
        """Keep vLLM's engine loop stepping while the workers still owe a report that no
        running request would otherwise wait for (pushes on prefill, aborts on decode)."""
        return bool(self.sending or self.aborting or not self._meta.empty())
