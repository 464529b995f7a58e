"""Selection: turn a :class:`~kvwire.config.KVWireConfig` into implementations, once.

Options are validated against the implementation's own options model, and the backend's
declared capabilities are checked against what the caller needs, here and only here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from kvwire.backend import TransferBackend
from kvwire.config import AUTO, KVWireConfig, PoolConfig
from kvwire.errors import CapabilityError, ConfigError, KVWireError, PluginError
from kvwire.index.base import IndexMapper
from kvwire.layout import MemKind
from kvwire.plugins import Entry, Kind, PluginRegistry, get_registry
from kvwire.security import enforce_secret_policy
from kvwire.staging.base import StagingStrategy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selected:
    """A resolved implementation class with its validated options."""

    name: str
    cls: type[Any]
    options: BaseModel
    entry: Entry


def validate_options(
    kind: Kind, name: str, cls: type[Any], options: Mapping[str, Any]
) -> BaseModel:
    """Validate ``options`` with ``cls.options_model``; errors name the field and the model."""
    model: type[BaseModel] = cls.options_model
    try:
        return model.model_validate(dict(options))
    except ValidationError as exc:
        fields = ", ".join(sorted(model.model_fields)) or "none"
        raise ConfigError(
            f"invalid options for {kind} {name!r}: {exc.errors(include_url=False)}. "
            f"Accepted options: {fields}"
        ) from exc


def _select(
    kind: Kind, base: type[Any], name: str, options: Mapping[str, Any], registry: PluginRegistry
) -> Selected:
    cls = registry.resolve(kind, name)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        entry = registry.get(kind, name)
        raise PluginError(
            f"{kind} {name!r} from {entry.distribution} resolves to {cls!r}, which is not a "
            f"{base.__name__} subclass"
        )
    return Selected(name, cls, validate_options(kind, name, cls, options), registry.get(kind, name))


def auto_backend_name(registry: PluginRegistry | None = None) -> str:
    """The highest-priority general backend (not ``link_only``) that imports here."""
    reg = registry or get_registry()
    ranked = sorted(reg.entries[Kind.BACKEND].values(), key=lambda e: -e.impl.priority)
    for entry in ranked:
        if entry.impl.link_only:
            continue
        obj, err = reg.try_resolve(Kind.BACKEND, entry.name)
        if obj is not None:
            return entry.name
        logger.info("auto backend: skipping %r: %s", entry.name, err)
    raise PluginError("no usable transfer backend is installed; run `kvwire doctor`")


@dataclass(frozen=True)
class BackendPlan:
    """The backends a rank constructs, in preference order, and why the others are not
    (``{name: reason}``). Built by :func:`plan_backends`; shown by ``kvwire doctor``."""

    selected: list[Selected]
    skipped: dict[str, str]
    #: ``--transfer-backend auto``: each link takes the per-link rule's pick
    #: (:func:`kvwire.link_choice.choose_link_path`), not the list's order.
    auto: bool = False

    @property
    def link_only(self) -> frozenset[str]:
        """The planned backends that serve only some links (``cudaipc``)."""
        return frozenset(s.name for s in self.selected if s.entry.impl.link_only)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.selected]


def plan_backends(
    config: KVWireConfig,
    *,
    need: Iterable[str] = ("write", "notifications"),
    kinds: Iterable[MemKind] = (MemKind.DRAM,),
    registry: PluginRegistry | None = None,
) -> BackendPlan:
    """Resolve ``--transfer-backend`` into the backends this rank would construct.

    * one name: that backend, its options validated and its capabilities checked (errors
      raised, as they always were);
    * a list (``nixl,tcp``): each backend that imports, has the capabilities and whose
      ``rank_problem`` is None, in the listed order; the others are skipped with their reason
      (:class:`ConfigError` naming every reason when none is left);
    * ``auto``: the highest-priority general backend that imports, preceded by every
      ``link_only`` backend (``cudaipc``) usable here.
    """
    reg = registry or get_registry()
    kinds = set(kinds)
    need = tuple(need)
    names = config.backend_list
    selected: list[Selected] = []
    skipped: dict[str, str] = {}
    if names == [AUTO]:
        # the general backend is checked as a named one (its errors raised as before); the
        # link-only ones ahead of it only where usable
        general = _select_one(config, auto_backend_name(reg), need, kinds, reg, strict=True)
        extra = sorted(
            (e for e in reg.entries[Kind.BACKEND].values() if e.impl.link_only),
            key=lambda e: -e.impl.priority,
        )
        for entry in extra:
            try:
                selected.append(_select_one(config, entry.name, need, kinds, reg, strict=False))
            except KVWireError as exc:
                skipped[entry.name] = str(exc)
                logger.info("auto: transfer backend %r is not usable here: %s", entry.name, exc)
        return BackendPlan([*selected, general], skipped, auto=True)
    if len(names) == 1:
        return BackendPlan([_select_one(config, names[0], need, kinds, reg, strict=True)], {})
    for name in names:
        try:
            selected.append(_select_one(config, name, need, kinds, reg, strict=False))
        except KVWireError as exc:
            skipped[name] = str(exc)
            logger.info("transfer backend %r is not usable on this rank: %s", name, exc)
    if not selected:
        raise ConfigError(
            f"none of the transfer backends {config.transfer_backend!r} is usable here: "
            + "; ".join(f"{k}: {v}" for k, v in skipped.items())
            + " (run `kvwire doctor`)"
        )
    _check_shared_options(config, selected, reg)
    return BackendPlan(selected, skipped)


def _select_one(
    config: KVWireConfig,
    name: str,
    need: tuple[str, ...],
    kinds: set[MemKind],
    reg: PluginRegistry,
    *,
    strict: bool,
) -> Selected:
    """One backend of the plan: resolved, options validated, capabilities checked, and (not
    ``strict``: part of a list or of auto) its ``rank_problem`` asked."""
    own, shared = config.backend_options(name)
    cls = reg.resolve(Kind.BACKEND, name)
    model = getattr(cls, "options_model", None)
    options = {k: v for k, v in shared.items() if _has_field(model, k)} | own
    if config.secret is not None and "secret" not in options and _has_field(model, "secret"):
        options["secret"] = config.secret
    sel = _select(Kind.BACKEND, TransferBackend, name, options, reg)
    caps = sel.cls.capabilities
    missing = [c for c in need if not getattr(caps, c)]
    missing += [f"{k.name} memory" for k in kinds if not caps.supports_kind(k)]
    if missing:
        raise CapabilityError(
            f"transfer backend {name!r} lacks {', '.join(missing)}; choose another with "
            "--transfer-backend (see `kvwire plugins`)"
        )
    if not strict:
        why = sel.cls.rank_problem(frozenset(kinds))
        if why is not None:
            raise CapabilityError(f"transfer backend {name!r}: {why}")
    return sel


def _check_shared_options(
    config: KVWireConfig, selected: list[Selected], reg: PluginRegistry
) -> None:
    """A plain option key (no ``NAME.``) given with a list must be a field of at least one
    listed backend's options model."""
    _, shared = config.backend_options(selected[0].name)
    for key in shared:
        if not any(_has_field(s.cls.options_model, key) for s in selected):
            raise ConfigError(
                f"transfer backend option {key!r} is not an option of any of "
                f"{', '.join(s.name for s in selected)}; set NAME.{key}=... for one of them"
            )


