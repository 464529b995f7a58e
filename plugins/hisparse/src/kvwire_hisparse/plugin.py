"""kvwire hook module of kvwire-hisparse (entry point ``hisparse``); imports nothing heavy:
the ``hisparse`` mapper and the ``hisparse`` host staging strategy."""

from __future__ import annotations

from kvwire.hookspecs import Implementation, hookimpl

#: The kvwire plugin API this plugin is written for (see kvwire.plugin_api).
KVWIRE_PLUGIN_API = "2.0"


@hookimpl
def kvwire_index_mappers() -> list[Implementation]:
    """The ``hisparse`` mapper: prefill pages into a decode host pool of finer pages."""
    return [
        Implementation(
            "hisparse",
            "kvwire_hisparse.mapper:HostPoolMapper",
            "prefill KV pages into a decode host pool (page size 1 or a divisor)",
            priority=10,
            pools=("host",),
        )
    ]


@hookimpl
def kvwire_staging_strategies() -> list[Implementation]:
    """``hisparse`` host staging: picks the fastest path into each decode host pool."""
    return [
        Implementation(
            "hisparse",
            "kvwire_hisparse.paths:HostPathStrategy",
            "host-pool chunks: copy into a same-host shared pool, else the engine",
            priority=10,
            pools=("host",),
        )
    ]
