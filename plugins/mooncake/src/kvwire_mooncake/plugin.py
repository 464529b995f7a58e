"""Entry-point module of kvwire-mooncake: names the backend, never imports Mooncake.

Registered under the ``kvwire`` entry-point group as ``mooncake``. The backend class lives in
:mod:`kvwire_mooncake.backend` and is imported only when ``mooncake`` is selected.
"""

from __future__ import annotations

import ctypes.util
import os
from importlib.util import find_spec
from pathlib import Path

from kvwire.hookspecs import DoctorCheck, Implementation, hookimpl

#: The kvwire plugin API this plugin is written for (see kvwire.plugin_api).
KVWIRE_PLUGIN_API = "2.0"

#: Between the built-in ``tcp`` (0) and ``nixl`` (20): ``auto`` prefers NIXL, then Mooncake.
PRIORITY = 10

_DISTS = (
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-cuda13",
)
_INSTALL = (
    "pip install kvwire-mooncake (CPU build), or add mooncake-transfer-engine for GPU memory; "
    "see docs/plugins/mooncake.md"
)


@hookimpl
def kvwire_transfer_backends() -> list[Implementation]:
    """The Mooncake Transfer Engine backend."""
    return [
        Implementation(
            "mooncake",
            "kvwire_mooncake.backend:MooncakeBackend",
            "Mooncake Transfer Engine (TCP or RDMA; DRAM, VRAM with the CUDA build)",
            priority=PRIORITY,
        )
    ]


def _engine_check() -> DoctorCheck:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for dist in _DISTS:
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            continue
    if not found:
        return DoctorCheck("Mooncake engine", False, "no Mooncake distribution installed", _INSTALL)
    if find_spec("mooncake") is None:
        return DoctorCheck(
            "Mooncake engine", False, f"{found[0]} installed but no mooncake module", _INSTALL
        )
    detail = ", ".join(found)
    if len(found) > 1:
        return DoctorCheck(
            "Mooncake engine",
            False,
            f"{detail}: several builds share the mooncake module and overwrite each other",
            "keep exactly one Mooncake distribution installed",
        )
    gpu = (
        "GPU memory (CUDA build)" if "non-cuda" not in found[0] else "host memory only (CPU build)"
    )
    return DoctorCheck("Mooncake engine", True, f"{detail}; {gpu}")


def _ibverbs_check() -> DoctorCheck:
    lib = ctypes.util.find_library("ibverbs")
    if lib is None:
        return DoctorCheck(
            "libibverbs (for Mooncake)",
            False,
            "not found: Mooncake's engine does not import without it, even over TCP",
            "apt-get install --no-install-recommends libibverbs1 (without ibverbs-providers: "
            "that Recommends makes NIXL processes segfault at exit)",
        )
    ib = Path("/sys/class/infiniband")
    devices = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    rdma = f"RDMA devices: {', '.join(devices)}" if devices else "no RDMA devices (TCP only)"
    return DoctorCheck("libibverbs (for Mooncake)", True, f"{lib}; {rdma}")


def _env_check() -> DoctorCheck | None:
    if os.environ.get("MC_LOG_DIR"):
        return DoctorCheck(
            "Mooncake environment",
            False,
            "MC_LOG_DIR is set: importing Mooncake 0.3.x aborts the process",
            "unset MC_LOG_DIR",
        )
    return None


@hookimpl
def kvwire_doctor_checks() -> list[DoctorCheck]:
    """Engine distribution and build, libibverbs and RDMA devices, fatal environment."""
    checks = [_engine_check(), _ibverbs_check()]
    env = _env_check()
    if env is not None:
        checks.append(env)
    return checks


@hookimpl
def kvwire_engine_benchmarks() -> list[Implementation]:
    """``kvwire bench --engine --transfer-backend mooncake``: kvwire's mooncake backend vs raw
    engine calls on the same descriptors."""
    return [Implementation("mooncake", "kvwire_mooncake.bench:main", "kvwire vs raw Mooncake")]
