"""SGLang's transfer-layer classes (``sglang.srt.disaggregation.base.conn``) over kvwire.

SGLang builds these itself once ``--disaggregation-transfer-backend kvwire`` is selected (see
:mod:`kvwire_sglang.plugin`):

* :class:`KvwireKVBootstrapServer`: prefill instance's main process, once
  (``start_disagg_service``), on ``--disaggregation-bootstrap-port``: kvwire's bootstrap service.
* :class:`KvwireKVManager`: every scheduler process (TP/PP/DP rank), once, from its ``KVArgs``:
  wraps one :class:`kvwire.session.KVManager`. Prefill ranks register with the bootstrap service
  of their instance; decode ranks look up the one each request names.
* :class:`KvwireKVSender`: prefill scheduler thread, per request (``bootstrap_room``);
  :class:`KvwireKVReceiver`: decode scheduler thread, per request.

Calls and their kvwire counterparts (all on the scheduler thread, none blocks on the network):

=============================================  ==============================================
SGLang                                          kvwire
=============================================  ==============================================
``KvwireKVSender(mgr, addr, room)``             ``mgr.sender(room)``
``sender.init(num_kv_indices, aux_index)``      ``tx.init(num_pages, aux_index)``
``sender.send(kv_indices, state_indices)``      ``tx.send(pages, last=..., state_indices={...})``
                                                ``last`` from ``init``'s count and pages sent
``KvwireKVReceiver(mgr, addr, room)``           ``mgr.receiver(room, addr)``
``receiver.init(prefill_dp_rank)``              ``rx.init(prefill_dp_rank)``
``receiver.send_metadata(kv_indices, aux,``     ``rx.send_metadata(pages, aux, state_indices=``
``state_indices, decode_prefix_len)``           ``{...}, cached_tokens=decode_prefix_len)``
``poll()`` / ``failure_exception()``            the same; SGLang's ``KVPoll`` ints equal kvwire's
``clear()`` / ``abort()``                       the same
=============================================  ==============================================

Prefill always sends the whole prompt's pages (``pop_decode_prefix_len`` returns 0): kvwire
skips the pages decode keeps cached itself, from ``decode_prefix_len``. Bad indices or state
payloads fail the request on both sides (``poll()`` -> ``KVPoll.Failed``, ``failure_exception()``
re-raises the error naming the problem) instead of raising into SGLang's scheduler loop.

Partial failures: SGLang's decode has no hook to keep part of a failed load and recompute the
rest (a ``KVPoll.Failed`` request is aborted with ``failure_exception()``'s message; its
``submit_prefill_recompute`` re-runs a whole prefill). :meth:`KvwireKVReceiver.failure_report`
returns kvwire's :class:`~kvwire.session.FailureReport` (pages landed and verified, pages
missing, cause), and ``failure_exception()`` appends its summary to the error, so the abort
message says what was lost and why.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic_settings import BaseSettings, SettingsConfigDict
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVTransferMetric,
)

from kvwire.config import KVWireConfig
from kvwire.control.bootstrap_server import BootstrapServer
from kvwire.errors import ConfigError, KVWireError
from kvwire.layout import MemKind
from kvwire.session import FailureReport, KVManager, KVPoll, KVReceiver, KVSender, Role
from kvwire_sglang.facts import current_facts
from kvwire_sglang.layout import build_layout

logger = logging.getLogger(__name__)


class SGLangOptions(BaseSettings):
    """kvwire-sglang's own settings (SGLang's CLI is fixed): environment ``KVWIRE_SGLANG_*``.
    kvwire's settings (``KVWIRE_TRANSFER_BACKEND``, ``KVWIRE_CONTROL__HOST``, ``KVWIRE_SECRET``,
    ...) are read as usual by :class:`kvwire.config.KVWireConfig`."""

    model_config = SettingsConfigDict(env_prefix="KVWIRE_SGLANG_", extra="forbid")

    #: Where the KV pool, draft and state buffers live ("auto": VRAM when CUDA is available).
    kv_memory: Literal["auto", "vram", "dram"] = "auto"
    #: Where SGLang's metadata (aux) buffers live: host memory unless SGLang put them on GPU
    #: (``SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK``).
    aux_memory: Literal["vram", "dram"] = "dram"
    #: Host prefill ranks use to reach their instance's bootstrap service; default: SGLang's
    #: ``--host`` (127.0.0.1 when it is a wildcard). Set it when ranks run on other nodes.
    bootstrap_host: str | None = None


def _memkind(choice: str) -> MemKind:
    if choice == "auto":
        try:
            import torch

            return MemKind.VRAM if torch.cuda.is_available() else MemKind.DRAM
        except ImportError:  # pragma: no cover - torch comes with SGLang
            return MemKind.DRAM
    return MemKind.VRAM if choice == "vram" else MemKind.DRAM


def _server_value(server_args: Any, name: str, default: Any = None) -> Any:
    """A ServerArgs field, flat or in one of its namespaces (SGLang moved them in 0.5.2x)."""
    if hasattr(server_args, name):
        return getattr(server_args, name)
    for ns in ("disagg", "serving", "parallel"):
        sub = getattr(server_args, ns, None)
        if sub is not None and hasattr(sub, name):
            return getattr(sub, name)
    return default


def _mode(mode: Any) -> Role:
    value = str(getattr(mode, "value", mode)).lower()
    if value not in ("prefill", "decode"):
        raise ConfigError(f"disaggregation_mode {value!r}: kvwire serves 'prefill' or 'decode'")
    return Role(value)


@dataclass(frozen=True)
class PrefillInfo:
    """What SGLang's decode reads from ``kv_manager.prefill_info_table[addr]`` to pick a
    prefill DP rank: kvwire resolves the rank itself, so one entry fits every address."""

    dp_size: int = 1
    follow_bootstrap_room: bool = True


class _PrefillInfoTable:
    def get(self, addr: str, default: Any = None) -> PrefillInfo:
        return PrefillInfo()


class KvwireKVManager(BaseKVManager):  # type: ignore[misc]
    """One rank's kvwire manager, built by SGLang's scheduler from ``KVArgs``.

    With ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1`` on decode, SGLang holds the
    pages of a failed request until :meth:`is_abort_release_safe`: kvwire's write quiescence
    (no prefill write for the request is still in flight), so a late write never lands in pages
    given to another request.
    """

    supports_host_destination = False
    enable_deferred_decode_kv_release = True
    supports_deferred_decode_kv_release = True
    supports_role_switch = False

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.options = SGLangOptions()
        self.role = _mode(disaggregation_mode)
        facts = current_facts()
        self.facts = facts
        layout, aux, self.state_names = build_layout(
            args,
            self.is_mla_backend,
            facts,
            _memkind(self.options.kv_memory),
            _memkind(self.options.aux_memory),
        )
        self.layout = layout
        config = KVWireConfig()
        addr = None
        if self.role is Role.PREFILL:
            addr = self.bootstrap_address(server_args)
        self.kv = KVManager(
            config, self.role, layout, aux_buffers=aux, bootstrap_addr=addr, dp_size=facts.dp_size
        )
        self.prefill_info_table = _PrefillInfoTable()
        self.transfer_infos: dict[int, Any] = {}
        self._receivers: dict[int, KvwireKVReceiver] = {}
        logger.info("kvwire-sglang %s manager up (bootstrap %s)", self.role.value, addr)

    def bootstrap_address(self, server_args: Any) -> str:
        """Prefill: ``host:port`` of this instance's bootstrap service."""
        host = self.options.bootstrap_host or _server_value(server_args, "host", "127.0.0.1")
        if host in (None, "", "0.0.0.0", "::"):
            host = "127.0.0.1"
        port = int(_server_value(server_args, "disaggregation_bootstrap_port", 8998))
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"

    def register_to_bootstrap(self) -> None:
        """kvwire registers every prefill rank when its manager starts; nothing to do."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: kvwire looks prefill up per request, in the background."""
        return True

    def state_map(self, state_indices: Any) -> dict[str, list[int]] | None:
        """SGLang's per-component ``state_indices`` list -> kvwire's ``{index: slots}``."""
        if not self.state_names:
            return None
        out: dict[str, list[int]] = {}
        payloads = list(state_indices) if state_indices is not None else []
        for i, name in enumerate(self.state_names):
            value = payloads[i] if i < len(payloads) else None
            if name is None or value is None:
                continue
            out[name] = np.asarray(value, dtype=np.int64).ravel().tolist()
        return out

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        """Decode: may the pages of failed request ``room`` be reused? (kvwire quiescence)."""
        rx = self._receivers.get(int(room))
        return rx is None or rx.rx.writes_quiesced()

    def clear_deferred_abort_state(self, room: int) -> None:
        """Decode: SGLang released a held request."""
        self._receivers.pop(int(room), None)

    def close(self) -> None:
        """Shut the kvwire manager down (live requests fail on both sides)."""
        self.kv.close()


