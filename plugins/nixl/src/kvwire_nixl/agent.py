"""The NIXL engine behind the ``nixl`` backend: the build it loads, creating an agent, NIXL's
errors in kvwire's words, NIXL's memory types, and fork and exit safety.

Everything here is stateless glue that :class:`~kvwire_nixl.backend.NixlBackend` calls, except
the set of open backends closed at interpreter exit and the fork generation, which this module
owns: a backend records the generation it was created in and refuses to use its agent in a
forked child (NIXL is not fork-safe).
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from kvwire.backend import XferOp
from kvwire.descriptors import ADDR, LEN, DescTable, locate_rows
from kvwire.errors import ConfigError, DescriptorError, KVWireError, PeerError, TransferError
from kvwire.layout import MemKind, MemoryRegion
from kvwire_nixl import _engine
from kvwire_nixl.options import NixlOptions

logger = logging.getLogger(__name__)

#: The NIXL build, imported when this module is (so a missing NIXL makes ``nixl`` unusable
#: for ``--transfer-backend auto`` instead of failing later).
ENGINE = _engine.load()

#: NIXL's memory type of each kvwire memory kind.
MEM_TYPES = {MemKind.DRAM: "DRAM", MemKind.VRAM: "VRAM"}
#: NIXL's thread-sync enum member of each ``sync_mode`` option.
SYNC_MODES = {
    "none": "NIXL_THREAD_SYNC_NONE",
    "strict": "NIXL_THREAD_SYNC_STRICT",
    "rw": "NIXL_THREAD_SYNC_RW",
}


def describe(exc: BaseException) -> str:
    """An exception as ``Type: text`` for error messages and logs."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_nixl_error(exc: BaseException, *names: str) -> bool:
    """Whether ``exc`` is one of NIXL's exceptions named ``names``."""
    return type(exc).__name__ in names and isinstance(exc, ENGINE.errors)


def convert_error(
    exc: Exception,
    what: str,
    descriptor: tuple[str, ...] = (),
    peer: str | None = None,
    op: XferOp | None = None,
) -> KVWireError:
    """The kvwire error for ``exc`` raised by NIXL call ``what``.

    NIXL errors named in ``descriptor`` become :class:`DescriptorError`; a remote
    disconnect becomes :class:`PeerError`; anything else :class:`TransferError`.
    """
    msg = f"NIXL {what} failed: {describe(exc)}"
    if descriptor and is_nixl_error(exc, *descriptor):
        return DescriptorError(msg)
    operation = None if op is None else op.value
    if is_nixl_error(exc, "nixlRemoteDisconnectError"):
        return PeerError(msg, peer=peer, operation=operation)
    return TransferError(msg, peer=peer, operation=operation)


def create_agent(agent_name: str, opts: NixlOptions) -> Any:
    """A NIXL agent named ``agent_name`` with the backend plugins ``opts`` names; called by
    the backend's constructor (engine thread). :class:`TransferError` when NIXL refuses the
    agent, :class:`ConfigError` naming what is available when a plugin is missing or refuses
    its parameters."""
    api = ENGINE.api
    conf = api.nixl_agent_config(
        enable_prog_thread=opts.progress == "thread",
        enable_listen_thread=False,
        backends=[],
        sync_mode=api.nixl_thread_sync_t[SYNC_MODES[opts.sync_mode]],
    )
    try:
        agent = api.nixl_agent(agent_name, conf)
    except Exception as exc:
        raise TransferError(
            f"NIXL agent {agent_name!r} could not be created ({ENGINE.distribution} "
            f"{ENGINE.version}): {describe(exc)}"
        ) from exc
    available = list(agent.get_plugin_list())
    for b in opts.backends:
        if b not in available:
            raise ConfigError(
                f"NIXL backend plugin {b!r} is not available in {ENGINE.distribution} "
                f"{ENGINE.version}; available: {', '.join(sorted(available)) or 'none'}"
            )
        params = opts.init_params(b)
        try:
            agent.create_backend(b, params)
        except Exception as exc:
            raise ConfigError(
                f"NIXL could not create backend {b!r} with parameters {params}: "
                f"{describe(exc)}. Accepted parameters and defaults: "
                f"{agent.get_plugin_params(b)}"
            ) from exc
    return agent


def table_mem(table: DescTable, regions: Sequence[MemoryRegion], what: str) -> str:
    """NIXL memory type of a table's rows: all DRAM or all VRAM."""
    order = sorted(regions, key=lambda r: r.addr)
    starts = np.array([r.addr for r in order], dtype=np.uint64)
    ends = np.array([r.end for r in order], dtype=np.uint64)
    pos = locate_rows(starts, ends, table[:, ADDR], table[:, LEN])
    if (pos < 0).any():
        i = int(np.argmax(pos < 0))
        raise DescriptorError(
            f"{what}: row {i} (addr {int(table[i, ADDR]):#x}) is not in a registered region"
        )
    vram = np.array([r.kind is MemKind.VRAM for r in order], dtype=bool)[pos]
    if vram.all():
        return "VRAM"
    if not vram.any():
        return "DRAM"
    raise DescriptorError(
        f"{what} mixes DRAM and VRAM rows ({int(vram.sum())} of {vram.size} in VRAM); NIXL "
        "prepares one memory type per descriptor list: build one table per memory kind"
    )


# ----------------------------------------------------------------- fork and exit safety
class Closable(Protocol):
    """What the exit hook needs of an open backend."""

    agent_name: str
    _generation: int

    def close(self) -> None: ...


# Backends still open, closed at interpreter exit (a NIXL agent torn down by the garbage
# collector during finalisation can crash the process).
_live: weakref.WeakSet[Closable] = weakref.WeakSet()
_fork_generation = 0


def fork_generation() -> int:
    """How many forks this process is removed from the one that imported this module: a
    backend created in another generation must not touch its agent."""
    return _fork_generation


def track(backend: Closable) -> None:
    """Close ``backend`` at interpreter exit unless it is closed (untracked) first."""
    _live.add(backend)


def untrack(backend: Closable) -> None:
    """``backend`` closed: no longer closed at exit."""
    _live.discard(backend)


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_all_at_exit() -> None:
    for backend in list(_live):
        if backend._generation == _fork_generation:
            try:
                backend.close()
            except Exception:  # exit must go on
                logger.debug("closing %s at exit failed", backend.agent_name, exc_info=True)
