"""kvwire's built-in implementations, registered through the same hooks as any plugin."""

from __future__ import annotations

from kvwire.hookspecs import DoctorCheck, Implementation, hookimpl


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
        Implementation(
            "head_rows",
            "kvwire.index.head_rows:HeadRowsMapper",
            "head-major pages on either side: one row per (token, head)",
        ),
    ]


@hookimpl
def kvwire_staging_strategies() -> list[Implementation]:
    """Direct (no staging) and bulk staging."""
    return [
        Implementation(
            "direct", "kvwire.staging.direct:DirectStaging", "no staging", pools=("kv",)
        ),
        Implementation(
            "bulk",
            "kvwire.staging.bulk:BulkStaging",
            "heterogeneous TP: one contiguous write per chunk through a decode staging ring",
        ),
    ]


@hookimpl
def kvwire_doctor_checks() -> list[DoctorCheck]:
    """The tcp backend's transport: ZeroMQ over TCP (pyzmq and its bundled libzmq)."""
    try:
        import zmq
    except ImportError as exc:
        return [
            DoctorCheck(
                "tcp transport",
                False,
                f"pyzmq does not import: {exc}",
                "reinstall kvwire (pyzmq is a dependency)",
            )
        ]
    # TCP is always built into libzmq; zmq.has() reports the optional transports only.
    transports = ["tcp", *(t for t in ("ipc", "tipc") if zmq.has(t))]
    return [
        DoctorCheck(
            "tcp transport",
            True,
            f"ZeroMQ {zmq.zmq_version()} (pyzmq {zmq.__version__}); transports: "
            f"{', '.join(transports)}; CURVE encryption: {'yes' if zmq.has('curve') else 'no'}",
        )
    ]
