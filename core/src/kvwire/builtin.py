"""kvwire's built-in implementations, registered through the same hooks as any plugin."""

from __future__ import annotations

from kvwire.plugins import Implementation, hookimpl


@hookimpl
def kvwire_transfer_backends() -> list[Implementation]:
    """The pure-Python reference backend."""
    return [
        Implementation(
            "tcp",
            "kvwire.backends.tcp:TcpBackend",
            "pure-Python reference backend over ZeroMQ (DRAM, any host)",
            priority=0,
        )
    ]


@hookimpl
def kvwire_index_mappers() -> list[Implementation]:
    """Equal TP, MLA and heterogeneous-TP head slicing."""
    return [
        Implementation("equal_tp", "kvwire.index.equal_tp:EqualTPMapper", "equal TP, whole pages"),
        Implementation("mla", "kvwire.index.equal_tp:MLAMapper", "MLA, replicated latent"),
        Implementation(
            "head_slice", "kvwire.index.head_slice:HeadSliceMapper", "hetero TP head slices"
        ),
    ]


@hookimpl
def kvwire_staging_strategies() -> list[Implementation]:
    """No staging."""
    return [Implementation("direct", "kvwire.staging.direct:DirectStaging", "no staging")]
