"""Selection: turn a :class:`~kvwire.config.KVWireConfig` into implementations, once.

Options are validated against the implementation's own options model, and the backend's
declared capabilities are checked against what the caller needs, here and only here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from kvwire.backend import TransferBackend
from kvwire.config import AUTO, KVWireConfig
from kvwire.errors import CapabilityError, ConfigError, PluginError
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
    """The highest-priority backend that imports in this environment."""
    reg = registry or get_registry()
    ranked = sorted(reg.entries[Kind.BACKEND].values(), key=lambda e: -e.impl.priority)
    for entry in ranked:
        obj, err = reg.try_resolve(Kind.BACKEND, entry.name)
        if obj is not None:
            return entry.name
        logger.info("auto backend: skipping %r: %s", entry.name, err)
    raise PluginError("no usable transfer backend is installed; run `kvwire doctor`")


def select_backend(
    config: KVWireConfig,
    *,
    need: Iterable[str] = ("write", "notifications"),
    kinds: Iterable[MemKind] = (MemKind.DRAM,),
    registry: PluginRegistry | None = None,
) -> Selected:
    """Resolve the configured backend, validate its options and check its capabilities.

    Called first thing when a manager starts, so it also enforces ``require_secret``
    (:class:`ConfigError` naming the fix). A backend whose options model has a ``secret``
    field (the ``tcp`` backend authenticates its data plane with it) receives the shared
    secret there unless its options set one.
    """
    enforce_secret_policy(config.require_secret, config.secret_bytes, "this kvwire rank")
    reg = registry or get_registry()
    name = config.transfer_backend
    if name == AUTO:
        name = auto_backend_name(reg)
    options = dict(config.transfer_backend_options)
    cls = reg.resolve(Kind.BACKEND, name)
    model = getattr(cls, "options_model", None)
    if config.secret is not None and "secret" not in options and _has_field(model, "secret"):
        options["secret"] = config.secret
    sel = _select(Kind.BACKEND, TransferBackend, name, options, reg)
    caps = sel.cls.capabilities
    missing = [c for c in need if not getattr(caps, c)]
    missing += [f"{k.name} memory" for k in set(kinds) if not caps.supports_kind(k)]
    if missing:
        raise CapabilityError(
            f"transfer backend {name!r} lacks {', '.join(missing)}; choose another with "
            "--transfer-backend (see `kvwire plugins`)"
        )
    return sel


def _has_field(model: object, name: str) -> bool:
    return isinstance(model, type) and issubclass(model, BaseModel) and name in model.model_fields


def create_backend(config: KVWireConfig, agent_name: str, **kwargs: Any) -> TransferBackend:
    """Select and instantiate the configured backend for one agent."""
    sel = select_backend(config, **kwargs)
    backend: TransferBackend = sel.cls(agent_name, sel.options)
    return backend


def select_staging(config: KVWireConfig, registry: PluginRegistry | None = None) -> Selected:
    """Resolve the configured staging strategy and validate its options."""
    reg = registry or get_registry()
    return _select(Kind.STAGING, StagingStrategy, config.staging, config.staging_options, reg)


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


def select_host_staging(config: KVWireConfig, registry: PluginRegistry | None = None) -> Selected:
    """Resolve the strategy for chunks into a decode host pool: ``auto`` is the
    highest-priority usable strategy that declares the ``host`` pool (``direct`` declares it
    with priority 0)."""
    reg = registry or get_registry()
    name = config.host_staging
    if name == AUTO:
        name = auto_for_pool(Kind.STAGING, "host", reg) or "direct"
    return _select(Kind.STAGING, StagingStrategy, name, config.host_staging_options, reg)


def select_host_mapper(config: KVWireConfig, registry: PluginRegistry | None = None) -> Selected:
    """Resolve the mapper into a decode host pool: ``auto`` is the highest-priority usable
    mapper that declares the ``host`` pool. Raises :class:`ConfigError` when none is
    installed (core's mappers serve KV pools of equal page size only)."""
    reg = registry or get_registry()
    name = config.host_mapper
    if name == AUTO:
        found = auto_for_pool(Kind.MAPPER, "host", reg)
        if found is None:
            raise ConfigError(
                "no index mapper for host pools is installed; install a plugin that provides "
                "one (`kvwire plugins` lists mappers and their pools) or set host_mapper"
            )
        name = found
    return _select(Kind.MAPPER, IndexMapper, name, config.host_mapper_options, reg)


def select_mapper(
    name: str, options: Mapping[str, Any] | None = None, registry: PluginRegistry | None = None
) -> Selected:
    """Resolve an index mapper by name and validate its options."""
    reg = registry or get_registry()
    return _select(Kind.MAPPER, IndexMapper, name, options or {}, reg)