def select_backend(
    config: KVWireConfig,
    *,
    need: Iterable[str] = ("write", "notifications"),
    kinds: Iterable[MemKind] = (MemKind.DRAM,),
    registry: PluginRegistry | None = None,
) -> Selected:
    """The first backend of :func:`plan_backends` (its options validated, its capabilities
    checked); also enforces ``require_secret`` (:class:`ConfigError` naming the fix). A
    backend whose options model has a ``secret`` field (the ``tcp`` backend authenticates
    its data plane with it) receives the shared secret there unless its options set one."""
    enforce_secret_policy(config.require_secret, config.secret_bytes, "this kvwire rank")
    return plan_backends(config, need=need, kinds=kinds, registry=registry).selected[0]


def _has_field(model: object, name: str) -> bool:
    return isinstance(model, type) and issubclass(model, BaseModel) and name in model.model_fields


def create_backend(config: KVWireConfig, agent_name: str, **kwargs: Any) -> TransferBackend:
    """Select and instantiate the configured backend for one agent (the first of a list)."""
    sel = select_backend(config, **kwargs)
    backend: TransferBackend = sel.cls(agent_name, sel.options)
    return backend


def create_backends(
    config: KVWireConfig,
    agent_name: str,
    *,
    kinds: Iterable[MemKind] = (MemKind.DRAM,),
    on_failover: Callable[[str, str, str, str], None] | None = None,
    on_recovery: Callable[[str, str], None] | None = None,
    registry: PluginRegistry | None = None,
) -> tuple[TransferBackend, BackendPlan]:
    """Build a rank's backend: the one planned backend itself, or a
    :class:`~kvwire.backends.multi.MultiBackend` over every planned backend that constructs
    (one that raises is skipped with its reason, logged). Called once by the manager."""
    enforce_secret_policy(config.require_secret, config.secret_bytes, "this kvwire rank")
    plan = plan_backends(config, kinds=kinds, registry=registry)
    if len(plan.selected) == 1:
        sel = plan.selected[0]
        one: TransferBackend = sel.cls(agent_name, sel.options)
        one.auto = plan.auto
        return one, plan
    members: list[TransferBackend] = []
    skipped = dict(plan.skipped)
    for sel in plan.selected:
        try:
            members.append(sel.cls(agent_name, sel.options))
        except Exception as exc:  # a plugin's engine failing to start: the others may do
            skipped[sel.name] = f"failed to start: {type(exc).__name__}: {exc}"
            logger.warning("%s: transfer backend %s failed to start: %s", agent_name, sel.name, exc)
    if not members:
        raise ConfigError(
            "no transfer backend could start: " + "; ".join(f"{k}: {v}" for k, v in skipped.items())
        )
    kept = [s for s in plan.selected if s.name in {m.name for m in members}]
    plan = BackendPlan(kept, skipped, auto=plan.auto)
    if len(members) == 1:
        members[0].auto = plan.auto
        return members[0], plan
    from kvwire.backends.multi import MultiBackend

    multi = MultiBackend(
        agent_name,
        members,
        probe_s=config.control.failover_probe_s,
        on_failover=on_failover,
        on_recovery=on_recovery,
        auto=plan.auto,
        link_only=plan.link_only,
    )
    return multi, plan


