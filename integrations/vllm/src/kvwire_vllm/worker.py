"""Worker half of the connector (every vLLM worker process: one per TP rank).

Each worker owns one kvwire :class:`~kvwire.session.KVManager` over its own KV pool, built in
:meth:`WorkerHalf.register_kv_caches`. Per step, on the model runner's thread:

* :meth:`WorkerHalf.start_load_kv` takes the step's :class:`~kvwire_vllm.metadata.KVWireMetadata`:
  prefill opens a ``KVSender`` per finished request; decode opens a ``KVReceiver`` per
  request and sends its destination blocks (``send_metadata``), or aborts one.
* :meth:`WorkerHalf.get_transfer_results` (every step, after the forward pass) advances and
  polls them: a sender whose decode ranks asked (``WaitingForInput``) gets ``init`` and one
  ``send`` of all its blocks; terminal requests are cleared and reported. Nothing here waits on
  the network: kvwire's transfer threads move the bytes.

Failure rules: a failed or aborted receive is reported only once ``writes_quiesced()`` (no
prefill write for it may still land), so vLLM never hands out blocks a late write could
corrupt. With vLLM's ``kv_load_failure_policy="fail"`` (the default) a failed receive is
reported in ``failed_recving`` and all its blocks by :meth:`get_block_ids_with_load_errors` in
the same step. With ``"recompute"`` it is reported as finished, and only the blocks its kvwire
:class:`~kvwire.session.FailureReport` calls missing are load errors: vLLM 0.32 truncates the
request's computed tokens at its first invalid block, keeps (and caches) the blocks before it
and recomputes from there (``Scheduler._update_requests_with_invalid_blocks``). A request
reported in ``failed_recving`` would be recomputed whole (vLLM sets its computed tokens to 0).

A failed send is reported as finished so prefill frees its blocks. A load the
scheduler refused (:class:`~kvwire_vllm.metadata.FailSpec`) and a request that cannot be
opened here (no free aux row, a bad room) fail alone, at the next report: nothing a request
carries raises out of this module into vLLM's model runner.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwire.config import KVWireConfig
from kvwire.layout import RankPosition
from kvwire.session import KVManager, KVPoll, KVReceiver, KVSender, Role
from kvwire_vllm.config import ConnectorOptions
from kvwire_vllm.layout import HeadFacts, PoolDescription, describe_kv_caches
from kvwire_vllm.metadata import FailSpec, KVWireMetadata, RecvSpec, SendSpec
from kvwire_vllm.rooms import IssuedRooms

logger = logging.getLogger(__name__)


@dataclass
class _Send:
    spec: SendSpec
    tx: KVSender
    aux: int
    started: bool = False


@dataclass
class _Recv:
    spec: RecvSpec
    rx: KVReceiver
    aux: int
    aborted: bool = False
    failed: bool = False


@dataclass
class TransferReport:
    """What one step's poll found (the worker side of vLLM's ``KVConnectorTransferResults``)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class WorkerHalf:
    """State of one worker's connector; see the module docstring."""

    def __init__(
        self,
        opts: ConnectorOptions,
        config: KVWireConfig,
        role: Role,
        rank: RankPosition,
        num_blocks: int,
        heads: HeadFacts | None = None,
        room_prefix: int = 0,
        recompute: bool = False,
    ) -> None:
        self.opts = opts
        #: vLLM's kv_load_failure_policy is "recompute": failed loads report missing blocks only.
        self.recompute = recompute
        #: Prefill: the rooms of this instance (decode asking for any other is refused).
        self.room_prefix = room_prefix
        self.heads = heads
        self.config = config
        self.role = role
        self.rank = rank
        self.num_blocks = num_blocks
        self.mgr: KVManager | None = None
        self.pool: PoolDescription | None = None
        self.sends: dict[str, _Send] = {}
        self.recvs: dict[str, _Recv] = {}
        self._free_aux: deque[int] = deque(range(config.control.aux_slots))
        self._load_errors: set[int] = set()
        #: Loads failed before a receiver existed (refused by the scheduler, or not opened
        #: here), and sends not opened here: reported at the next get_transfer_results.
        self._failed_now: dict[str, FailSpec] = {}
        self._sent_now: set[str] = set()
        #: Why requests failed here (request id -> message), newest last; bounded.
        self.errors: dict[str, str] = {}
        #: Failed loads recovered by recompute (request id -> (loaded blocks kept, blocks
        #: recomputed)), newest last; bounded.
        self.recovered: dict[str, tuple[int, int]] = {}

    # ---------------------------------------------------------------- startup
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe the pool and start this rank's kvwire manager (once, at startup).
        Prefill TP rank 0 runs the bootstrap service unless ``bootstrap_addr`` names one;
        the other ranks register with it."""
        self.pool = describe_kv_caches(kv_caches, self.num_blocks, self.rank, self.heads)
        boot = self.opts.bootstrap_addr
        if self.role is Role.PREFILL and boot is None and self.rank.sender_id != 0:
            boot = f"{self.config.control.bootstrap_host}:{self.config.control.bootstrap_port}"
        self.mgr = KVManager(
            self.config,
            self.role,
            self.pool.layout,
            bootstrap_addr=boot if self.role is Role.PREFILL else None,
            room_issuer=IssuedRooms(self.room_prefix) if self.role is Role.PREFILL else None,
        )
        cfg = self.config
        mapper = cfg.index_mapper
        logger.info(
            "kvwire-vllm %s rank tp%d/%d: backend %s, layout %s (kv_pool=%s), mapper %s, "
            "staging %s, bootstrap %s",
            self.role.value,
            self.rank.tp_rank,
            self.rank.tp_size,
            self.mgr.backend_name,
            self.pool.summary,
            self.opts.kv_pool,
            f"{mapper} (per decode peer)" if mapper == "auto" else mapper,
            f"{self.mgr.staging.name} (auto)" if cfg.staging == "auto" else cfg.staging,
            self.mgr.bootstrap_addr if self.role is Role.PREFILL else "per request",
        )

    def _manager(self) -> KVManager:
        if self.mgr is None:
            raise RuntimeError("kvwire-vllm: register_kv_caches was not called on this worker")
        return self.mgr

    def _take_aux(self, req_id: str) -> int:
        if not self._free_aux:
            raise RuntimeError(
                f"request {req_id}: all {self.config.control.aux_slots} kvwire aux rows are in "
                "use; raise control.aux_slots"
            )
        return self._free_aux.popleft()

    def _open_send(self, mgr: KVManager, s: SendSpec) -> None:
        aux = self._take_aux(s.req_id)
        try:
            self.sends[s.req_id] = _Send(s, mgr.sender(s.room), aux)
        except BaseException:
            self._free_aux.append(aux)
            raise

    def _open_recv(self, mgr: KVManager, r: RecvSpec, block_tokens: int) -> None:
        aux = self._take_aux(r.req_id)
        try:
            rx = mgr.receiver(r.room, r.bootstrap_addr)
        except BaseException:
            self._free_aux.append(aux)
            raise
        job = _Recv(r, rx, aux)
        self.recvs[r.req_id] = job
        try:
            job.rx.send_metadata(
                np.asarray(r.block_ids, dtype=np.int64),
                job.aux,
                cached_tokens=r.cached_blocks * block_tokens,
            )
        except Exception as exc:  # bad block ids: kvwire failed the room on both sides
            self._note_error(r.req_id, exc)

    def _note_error(self, req_id: str, exc: BaseException) -> None:
        logger.error("kvwire-vllm: request %s failed: %s", req_id, exc)
        self.errors[req_id] = f"{type(exc).__name__}: {exc}"
        while len(self.errors) > 1024:
            self.errors.pop(next(iter(self.errors)))

    # ---------------------------------------------------------------- per step
    def start_load_kv(self, meta: KVWireMetadata | None) -> None:
        """Open this step's requests (model runner thread, every step)."""
        if meta is None or meta.empty():
            return
        mgr = self._manager()
        # kvwire's page unit in tokens (1 when whole blocks are the unit): decode's cached
        # prefix is told in tokens
        block_tokens = self.pool.layout.model.page_size if self.pool is not None else 1
        for s in meta.sends:
            if s.req_id in self.sends:
                logger.warning("request %s: already sending; ignored", s.req_id)
                continue
            try:
                self._open_send(mgr, s)
            except Exception as exc:  # reported as sent: vLLM frees its blocks
                self._note_error(s.req_id, exc)
                self._sent_now.add(s.req_id)
        for f in meta.fails:
            self._note_error(f.req_id, RuntimeError(f.reason))
            self._failed_now[f.req_id] = f
        for r in meta.recvs:
            if r.req_id in self.recvs:
                logger.warning("request %s: already receiving; ignored", r.req_id)
                continue
            try:
                self._open_recv(mgr, r, block_tokens)
            except Exception as exc:
                self._note_error(r.req_id, exc)
                if r.report:
                    self._failed_now[r.req_id] = FailSpec(r.req_id, str(exc), r.block_ids)
        for rid in meta.aborts:
            live = self.recvs.get(rid)
            # a release (report=False) shares the request id of a load that already failed
            if live is not None and live.spec.report and not live.aborted:
                live.aborted = True
                live.rx.abort()
        self._advance_sends()

    def _advance_sends(self) -> None:
        """Start every send whose decode ranks have asked for the KV."""
        for rid, job in self.sends.items():
            if job.started:
                continue
            status = job.tx.poll()
            if status is KVPoll.Failed:
                job.started = True
            elif status >= KVPoll.WaitingForInput:
                job.started = True
                pages = np.asarray(job.spec.block_ids, dtype=np.int64)
                step = self.opts.push_chunk_blocks or max(len(pages), 1)
                try:
                    job.tx.init(len(pages), job.aux)
                    for start in range(0, max(len(pages), 1), step):
                        last = start + step >= len(pages)
                        job.tx.send(pages[start : start + step], last=last)
                except Exception as exc:  # bad block ids: the room failed on both sides
                    self._note_error(rid, exc)

    def get_transfer_results(self) -> TransferReport:
        """Advance and poll every live request; clear and report the terminal ones."""
        out = TransferReport()
        for rid in self._sent_now:
            out.finished_sending.add(rid)
        self._sent_now.clear()
        for rid, f in self._failed_now.items():
            out.finished_recving.add(rid)
            out.failed_recving.add(rid)
            self._load_errors.update(f.block_ids)
        self._failed_now.clear()
        if self.mgr is None:
            return out
        self._advance_sends()
        for rid, job in list(self.sends.items()):
            status = job.tx.poll()
            if status not in (KVPoll.Success, KVPoll.Failed):
                continue
            if status is KVPoll.Failed:
                self._note_failure(rid, job.tx)
            job.tx.clear()
            self._free_aux.append(job.aux)
            del self.sends[rid]
            out.finished_sending.add(rid)
        for rid, rjob in list(self.recvs.items()):
            status = rjob.rx.poll()
            if status is KVPoll.Failed and not rjob.failed:
                rjob.failed = True
                if not rjob.aborted:
                    self._note_failure(rid, rjob.rx)
            if status is KVPoll.Failed and not rjob.rx.writes_quiesced():
                continue  # a prefill write may still land in these blocks
            if status not in (KVPoll.Success, KVPoll.Failed):
                continue
            rjob.rx.clear()
            self._free_aux.append(rjob.aux)
            del self.recvs[rid]
            if not rjob.spec.report:
                continue
            out.finished_recving.add(rid)
            if status is KVPoll.Failed and not rjob.aborted:
                self._load_failed(rid, rjob, out)
        return out

    def _load_failed(self, rid: str, rjob: _Recv, out: TransferReport) -> None:
        """A receive failed (not aborted) and no write can still land: report its load
        errors. Recompute policy: only the blocks its failure report calls missing, the
        request itself as finished (vLLM keeps the blocks before the first missing one);
        otherwise (or without a usable report) the request as failed with all its blocks."""
        report = rjob.rx.failure_report() if self.recompute else None
        if report is None or not report.groups_landed:
            out.failed_recving.add(rid)
            self._load_errors.update(rjob.spec.block_ids)
            return
        missing = report.missing_slots.tolist()
        self._load_errors.update(missing)
        kept = report.good_prefix_pages
        logger.warning(
            "kvwire-vllm: request %s: KV partly lost (%s): %d of %d blocks landed; vLLM keeps "
            "the first %d (%d tokens with the cached prefix) and recomputes from there",
            rid,
            report.cause,
            int(report.good_pages.size),
            int(report.slots.size),
            kept,
            report.good_prefix_tokens,
        )
        self.recovered[rid] = (kept, len(rjob.spec.block_ids) - kept)
        while len(self.recovered) > 1024:
            self.recovered.pop(next(iter(self.recovered)))

    def _note_failure(self, rid: str, handle: KVSender | KVReceiver) -> None:
        try:
            handle.failure_exception()
        except Exception as exc:
            if rid not in self.errors:
                self._note_error(rid, exc)

    def take_load_errors(self) -> set[int]:
        """Blocks of receives that failed since the last call (reported once)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        """Shut the manager down: live requests fail on both sides."""
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None
