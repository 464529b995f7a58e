"""How SGLang finds kvwire: an entry point in SGLang's general plugin group.

``kvwire-sglang`` declares ``[project.entry-points."sglang.srt.plugins"] kvwire =
"kvwire_sglang.plugin:register"``. SGLang's ``load_plugins()`` calls :func:`register` in every
process (``sglang serve`` / ``launch_server`` before parsing arguments, each scheduler process at
start), then applies the registered hooks. :func:`register`:

1. adds ``kvwire`` to the choices of ``--disaggregation-transfer-backend``
   (``sglang.srt.arg_groups.choices.add_disagg_transfer_backend_choices``);
2. adds a ``KVWIRE = "kvwire"`` member to SGLang's ``TransferBackend`` enum (in place, so every
   module's reference to the enum sees it: the scheduler calls ``TransferBackend("kvwire")``);
3. hooks ``get_kv_class`` (AROUND) so that backend returns kvwire's classes
   (:mod:`kvwire_sglang.conn`) and every other backend the original;
4. hooks both queues' ``_init_kv_manager`` (AROUND) to hand the model and parallel facts that
   ``KVArgs`` lacks (total KV heads, layers, TP/PP/DP sizes) to the manager being built.

``SGLANG_PLUGINS`` (comma-separated entry-point names) restricts which plugins SGLang loads;
keep ``kvwire`` in it when it is set.
"""

from __future__ import annotations

import enum
import importlib
import logging
from collections.abc import Callable
from typing import Any

from kvwire_sglang.facts import EngineFacts, engine_facts

logger = logging.getLogger(__name__)

#: The value operators pass to ``--disaggregation-transfer-backend``.
BACKEND = "kvwire"
MEMBER = "KVWIRE"
UTILS = "sglang.srt.disaggregation.utils"
QUEUES = (
    "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
    "sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager",
)


def extend_transfer_backend(enum_cls: type[enum.Enum]) -> enum.Enum:
    """Add ``KVWIRE = "kvwire"`` to SGLang's ``TransferBackend`` enum in place (idempotent);
    returns the member. In place rather than a replacement class: modules that imported the
    enum, and members already created, stay valid."""
    existing = enum_cls._value2member_map_.get(BACKEND)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = MEMBER
    member._value_ = BACKEND
    enum_cls._member_map_[MEMBER] = member
    enum_cls._value2member_map_[BACKEND] = member
    enum_cls._member_names_.append(MEMBER)
    type.__setattr__(enum_cls, MEMBER, member)
    return member


def kv_classes() -> dict[str, Any]:
    """kvwire's class for each ``KVClassType`` value (KVArgs stays SGLang's own)."""
    from kvwire_sglang import conn

    return {
        "manager": conn.KvwireKVManager,
        "sender": conn.KvwireKVSender,
        "receiver": conn.KvwireKVReceiver,
        "bootstrap_server": conn.KvwireKVBootstrapServer,
    }


def get_kv_class_hook(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """AROUND hook of ``get_kv_class``: kvwire's classes for the kvwire backend."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type)
    kind = str(getattr(class_type, "value", class_type))
    if kind == "kvargs":
        return original(transfer_backend, class_type)
    return kv_classes().get(kind)


def _safe(obj: Any, name: str) -> Any:
    """An attribute, or None (SGLang's runtime context raises for widths not published)."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def facts_from_queue(queue: Any) -> EngineFacts:
    """The facts a queue's scheduler knows (best effort: missing fields stay unknown)."""
    scheduler = getattr(queue, "scheduler", None)
    model = getattr(scheduler, "model_config", None)
    pool = getattr(queue, "token_to_kv_pool", None)
    pool = getattr(pool, "full_kv_pool", pool)
    par: Any = None
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
    except Exception:  # not published (tests) or a version without it
        par = None

    def pick(*values: Any) -> int | None:
        for v in values:
            if isinstance(v, int) and v >= 1:
                return v
        return None

    get_total = getattr(model, "get_total_num_kv_heads", None)
    total = get_total() if callable(get_total) else None
    draft_pool = getattr(queue, "draft_token_to_kv_pool", None)
    draft_total = _draft_total_kv_heads(scheduler) if draft_pool is not None else None
    return EngineFacts(
        attn_tp_size=pick(_safe(par, "attn_tp_size"), getattr(scheduler, "attn_tp_size", None))
        or 1,
        pp_size=pick(_safe(par, "pp_size"), getattr(queue, "pp_size", None)) or 1,
        dp_size=pick(_safe(par, "dp_size")) or 1,
        num_layers=pick(getattr(model, "num_hidden_layers", None)),
        total_kv_heads=pick(total),
        local_kv_heads=pick(getattr(pool, "head_num", None)),
        sliding_window=pick(getattr(scheduler, "sliding_window_size", None)),
        draft_total_kv_heads=pick(draft_total),
        draft_local_kv_heads=pick(getattr(draft_pool, "head_num", None)),
    )


def _draft_total_kv_heads(scheduler: Any) -> Any:
    """KV heads of the whole draft model, from the scheduler's draft worker (best effort: the
    speculative workers of SGLang 0.5.23 name their draft runner differently; None when not
    found, and the draft KV then moves as opaque pages, equal TP only)."""
    worker = _safe(scheduler, "draft_worker")
    for name in ("draft_model_runner", "draft_runner"):
        runner = _safe(worker, name)
        get = getattr(_safe(runner, "model_config"), "get_total_num_kv_heads", None)
        if callable(get):
            try:
                return get()
            except Exception:
                return None
    return None


def init_kv_manager_hook(
    original: Callable[..., Any], queue: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook of the queues' ``_init_kv_manager``: facts for a kvwire manager."""
    if getattr(getattr(queue, "transfer_backend", None), "value", None) != BACKEND:
        return original(queue, *args, **kwargs)
    with engine_facts(facts_from_queue(queue)):
        return original(queue, *args, **kwargs)


def register() -> None:
    """SGLang plugin entry point (``sglang.srt.plugins``): make ``kvwire`` a transfer backend."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    try:
        utils = importlib.import_module(UTILS)
    except ImportError as exc:  # SGLang installed without its serving stack
        logger.warning("kvwire-sglang: %s does not import (%s); backend not registered", UTILS, exc)
        return
    extend_transfer_backend(utils.TransferBackend)
    HookRegistry.register(f"{UTILS}.get_kv_class", get_kv_class_hook, HookType.AROUND)
    for target in QUEUES:
        HookRegistry.register(target, init_kv_manager_hook, HookType.AROUND)
    logger.info("kvwire-sglang: --disaggregation-transfer-backend %s registered", BACKEND)
