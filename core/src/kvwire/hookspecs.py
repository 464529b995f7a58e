"""The hook specifications a kvwire plugin implements, and the records its hooks return.

A plugin's hook module (named by its ``kvwire`` entry point) imports only this module and
:mod:`kvwire.plugin_api`: ``@hookimpl`` functions returning :class:`Implementation` records
(a name and a lazy ``module:attribute`` import path) and :class:`DoctorCheck` lines. Discovery
and the registry live in :mod:`kvwire.plugins`, which imports this module, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

import pluggy

from kvwire import plugin_api

PROJECT = "kvwire"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class Implementation:
    """What a hook returns: a name and the ``module:attribute`` that implements it.

    ``priority`` orders backends for ``--transfer-backend auto`` (highest usable wins), and
    extra-pool mappers and strategies for ``KVWireConfig.pools[name]`` ``auto``. ``pools``
    says which decode pools a mapper or staging strategy serves: ``"kv"`` (the KV pool) and/or
    the names of extra pools (``KVManager(pools={name: layout})``, e.g. HiSparse's host pool).
    ``link_only`` (backends): it serves some links only (e.g. GPUs of one host): ``auto``
    puts it ahead of the best general backend when it is usable on this rank
    (``rank_problem``), and each link takes it only where its ``link_problem`` accepts the
    peer, falling back to the general one elsewhere.
    """

    name: str
    target: str
    description: str = ""
    priority: int = 0
    pools: tuple[str, ...] = ("kv",)
    link_only: bool = False


class KVWireSpecs:
    """Hook specifications. A plugin module implements any of them with ``@hookimpl``."""

    #: The version of these specifications (and of the seams' contracts): a plugin's hook
    #: module declares the one it was written for as ``KVWIRE_PLUGIN_API``.
    VERSION = plugin_api.PLUGIN_API

    @hookspec
    def kvwire_transfer_backends(self) -> list[Implementation]:  # type: ignore[empty-body]
        """Return the transfer backends this plugin provides."""

    @hookspec
    def kvwire_index_mappers(self) -> list[Implementation]:  # type: ignore[empty-body]
        """Return the index mappers this plugin provides."""

    @hookspec
    def kvwire_staging_strategies(self) -> list[Implementation]:  # type: ignore[empty-body]
        """Return the staging strategies this plugin provides."""

    @hookspec
    def kvwire_engine_benchmarks(self) -> list[Implementation]:  # type: ignore[empty-body]
        """Return engine-level benchmarks: ``Implementation(backend name, "module:main")``
        where ``main(argv: list[str]) -> int`` compares the backend with raw engine calls
        (run by ``kvwire bench --engine --transfer-backend NAME``)."""

    @hookspec
    def kvwire_doctor_checks(self) -> list[DoctorCheck]:  # type: ignore[empty-body]
        """Report what the plugin's engine needs and whether it is there (for `kvwire
        doctor`). Must not fail when the engine is missing: report it instead."""


@dataclass(frozen=True)
class DoctorCheck:
    """One line of `kvwire doctor`: what was checked, whether it is usable, and the fix."""

    subject: str
    ok: bool
    detail: str
    fix: str = ""
