"""Creating a Mooncake ``TransferEngine`` the way kvwire needs it.

Everything that depends on process environment lives here:

* ``MC_LOG_LEVEL`` and ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` are read once per process, when
  ``mooncake.engine`` is imported, so the import is lazy and happens after they are chosen
  (log level quiet, ``ERROR``, unless the user set it). ``MC_LOG_DIR`` aborts that import, so
  it is refused with an explanation instead. The engine also silently ignores a port range
  that overlaps the kernel's ephemeral port range (measured with 0.3.13): refused here.
* Other knobs (``MC_TRANSFER_TIMEOUT``, ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``,
  ``MC_TCP_BIND_ADDRESS``) are read when an engine is constructed and initialised. They are
  set for that moment only, under a lock, and restored afterwards; a value the user exported
  wins over kvwire's defaults.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType
from typing import Any

from kvwire.errors import KVWireError

logger = logging.getLogger(__name__)

#: Distributions that ship the ``mooncake`` module: CPU build first, then the CUDA builds.
CPU_DISTRIBUTION = "mooncake-transfer-engine-non-cuda"
CUDA_DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13")
ENGINE_DISTRIBUTIONS = (CPU_DISTRIBUTION, *CUDA_DISTRIBUTIONS)

#: Per-peer queue of the engine's TCP transport: its default, and the largest value it takes.
ENGINE_DEFAULT_QUEUE = 1024
ENGINE_MAX_QUEUE = 65535
#: The engine never times a batch out sooner than this (it clamps MC_TRANSFER_TIMEOUT).
ENGINE_MIN_TIMEOUT_S = 5

QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"

_env_lock = threading.Lock()
#: The RPC port range ``mooncake.engine`` was imported with (None: the engine's default).
_imported_port_range: tuple[int, int] | None = None


class MooncakeEngineError(KVWireError):
    """The Mooncake Transfer Engine could not be imported, initialised or called."""


def installed_distribution() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed Mooncake build, or None."""
    for dist in ENGINE_DISTRIBUTIONS:
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    return None


def rdma_devices() -> list[str]:
    """RDMA devices the kernel exposes (``/sys/class/infiniband``)."""
    ib = Path("/sys/class/infiniband")
    return sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []


def is_cuda_build() -> bool:
    """Whether the installed Mooncake build is a CUDA one (decided without importing it)."""
    found = installed_distribution()
    return found is not None and found[0] in CUDA_DISTRIBUTIONS