def _pages(indices: Any) -> NDArray[np.int64]:
    return np.asarray(indices, dtype=np.int64).ravel()


class _Handle:
    """What sender and receiver share: kvwire handle, local failures, polls as ints."""

    _h: KVSender | KVReceiver
    bootstrap_room: int

    def _init_handle(self) -> None:
        self._error: BaseException | None = None
        self._t0 = time.perf_counter()
        self._t_done: float | None = None

    def _guard(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run a kvwire call; a refused input fails the request instead of the scheduler."""
        try:
            fn(*args, **kwargs)
        except (KVWireError, ValueError, TypeError) as exc:
            logger.error("room %d: %s refused: %s", self.bootstrap_room, what, exc)
            if self._error is None:
                self._error = exc
            self._h.abort()  # no-op when kvwire already failed the room on both sides

    def poll(self) -> int:
        """Scheduler thread, every step: SGLang's KVPoll value (kvwire's ints are the same)."""
        if self._error is not None:
            return int(KVPoll.Failed)
        status = self._h.poll()
        if status is KVPoll.Success and self._t_done is None:
            self._t_done = time.perf_counter()
        return int(status)

    def failure_exception(self) -> None:
        """Scheduler thread, after ``KVPoll.Failed``: raises why."""
        if self._error is not None:
            raise self._error
        self._h.failure_exception()

    def clear(self) -> None:
        """Scheduler thread, once the request is terminal (every path)."""
        self._h.clear()

    def abort(self) -> None:
        """Scheduler thread: cancel; the peer ranks learn of it."""
        self._h.abort()


class KvwireKVSender(_Handle, BaseKVSender):  # type: ignore[misc]
    """Prefill side of one request. SGLang never says which ``send`` is the last: it is the one
    that completes the ``num_kv_indices`` pages declared in :meth:`init`. When the layout has
    state groups and that chunk carries no ``state_indices``, it is held back until SGLang's
    final ``send`` (with the state and possibly no pages) arrives."""

    def __init__(
        self,
        mgr: KvwireKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self._init_handle()
        self.tx = mgr.kv.sender(self.bootstrap_room)
        self._h = self.tx
        self._num_pages: int | None = None
        self._sent = 0
        self._held: NDArray[np.int64] | None = None

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """Scheduler thread, once bootstrapped: pages of the request on this rank, aux row."""
        if aux_index is None:
            self._guard("init", _raise, ConfigError("init() needs the aux (metadata) index"))
            return
        self._num_pages = int(num_kv_indices)
        self._guard("init", self.tx.init, self._num_pages, int(aux_index))

    def send(
        self,
        kv_indices: Any,
        state_indices: Any = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        """Scheduler thread, after each chunk's forward pass: this chunk's page indices."""
        if self._num_pages is None:
            self._guard("send", _raise, ConfigError("send() before init()"))
            return
        pages = _pages(kv_indices)
        if self._held is not None:
            pages = np.concatenate([self._held, pages])
            self._sent -= len(self._held)
            self._held = None
        last = self._sent + len(pages) >= self._num_pages
        states = self.kv_mgr.state_map(state_indices) if last else None
        if last and state_indices is None and self.kv_mgr.state_names:
            self._held = pages  # the state comes with SGLang's final send
            self._sent += len(pages)
            return
        self._sent += len(pages)
        self._guard("send", self.tx.send, pages, last=last, state_indices=states)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """The final send goes through even without pages: it carries the state and ends the
        request."""
        return num_pages > 0 or last_chunk

    def pop_decode_prefix_len(self) -> int:
        """0: prefill sends every page; kvwire skips the ones decode keeps cached."""
        return 0

    def get_transfer_metric(self) -> KVTransferMetric:
        """Bytes moved and time from creation to success on this rank."""
        m = self.tx.metrics
        latency = None if self._t_done is None else self._t_done - self._t0
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=int(m.bytes))


class KvwireKVReceiver(_Handle, BaseKVReceiver):  # type: ignore[misc]
    """Decode side of one request; ``bootstrap_addr`` is the prefill instance's bootstrap
    service, from the request (``bootstrap_host``/``bootstrap_port``)."""

    require_staging = False

    def __init__(
        self, mgr: KvwireKVManager, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None:
        if bootstrap_room is None:
            raise ConfigError("kvwire needs the request's bootstrap_room")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self._init_handle()
        self.rx = mgr.kv.receiver(self.bootstrap_room, bootstrap_addr)
        self._h = self.rx
        #: SGLang's deferred-release bookkeeping (kvwire tracks quiescence itself).
        self.abort_notified = False
        self.bootstrap_infos: list[Any] = []
        mgr._receivers[self.bootstrap_room] = self

    @property
    def conclude_state(self) -> int | None:
        """``KVPoll.Failed`` once failed, else None (read by SGLang after :meth:`init`)."""
        return int(KVPoll.Failed) if self.poll() == KVPoll.Failed else None

    def init(self, prefill_dp_rank: int = 0) -> None:
        """Scheduler thread, request admitted: start bootstrapping in the background. A DP rank
        of 0 (SGLang's value when it has none) lets kvwire pick ``room % dp_size``."""
        self._guard("init", self.rx.init, int(prefill_dp_rank) or None)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = "device",
        **extra: Any,
    ) -> None:
        """Scheduler thread, pages allocated: this rank's pages for the prompt's tokens after
        ``decode_prefix_len`` (cached here), its aux row and state slots."""
        if (
            str(getattr(destination, "value", destination)) != "device"
            or extra
            or aux_index is None
        ):
            why = f"destination={destination!r}, {sorted(extra)}, aux_index={aux_index}"
            self._guard("send_metadata", _raise, ConfigError(f"unsupported metadata: {why}"))
            return
        self._guard(
            "send_metadata",
            self.rx.send_metadata,
            _pages(kv_indices),
            int(aux_index),
            state_indices=self.kv_mgr.state_map(state_indices),
            cached_tokens=None if decode_prefix_len is None else int(decode_prefix_len),
        )

    def failure_report(self) -> FailureReport | None:
        """Scheduler thread, after ``KVPoll.Failed``: which of this rank's pages landed whole
        (and verified, with checksums) and which are missing, and why (None unless kvwire
        failed the request; see :mod:`kvwire.session.report`)."""
        return self.rx.failure_report()

    def failure_exception(self) -> None:
        """Scheduler thread, after ``KVPoll.Failed``: raises why, with kvwire's failure
        report (pages kept and missing, cause) appended to the message."""
        try:
            super().failure_exception()
        except KVWireError as exc:
            report = self.rx.failure_report()
            if report is None:
                raise
            raise type(exc)(f"{exc} [kvwire failure report: {report.summary()}]") from exc

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        """SGLang's deferred release: kvwire already asks prefill for quiescence."""
        self.abort_notified = True

    def is_abort_release_safe(self) -> bool:
        """Whether no prefill write for this request is still in flight."""
        return self.rx.writes_quiesced()

    def clear(self) -> None:
        super().clear()
        if self.poll() != KVPoll.Failed:
            self.kv_mgr._receivers.pop(self.bootstrap_room, None)


def _raise(exc: BaseException) -> None:
    raise exc


class KvwireKVBootstrapServer(BaseKVBootstrapServer):  # type: ignore[misc]
    """kvwire's bootstrap service on SGLang's ``--host``/``--disaggregation-bootstrap-port``
    (prefill main process). Signed with ``KVWIRE_SECRET`` when set."""

    def __init__(self, host: str, port: int) -> None:
        config = KVWireConfig()
        self.server = BootstrapServer(host or "0.0.0.0", int(port), config.secret_bytes).start()
        logger.info("kvwire bootstrap service for SGLang on %s", self.server.address)

    def close(self) -> None:
        """Stop the service."""
        self.server.stop()