def select_staging(
    config: KVWireConfig,
    registry: PluginRegistry | None = None,
    *,
    kinds: Iterable[MemKind] = (MemKind.DRAM,),
) -> Selected:
    """The KV pool's first staging candidate for a pool in memory of ``kinds``
    (:func:`staging_candidates`), its options validated."""
    return staging_candidates(config, kinds, registry)[0]


def staging_candidates(
    config: KVWireConfig, kinds: Iterable[MemKind], registry: PluginRegistry | None = None
) -> list[Selected]:
    """The KV pool's staging strategies to try, in order (the manager, at startup: the first
    whose ``setup`` succeeds serves the pool). A named strategy is the one candidate (its
    setup failing fails the start). ``auto`` (the default): every installed strategy whose
    :attr:`~kvwire.staging.base.StagingStrategy.auto_memory` holds all of the pool's memory
    ``kinds`` (highest priority first: bulk staging for GPU pools), then ``direct``; each
    gets the ``staging_options`` its options model has fields for."""
    reg = registry or get_registry()
    if config.staging != AUTO:
        return [_select(Kind.STAGING, StagingStrategy, config.staging, config.staging_options, reg)]
    need = set(kinds)
    out: list[Selected] = []
    ranked = sorted(reg.entries[Kind.STAGING].values(), key=lambda e: -e.impl.priority)
    for entry in ranked:
        if entry.name == "direct":
            continue
        cls, err = reg.try_resolve(Kind.STAGING, entry.name)
        if cls is None:
            logger.info("auto staging: skipping %r: %s", entry.name, err)
            continue
        if not (isinstance(cls, type) and issubclass(cls, StagingStrategy)):
            continue
        if need and need <= cls.auto_memory:
            out.append(_select_auto(entry.name, cls, config, reg))
    out.append(_select_auto("direct", reg.resolve(Kind.STAGING, "direct"), config, reg))
    return out


