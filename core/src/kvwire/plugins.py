"""Plugin discovery: entry points and the name -> implementation registry.

Plugins are distributions that declare an entry point in the ``kvwire`` group pointing at a
light module (it must not import a native engine). pluggy registers that module and calls its
hooks (specified in :mod:`kvwire.hookspecs`), which return :class:`Implementation` records: a
name and an import path. The import path is resolved only when that name is selected, so a
broken native install never breaks ``kvwire --help`` or another backend. kvwire's own
built-ins register through the same hooks (entry point ``core`` -> :mod:`kvwire.builtin`).
"""

from __future__ import annotations

import enum
import importlib
import logging
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy

from kvwire import plugin_api
from kvwire.errors import PluginError, UnknownNameError

# Re-exported: plugins written before the hook specifications had their own module import
# these names from here.
from kvwire.hookspecs import PROJECT, DoctorCheck, Implementation, KVWireSpecs, hookimpl, hookspec

logger = logging.getLogger(__name__)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROJECT",
    "DoctorCheck",
    "Entry",
    "Implementation",
    "KVWireSpecs",
    "Kind",
    "PluginRegistry",
    "get_registry",
    "hookimpl",
    "hookspec",
    "reset_registry",
]

ENTRY_POINT_GROUP = "kvwire"

#: Distributions that provide well-known names, for install hints.
KNOWN_DISTRIBUTIONS = {
    "nixl": "kvwire-nixl",
    "mooncake": "kvwire-mooncake",
    "hisparse": "kvwire-hisparse",
}


class Kind(enum.StrEnum):
    """The three seams a plugin can fill."""

    BACKEND = "transfer backend"
    MAPPER = "index mapper"
    STAGING = "staging strategy"


_HOOKS = {
    Kind.BACKEND: "kvwire_transfer_backends",
    Kind.MAPPER: "kvwire_index_mappers",
    Kind.STAGING: "kvwire_staging_strategies",
}


