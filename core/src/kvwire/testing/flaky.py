"""A transfer backend that fails on command, for failover tests (never used outside tests).

``flaky`` is the built-in ``tcp`` backend under another name (its metadata is tagged
``flaky``, so a rank can hold both), plus a switch per agent name:

* :func:`break_agent` — from now on the agent's posts are swallowed: nothing is sent (no
  byte, no notification reaches the peer) and each such transfer polls FAILED after
  ``fail_after_s``, with an error naming the injected fault, as an engine reports a broken
  endpoint after its own timeout; adding a peer (a reconnection) is refused.
  Transfers posted before the break complete as they would. With ``delivered=True`` the
  posts are sent and land (data and notification) but poll FAILED once done: an engine
  whose acknowledgement was lost after delivery (the peer then sees the notification twice
  when the transfer is resent elsewhere).
* :func:`heal_agent` — back to a working ``tcp``.
* Across processes: where :data:`FLAG_DIR_ENV` names a folder, an agent is also broken (as
  :func:`break_agent` with the defaults) while a file named for it exists there
  (:func:`flag_path`; the soak's ``dead_backend`` fault, :mod:`kvwire.testing.soak`).

This module is a hook module: tests build a registry with
``PluginRegistry(extra=[("flaky", kvwire.testing.flaky)])``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvwire.backend import PreparedPair, TransferHandle, XferOp, XferState
from kvwire.backends.tcp.backend import TcpBackend
from kvwire.errors import PeerError
from kvwire.hookspecs import Implementation, hookimpl
from kvwire.page_form import PageChunk

KVWIRE_PLUGIN_API = "2.0"

#: A folder: an agent of this process is broken while ``<folder>/<agent>`` exists.
FLAG_DIR_ENV = "KVWIRE_TESTING_FLAKY_DIR"
#: Seconds after which a post swallowed by a flag file polls FAILED.
FLAG_FAIL_AFTER_S = 0.05

_lock = threading.Lock()
_broken: dict[str, tuple[float, bool]] = {}  # agent -> (fail after s, delivered)
_flag_dir = os.environ.get(FLAG_DIR_ENV) or None
#: Posts swallowed so far, per agent (a test checks the fault was hit).
swallowed: dict[str, int] = {}
#: Chunks taken in page form so far, per agent (when a test declares ``page_writes``).
paged: dict[str, int] = {}


def break_agent(agent: str, fail_after_s: float = 0.05, delivered: bool = False) -> None:
    """Break agent ``agent``'s ``flaky`` backend (see the module docstring). Any thread."""
    with _lock:
        _broken[agent] = (fail_after_s, delivered)


def heal_agent(agent: str) -> None:
    """Undo :func:`break_agent`. Any thread."""
    with _lock:
        _broken.pop(agent, None)


def flag_path(folder: str, agent: str) -> str:
    """The file that breaks ``agent`` while it exists in ``folder`` (:data:`FLAG_DIR_ENV`)."""
    return os.path.join(folder, agent.replace(os.sep, "_"))


def _fault(agent: str) -> tuple[float, bool] | None:
    with _lock:
        found = _broken.get(agent)
    if found is None and _flag_dir is not None and os.path.exists(flag_path(_flag_dir, agent)):
        return (FLAG_FAIL_AFTER_S, False)
    return found


@dataclass
class _Swallowed:
    """A post that was never sent: FAILED from ``fail_at`` on."""

    fail_at: float


@dataclass
class _Delivered:
    """A post that was sent (``inner``: the tcp transfer) and reports FAILED once done."""

    inner: Any


class FlakyTcpBackend(TcpBackend):
    """``tcp`` that fails on command (module docstring)."""

    name = "flaky"

    def _add_peer(self, name: str, metadata: bytes) -> None:
        if _fault(self.agent_name) is not None:
            raise PeerError(f"injected fault: agent {self.agent_name!r} cannot reach {name!r}")
        super()._add_peer(name, metadata)

    def _submit(
        self,
        op: XferOp,
        pair: PreparedPair,
        local_idx: np.ndarray,
        remote_idx: np.ndarray,
        notification: bytes | None,
        handle: TransferHandle,
    ) -> Any:
        fault = _fault(self.agent_name)
        if fault is None:
            return super()._submit(op, pair, local_idx, remote_idx, notification, handle)
        with _lock:
            swallowed[self.agent_name] = swallowed.get(self.agent_name, 0) + 1
        if fault[1]:
            return _Delivered(
                super()._submit(op, pair, local_idx, remote_idx, notification, handle)
            )
        return _Swallowed(time.monotonic() + fault[0])

    def _submit_pages(
        self,
        op: XferOp,
        pair: PreparedPair,
        chunk: PageChunk,
        notification: bytes | None,
        handle: TransferHandle,
    ) -> Any:
        """A chunk in page form, when a test declares ``page_writes`` (the class's
        ``capabilities``): counted in :data:`paged`, then moved as its rows."""
        with _lock:
            paged[self.agent_name] = paged.get(self.agent_name, 0) + 1
        return self._submit(op, pair, *chunk.rows(), notification, handle)

    def _poll(self, handle: TransferHandle) -> XferState:
        if isinstance(handle.state, _Swallowed):
            if time.monotonic() < handle.state.fail_at:
                return XferState.PENDING
            handle.error = "injected fault: endpoint broken (nothing was sent)"
            return XferState.FAILED
        if isinstance(handle.state, _Delivered):
            x = handle.state.inner  # the tcp transfer (its status is set by tcp's I/O thread)
            if x.status is XferState.PENDING:
                return XferState.PENDING
            handle.error = (
                "injected fault: reported failed after delivery"
                if x.status is XferState.DONE
                else x.error
            )
            return XferState.FAILED
        return super()._poll(handle)

    def _release(self, handle: TransferHandle) -> None:
        if not isinstance(handle.state, _Swallowed | _Delivered):
            super()._release(handle)


@hookimpl
def kvwire_transfer_backends() -> list[Implementation]:
    """The ``flaky`` test backend."""
    return [
        Implementation(
            "flaky",
            "kvwire.testing.flaky:FlakyTcpBackend",
            "tcp that fails on command (tests of failover only)",
            priority=-100,
        )
    ]
