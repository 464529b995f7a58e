"""kvwire hook module of kvwire-nixl (entry point ``nixl``).

It must import fast and never import NIXL: it only names where the backend lives. The doctor
check imports NIXL on demand and reports, rather than raises, what is missing.
"""

from __future__ import annotations

import glob
import os

from kvwire.hookspecs import DoctorCheck, Implementation, hookimpl

#: The kvwire plugin API this plugin is written for (see kvwire.plugin_api).
KVWIRE_PLUGIN_API = "2.0"

#: Above the built-in ``tcp`` (0): ``--transfer-backend auto`` picks nixl whenever it imports.
PRIORITY = 20

#: Where Debian/Ubuntu/RHEL install the libibverbs EFA provider that breaks NIXL at exit.
_EFA_PROVIDER_GLOBS = (
    "/usr/lib/*/libibverbs/libefa-rdmav*.so",
    "/usr/lib64/libibverbs/libefa-rdmav*.so",
    "/usr/lib/libibverbs/libefa-rdmav*.so",
)


@hookimpl
def kvwire_transfer_backends() -> list[Implementation]:
    """The ``nixl`` backend."""
    return [
        Implementation(
            "nixl",
            "kvwire_nixl.backend:NixlBackend",
            "NIXL over UCX (NVLink, RDMA, TCP, shared memory); DRAM and VRAM",
            priority=PRIORITY,
        )
    ]


def _engine_check() -> DoctorCheck:
    from kvwire_nixl import _engine

    try:
        module, dist = _engine.choose_module()
    except ImportError as exc:
        return DoctorCheck(
            "nixl engine",
            False,
            str(exc),
            "uv pip install kvwire-nixl  (or: pip install nixl-cu12)",
        )
    installed = [m for m, _ in _engine.installed_candidates()]
    try:
        eng = _engine.load()
    except Exception as exc:
        return DoctorCheck(
            "nixl engine",
            False,
            f"{dist} is installed but `import {module}._api` failed: {type(exc).__name__}: {exc}",
            f"reinstall it: uv pip install --reinstall {dist}",
        )
    detail = f"{eng.distribution} {eng.version} (module {eng.module})"
    if len(installed) > 1:
        how = (
            f"{_engine.MODULE_ENV}"
            if os.environ.get(_engine.MODULE_ENV)
            else "torch's CUDA version"
        )
        detail += f"; builds installed: {', '.join(installed)}, chosen by {how}"
    return DoctorCheck("nixl engine", True, detail)


def _ucx_modules_check() -> DoctorCheck:
    from kvwire_nixl import _engine

    default = _engine.ENV_DEFAULTS["UCX_MODULES"]
    value = os.environ.get("UCX_MODULES")
    efa = sorted({p for g in _EFA_PROVIDER_GLOBS for p in glob.glob(g)})
    if value is None:
        return DoctorCheck(
            "nixl UCX_MODULES",
            True,
            f"unset; kvwire-nixl sets UCX_MODULES={default} before loading NIXL",
        )
    if _engine.applied_defaults.get("UCX_MODULES") == value:
        return DoctorCheck("nixl UCX_MODULES", True, f"UCX_MODULES={value} (kvwire-nixl default)")
    excluded = value.startswith("^") and "efa" in value[1:].split(",")
    if efa and not excluded:
        return DoctorCheck(
            "nixl UCX_MODULES",
            False,
            f"UCX_MODULES={value!r} loads UCX's EFA module and the libibverbs EFA provider is "
            f"installed ({efa[0]}): NIXL processes segfault at exit",
            "unset UCX_MODULES (kvwire-nixl then uses ^efa) or add efa to its ^ list",
        )
    return DoctorCheck("nixl UCX_MODULES", True, f"UCX_MODULES={value!r} (set by the user)")


@hookimpl
def kvwire_doctor_checks() -> list[DoctorCheck]:
    """NIXL build and version, and the UCX_MODULES setting that keeps exit clean."""
    checks = []
    for fn in (_engine_check, _ucx_modules_check):
        try:
            checks.append(fn())
        except Exception as exc:  # a doctor hook reports, never raises
            checks.append(DoctorCheck("nixl", False, f"{fn.__name__} raised {exc!r}"))
    return checks


@hookimpl
def kvwire_engine_benchmarks() -> list[Implementation]:
    """``kvwire bench --engine --transfer-backend nixl``: kvwire's nixl backend vs raw engine
    calls on the same descriptors."""
    return [Implementation("nixl", "kvwire_nixl.bench:main", "kvwire vs raw nixl calls")]