@dataclass
class Entry:
    """A registered name, where it came from, and (once selected) whether it imports."""

    kind: Kind
    impl: Implementation
    plugin: str
    distribution: str
    version: str
    builtin: bool = False
    #: The plugin API the providing plugin was built for (see :mod:`kvwire.plugin_api`).
    api: str = plugin_api.PLUGIN_API
    _resolved: Any = field(default=None, repr=False)
    import_error: str | None = None

    @property
    def name(self) -> str:
        """The selectable name."""
        return self.impl.name


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin whose entry-point module (or one of its hooks) failed."""

    plugin: str
    distribution: str
    version: str
    error: str
    detail: str


@dataclass(frozen=True)
class Conflict:
    """Two plugins registering the same name of the same kind; the later one was refused."""

    kind: Kind
    name: str
    kept: str
    refused: str


class PluginRegistry:
    """All implementations known in this process, by kind and name."""

    def __init__(
        self, *, load_entry_points: bool = True, extra: Sequence[tuple[str, Any]] = ()
    ) -> None:
        self._lock = threading.Lock()
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(KVWireSpecs)
        self.entries: dict[Kind, dict[str, Entry]] = {k: {} for k in Kind}
        self.broken: list[BrokenPlugin] = []
        self.conflicts: list[Conflict] = []
        self._ambiguous: dict[tuple[Kind, str], list[str]] = {}
        self._origin: dict[str, tuple[str, str, bool]] = {}
        modules: list[tuple[str, Any]] = []
        if load_entry_points:
            modules.extend(self._load_entry_points())
        if not any(getattr(m, "__name__", "") == "kvwire.builtin" for _, m in modules):
            from kvwire import builtin

            modules.insert(0, ("core", builtin))
            self._origin["core"] = ("kvwire", _version("kvwire"), True)
        modules.extend(extra)
        # Built-ins first: they keep their names if a plugin tries to take them.
        modules.sort(key=lambda nm: not self._origin.get(nm[0], ("", "", False))[2])
        self._api: dict[str, str] = {}
        for name, module in modules:
            dist, version, is_core = self._origin.get(name, ("?", "?", False))
            api = plugin_api.PLUGIN_API if is_core else plugin_api.declared(module)
            why = plugin_api.incompatibility(api)
            if why is not None:
                self.broken.append(BrokenPlugin(name, dist, version, why, ""))
                logger.error("kvwire plugin %r from %s %s refused: %s", name, dist, version, why)
                continue
            try:
                self.manager.register(module, name=name)
            except (ValueError, pluggy.PluginValidationError) as exc:
                # the same module or name twice, or a hook whose signature is not the spec's
                why = " ".join(str(exc).split())  # one line: pluggy's spans several
                self.broken.append(BrokenPlugin(name, dist, version, why, ""))
                logger.error("kvwire plugin %r from %s %s refused: %s", name, dist, version, why)
                continue
            self._api[name] = api
            self._collect(name)

    def _load_entry_points(self) -> list[tuple[str, Any]]:
        out = []
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            try:
                module = ep.load()
            except Exception as exc:
                self.broken.append(
                    BrokenPlugin(
                        ep.name,
                        dist,
                        version,
                        f"{type(exc).__name__}: {exc}",
                        traceback.format_exc(),
                    )
                )
                logger.warning(
                    "kvwire plugin %r from distribution %s %s failed to import and is skipped: "
                    "%s: %s",
                    ep.name,
                    dist,
                    version,
                    type(exc).__name__,
                    exc,
                )
                continue
            builtin = getattr(module, "__name__", "") == "kvwire.builtin"
            self._origin[ep.name] = (dist, version, builtin)
            out.append((ep.name, module))
        return out

    def _collect(self, plugin: str) -> None:
        dist, version, builtin = self._origin.get(plugin, ("?", "?", False))
        for kind, hook_name in _HOOKS.items():
            caller = getattr(self.manager.hook, hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin_name != plugin:
                    continue
                try:
                    records = list(impl.function() or [])
                except Exception as exc:
                    self.broken.append(
                        BrokenPlugin(
                            plugin,
                            dist,
                            version,
                            f"{hook_name} raised {type(exc).__name__}: {exc}",
                            traceback.format_exc(),
                        )
                    )
                    logger.warning("kvwire plugin %r: hook %s failed: %s", plugin, hook_name, exc)
                    continue
                api = self._api.get(plugin, plugin_api.PLUGIN_API)
                for rec in records:
                    self._add(Entry(kind, rec, plugin, dist, version, builtin, api=api))

    def _add(self, entry: Entry) -> None:
        table = self.entries[entry.kind]
        old = table.get(entry.name)
        if old is None:
            table[entry.name] = entry
            return
        kept = f"{old.plugin} ({old.distribution})"
        refused = f"{entry.plugin} ({entry.distribution})"
        self.conflicts.append(Conflict(entry.kind, entry.name, kept, refused))
        logger.error(
            "%s name %r is registered by %s and again by %s: the second registration is refused%s",
            entry.kind,
            entry.name,
            kept,
            refused,
            "" if old.builtin else "; the name is ambiguous until one is uninstalled",
        )
        if not old.builtin:
            self._ambiguous.setdefault((entry.kind, entry.name), [kept]).append(refused)

    # --------------------------------------------------------------- queries
    def names(self, kind: Kind) -> list[str]:
        """Registered names of one kind, sorted."""
        return sorted(self.entries[kind])

    def get(self, kind: Kind, name: str) -> Entry:
        """The entry for ``name``, or an error that lists what is available and how to fix."""
        amb = self._ambiguous.get((kind, name))
        if amb:
            raise PluginError(
                f"{kind} {name!r} is registered by several plugins: {', '.join(amb)}. "
                "Uninstall all but one of those distributions."
            )
        entry = self.entries[kind].get(name)
        if entry is not None:
            return entry
        available = ", ".join(self.names(kind)) or "none"
        dist = KNOWN_DISTRIBUTIONS.get(name, f"kvwire-{name}")
        msg = (
            f"unknown {kind} {name!r}. Available: {available}. If {name!r} comes from a "
            f"plugin, install it (e.g. `uv pip install {dist}` or `pip install {dist}`) and "
            "check `kvwire plugins`."
        )
        related = [b for b in self.broken if b.plugin == name or name in b.distribution]
        for b in related or self.broken:
            msg += (
                f" Plugin {b.plugin!r} from {b.distribution} {b.version} failed to import "
                f"({b.error}); it may provide {name!r}."
            )
        raise UnknownNameError(msg)

    def resolve(self, kind: Kind, name: str) -> Any:
        """Import and return the object behind ``name`` (cached). Raises PluginError naming
        the plugin, its distribution and the cause when the import fails."""
        entry = self.get(kind, name)
        with self._lock:
            if entry._resolved is not None:
                return entry._resolved
            module_name, _, attr = entry.impl.target.partition(":")
            try:
                obj: Any = importlib.import_module(module_name)
                for part in filter(None, attr.split(".")):
                    obj = getattr(obj, part)
            except Exception as exc:
                entry.import_error = f"{type(exc).__name__}: {exc}"
                raise PluginError(
                    f"{kind} {name!r} (plugin {entry.plugin!r}, distribution "
                    f"{entry.distribution} {entry.version}) could not be loaded from "
                    f"{entry.impl.target}: {entry.import_error}. Run `kvwire doctor` for what "
                    "to install."
                ) from exc
            if plugin_api.is_legacy(entry.api):
                obj = self._adapt_legacy(entry, obj)
            entry._resolved = obj
            return obj

    @staticmethod
    def _adapt_legacy(entry: Entry, obj: Any) -> Any:
        """A plugin built for API 1.x: its backend is called the 1.0 way (serialised); a
        staging strategy cannot be adapted (its hooks changed) and is refused."""
        if entry.kind is Kind.BACKEND and isinstance(obj, type):
            logger.info(
                "backend %r (plugin API %s): data-path hooks serialised as API 1.0 had them",
                entry.name,
                entry.api,
            )
            return plugin_api.serialised_backend(obj)
        if entry.kind is Kind.STAGING:
            entry.import_error = (
                f"built for kvwire plugin API {entry.api}; the staging seam changed in "
                f"{plugin_api.PLUGIN_API} (on_message, on_arrival(ArrivedChunk)): rebuild the "
                "plugin against this kvwire"
            )
            raise PluginError(
                f"{entry.kind} {entry.name!r} (plugin {entry.plugin!r}, distribution "
                f"{entry.distribution} {entry.version}) {entry.import_error}"
            )
        return obj

    def doctor_checks(self) -> list[tuple[str, DoctorCheck]]:
        """Every plugin's doctor checks, as ``(plugin, check)``; a failing hook is reported."""
        out: list[tuple[str, DoctorCheck]] = []
        for impl in self.manager.hook.kvwire_doctor_checks.get_hookimpls():
            checks: list[DoctorCheck]
            try:
                result: Any = impl.function()
                checks = list(result or [])
            except Exception as exc:
                checks = [DoctorCheck(impl.plugin_name, False, f"doctor hook raised {exc!r}")]
            out.extend((impl.plugin_name, c) for c in checks)
        return out

    def engine_benchmark(self, backend: str) -> Any | None:
        """The ``main(argv)`` of the engine benchmark a plugin registered for ``backend``,
        imported now; None when no plugin registered one."""
        for impl in self.manager.hook.kvwire_engine_benchmarks.get_hookimpls():
            result: Any = impl.function()
            entries: list[Implementation] = list(result or [])
            for entry in entries:
                if entry.name == backend:
                    module, _, attr = entry.target.partition(":")
                    try:
                        return getattr(importlib.import_module(module), attr or "main")
                    except Exception as exc:
                        raise PluginError(
                            f"engine benchmark of {backend!r} ({entry.target}) from plugin "
                            f"{impl.plugin_name!r} does not import: {type(exc).__name__}: {exc}"
                        ) from exc
        return None

    def try_resolve(self, kind: Kind, name: str) -> tuple[Any | None, str | None]:
        """Like :meth:`resolve` but returns ``(None, error)`` instead of raising."""
        try:
            return self.resolve(kind, name), None
        except PluginError as exc:
            return None, str(exc)


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "source"


_registry: PluginRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> PluginRegistry:
    """The process-wide registry, built on first use."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = PluginRegistry()
        return _registry


def reset_registry() -> None:
    """Forget the process-wide registry (tests, or after installing a plugin at run time)."""
    global _registry
    with _registry_lock:
        _registry = None