def _select_auto(name: str, cls: Any, config: KVWireConfig, reg: PluginRegistry) -> Selected:
    """One candidate of ``--staging auto``, given the ``staging_options`` it has fields for."""
    model = getattr(cls, "options_model", None)
    options = {k: v for k, v in config.staging_options.items() if _has_field(model, k)}
    return _select(Kind.STAGING, StagingStrategy, name, options, reg)


def auto_for_pool(kind: Kind, pool: str, registry: PluginRegistry | None = None) -> str | None:
    """The highest-priority implementation of ``kind`` that declares ``pool`` and imports
    here (ties: the first registered), or None."""
    reg = registry or get_registry()
    ranked = sorted(
        (e for e in reg.entries[kind].values() if pool in e.impl.pools),
        key=lambda e: -e.impl.priority,
    )
    for entry in ranked:
        obj, err = reg.try_resolve(kind, entry.name)
        if obj is not None:
            return entry.name
        logger.warning(
            "%s %r for the %s pool is unusable, skipped: %s", kind, entry.name, pool, err
        )
    return None


def select_pool_staging(
    config: KVWireConfig, pool: str, registry: PluginRegistry | None = None
) -> Selected:
    """Resolve the strategy for chunks into the extra pool ``pool``
    (``KVWireConfig.pools[pool].staging``): ``auto`` is the highest-priority usable strategy
    that declares the pool, else ``direct``."""
    reg = registry or get_registry()
    pc = config.pools.get(pool, PoolConfig())
    name = pc.staging
    if name == AUTO:
        name = auto_for_pool(Kind.STAGING, pool, reg) or "direct"
    return _select(Kind.STAGING, StagingStrategy, name, pc.staging_options, reg)


def select_pool_mapper(
    config: KVWireConfig, pool: str, registry: PluginRegistry | None = None
) -> Selected:
    """Resolve the mapper into a decode rank's extra pool ``pool``
    (``KVWireConfig.pools[pool].mapper``): ``auto`` is the highest-priority usable mapper
    that declares the pool. Raises :class:`ConfigError` when none is installed."""
    reg = registry or get_registry()
    pc = config.pools.get(pool, PoolConfig())
    name = pc.mapper
    if name == AUTO:
        found = auto_for_pool(Kind.MAPPER, pool, reg)
        if found is None:
            raise ConfigError(
                f"no index mapper for the {pool!r} pool is installed; install a plugin that "
                "provides one (`kvwire plugins` lists mappers and their pools) or set "
                f"pools.{pool}.mapper"
            )
        name = found
    return _select(Kind.MAPPER, IndexMapper, name, pc.mapper_options, reg)


def select_mapper(
    name: str, options: Mapping[str, Any] | None = None, registry: PluginRegistry | None = None
) -> Selected:
    """Resolve an index mapper by name and validate its options."""
    reg = registry or get_registry()
    return _select(Kind.MAPPER, IndexMapper, name, options or {}, reg)