def ephemeral_port_range() -> tuple[int, int] | None:
    """The kernel's ephemeral port range (Linux), or None when unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            lo, hi = (int(v) for v in fh.read().split())
    except (OSError, ValueError):
        return None
    return lo, hi


def _env_port_range() -> tuple[int, int] | None:
    lo, hi = os.environ.get("MC_MIN_RPC_PORT"), os.environ.get("MC_MAX_RPC_PORT")
    if lo and hi and lo.isdigit() and hi.isdigit():
        return int(lo), int(hi)
    return None


def check_port_range(port_range: tuple[int, int]) -> None:
    """Refuse a range the engine would silently replace by its default (15000-17000)."""
    eph = ephemeral_port_range()
    lo, hi = port_range
    if eph is not None and lo <= eph[1] and eph[0] <= hi:
        raise MooncakeEngineError(
            f"rpc_port_range {port_range} overlaps the kernel's ephemeral port range {eph} "
            "(net.ipv4.ip_local_port_range); Mooncake then ignores it and uses 15000-17000. "
            "Choose ports outside that range"
        )


def import_engine(
    log_level: str | None = None, port_range: tuple[int, int] | None = None
) -> ModuleType:
    """Import ``mooncake.engine`` with its log level (default ``ERROR``) and RPC port range
    (process-wide in Mooncake) chosen first."""
    global _imported_port_range
    if port_range is not None:
        check_port_range(port_range)
    with _env_lock:
        module = sys.modules.get("mooncake.engine")
        if module is not None:
            if port_range is not None and port_range != _imported_port_range:
                raise MooncakeEngineError(
                    f"rpc_port_range {port_range} cannot apply: Mooncake reads its port range "
                    "once per process, when first imported, and it was imported with "
                    f"{_imported_port_range or 'its default, 15000-17000'}. Use one range for "
                    "every mooncake agent of a process (or MC_MIN_RPC_PORT/MC_MAX_RPC_PORT)"
                )
            current = os.environ.get("MC_LOG_LEVEL")
            if log_level is not None and current != log_level:
                logger.warning(
                    "mooncake was already imported with MC_LOG_LEVEL=%s; log_level=%s applies "
                    "only when kvwire imports it first",
                    current,
                    log_level,
                )
            return module
        if os.environ.get("MC_LOG_DIR"):
            raise MooncakeEngineError(
                "MC_LOG_DIR is set: Mooncake 0.3.x aborts the whole process when it is imported "
                "with it. Unset MC_LOG_DIR (its logs go to stderr; choose the level with the "
                "backend option log_level or MC_LOG_LEVEL)"
            )
        env = {"MC_LOG_LEVEL": log_level or os.environ.get("MC_LOG_LEVEL") or "ERROR"}
        if port_range is not None:
            env.update(MC_MIN_RPC_PORT=str(port_range[0]), MC_MAX_RPC_PORT=str(port_range[1]))
        try:
            with _scoped_env(env):
                module = importlib.import_module("mooncake.engine")
                _imported_port_range = _env_port_range()
            return module
        except ImportError as exc:
            hint = (
                "install the Debian package libibverbs1 (apt-get install --no-install-recommends "
                "libibverbs1)"
                if "ibverbs" in str(exc)
                else f"install {CPU_DISTRIBUTION} (CPU) or {CUDA_DISTRIBUTIONS[0]} (CUDA)"
            )
            raise MooncakeEngineError(
                f"cannot import the Mooncake Transfer Engine (mooncake.engine): {exc}; {hint}"
            ) from exc


@contextlib.contextmanager
def _scoped_env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def _queue_limit_from_env(value: str) -> int:
    """The per-peer queue the engine uses for a user-exported value (it falls back to its
    default on anything it does not accept)."""
    if value.isdigit() and 1 <= int(value) <= ENGINE_MAX_QUEUE:
        return int(value)
    return ENGINE_DEFAULT_QUEUE


@dataclass(frozen=True)
class EngineSettings:
    """What :func:`create_engine` needs from the backend options."""

    #: Address peers reach this engine at (its segment name's host part).
    advertise_host: str
    #: Interface the user asked to bind (passed on as MC_TCP_BIND_ADDRESS).
    bind_host: str
    protocol: str
    device_name: str
    transfer_timeout_s: float


@dataclass
class CreatedEngine:
    """An initialised engine, the name peers address it by, and its per-peer queue."""

    engine: Any
    segment: str
    queue_limit: int


def segment_name(host: str, port: int) -> str:
    """``host:port`` as the engine spells a segment (IPv6 literals in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def create_engine(module: ModuleType, settings: EngineSettings) -> CreatedEngine:
    """Construct and initialise one engine (P2P handshake, no metadata server)."""
    env: dict[str, str] = {}
    if "MC_TRANSFER_TIMEOUT" not in os.environ:
        timeout = max(ENGINE_MIN_TIMEOUT_S, math.ceil(settings.transfer_timeout_s))
        env["MC_TRANSFER_TIMEOUT"] = str(timeout)
    user_queue = os.environ.get(QUEUE_ENV)
    if user_queue is None:
        env[QUEUE_ENV] = str(ENGINE_MAX_QUEUE)
        queue_limit = ENGINE_MAX_QUEUE
    else:
        queue_limit = _queue_limit_from_env(user_queue)
    if "MC_TCP_BIND_ADDRESS" not in os.environ:
        env["MC_TCP_BIND_ADDRESS"] = settings.bind_host
    with _env_lock, _scoped_env(env):
        engine = module.TransferEngine()
        rc = engine.initialize(
            settings.advertise_host, "P2PHANDSHAKE", settings.protocol, settings.device_name
        )
    if rc != 0:
        hint = (
            "check the RDMA devices (ibv_devices) and the device_name option"
            if settings.protocol == "rdma"
            else "check that host is an address of this machine and ports are free"
        )
        raise MooncakeEngineError(
            f"Mooncake TransferEngine.initialize({settings.advertise_host!r}, 'P2PHANDSHAKE', "
            f"{settings.protocol!r}, {settings.device_name!r}) failed with code {rc}; {hint}"
        )
    port = int(engine.get_rpc_port())
    return CreatedEngine(engine, segment_name(settings.advertise_host, port), queue_limit)
