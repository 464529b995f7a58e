"""Run a transfer backend agent in a separate OS process and drive it over a pipe.

Transfers that only ever run inside one process can hide bugs (shared address spaces, one
GIL, one engine instance doing both sides). :class:`RemoteAgent` starts a child process with
the ``spawn`` start method (engines such as NIXL or UCX are not fork-safe), creates the
backend there through :func:`kvwire.selection.create_backend`, and serves simple commands
sent over a :func:`multiprocessing.Pipe`::

    with RemoteAgent("tcp", {}, "target") as target:
        buf = target.allocate("kv", 1 << 20, fill=7)          # random bytes, seed 7
        peer = local_backend.add_peer(target.metadata())
        ...                                                   # WRITE into buf.addr..buf.end
        notes = target.notifications(timeout=5, expect=1)
        assert notes[0].digests["kv"] == digest(expected_bytes)

The child owns NumPy ``uint8`` buffers registered with its backend. While waiting for
commands it calls ``backend.progress()`` and drains ``backend.get_notifications()`` about
every millisecond (some engines need a progress owner). When it drains a notification it
immediately snapshots every *watched* buffer (copies it, then digests the copy), so a test
can prove the data of a transfer had landed before its notification was delivered. For large
buffers, watch with a ``stride``: only every ``stride``-th byte is copied, which takes
microseconds, so bytes still in flight when the notification was drained are caught before
they can land during a long copy.

The child can also act as an initiator (``add_peer``/``prepare``/``submit``/``poll``), so
both directions of WRITE and READ can be tested. Every call has a timeout; a child that died
(or was killed with :meth:`RemoteAgent.kill`) makes calls raise :class:`RemoteAgentDiedError`
instead of hanging. Exceptions raised by the backend in the child are re-raised in the
parent with their original type when they can be pickled (e.g. ``DescriptorError``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Self

import numpy as np
from numpy.typing import NDArray

from kvwire.testing.remote_child import agent_main
from kvwire.testing.remote_common import (
    POLL_INTERVAL_S,
    Fill,
    RemoteAgentDiedError,
    RemoteAgentError,
    RemoteAgentTimeoutError,
    RemoteBuffer,
    RemoteCallError,
    RemoteNotification,
    digest,
    fill_bytes,
    sampled_digest,
)

# The harness's public import path: the conformance suite, the benches and plugins' tests take
# the agent together with its errors, buffers and digests from here (their definitions live in
# kvwire.testing.remote_common, shared with the child process).
__all__ = [
    "DEFAULT_CALL_TIMEOUT_S",
    "DEFAULT_START_TIMEOUT_S",
    "Fill",
    "RemoteAgent",
    "RemoteAgentDiedError",
    "RemoteAgentError",
    "RemoteAgentTimeoutError",
    "RemoteBuffer",
    "RemoteCallError",
    "RemoteNotification",
    "digest",
    "fill_bytes",
    "sampled_digest",
]

logger = logging.getLogger(__name__)

#: Default seconds a command may take before :class:`RemoteAgentTimeoutError` is raised.
DEFAULT_CALL_TIMEOUT_S = 30.0
#: Default seconds the child may take to import kvwire and create its backend.
DEFAULT_START_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------- parent side
class RemoteAgent:
    """A backend agent in a spawned child process, driven by commands over a pipe.

    Use it as a context manager (or call :meth:`start` and :meth:`close`). Methods mirror the
    :class:`~kvwire.backend.TransferBackend` API where the child acts as an initiator, with
    integer ids standing for prepared pairs and handles. Not meant to be shared between
    threads beyond its internal lock (one command in flight at a time).
    """

    def __init__(
        self,
        backend_name: str,
        options: dict[str, Any] | None = None,
        agent_name: str | None = None,
        *,
        call_timeout: float = DEFAULT_CALL_TIMEOUT_S,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        self.backend_name = backend_name
        self.options = dict(options or {})
        self.agent_name = agent_name or f"remote-{uuid.uuid4().hex[:8]}"
        self.call_timeout = call_timeout
        self.start_timeout = start_timeout
        self._mp = multiprocessing.get_context("spawn")
        self._proc: Any = None
        self._conn: Connection | None = None
        self._info: dict[str, Any] | None = None
        self._seq = itertools.count(1)
        self._lock = threading.RLock()
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Self:
        """Spawn the child (returns at once; the first call waits until it is ready)."""
        if self._proc is not None:
            return self
        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        self._proc = self._mp.Process(
            target=agent_main,
            args=(child_conn, self.backend_name, self.options, self.agent_name),
            name=f"kvwire-remote-{self.agent_name}",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        self._conn = parent_conn
        logger.debug("spawned remote agent %s (pid %s)", self.agent_name, self._proc.pid)
        return self

    def __enter__(self) -> Self:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self) -> dict[str, Any]:
        """Wait until the child created its backend; return its info (pid, capabilities)."""
        with self._lock:
            if self._info is None:
                if self._proc is None:
                    self.start()
                self._info = self._receive(0, "startup", self.start_timeout)
            return self._info

    @property
    def info(self) -> dict[str, Any]:
        """``pid``, ``backend``, ``agent_name`` and ``capabilities`` of the child's backend."""
        return self.wait_ready()

    @property
    def pid(self) -> int | None:
        """The child's process id (None before :meth:`start`)."""
        return None if self._proc is None else int(self._proc.pid)

    @property
    def alive(self) -> bool:
        """Whether the child process is running."""
        return self._proc is not None and bool(self._proc.is_alive())

    def kill(self) -> None:
        """SIGKILL the child (a peer dying mid-transfer) and reap it."""
        if self._proc is None:
            return
        if self._proc.is_alive():
            logger.debug("killing remote agent %s (pid %s)", self.agent_name, self._proc.pid)
            self._proc.kill()
        self._proc.join(timeout=10)

    def suspend(self) -> None:
        """SIGSTOP the child: it keeps its sockets but answers nothing until :meth:`resume`."""
        self.wait_ready()
        os.kill(self._require_proc().pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a child stopped by :meth:`suspend`."""
        os.kill(self._require_proc().pid, signal.SIGCONT)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to close its backend and exit; kill it if it does not. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            proc, conn = self._proc, self._conn
            if proc is None or conn is None:
                return
            if proc.is_alive():
                try:
                    if self._info is None:
                        self._info = self._receive(0, "startup", self.start_timeout)
                    seq = next(self._seq)
                    conn.send((seq, "close", (), {}))
                    self._receive(seq, "close", timeout)
                except Exception as exc:  # startup failed, child stuck or gone: kill below
                    logger.debug("remote agent %s: clean close failed: %s", self.agent_name, exc)
                proc.join(timeout=timeout)
            if proc.is_alive():
                logger.warning("remote agent %s did not exit; killing it", self.agent_name)
                self.kill()
            conn.close()

    # ---------------------------------------------------------------------- calls
    def _require_proc(self) -> Any:
        if self._proc is None:
            raise RemoteAgentError(f"remote agent {self.agent_name!r} was not started")
        return self._proc

    def _died(self, what: str) -> RemoteAgentDiedError:
        proc = self._require_proc()
        proc.join(timeout=1)
        code = proc.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how = f"killed by {signal.Signals(-code).name}"
        return RemoteAgentDiedError(
            f"remote agent {self.agent_name!r} (pid {proc.pid}, backend {self.backend_name!r}) "
            f"is gone ({how}) while waiting for {what!r}"
        )

    def _receive(self, seq: int, what: str, timeout: float) -> Any:
        proc = self._require_proc()
        conn = self._conn
        assert conn is not None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RemoteAgentTimeoutError(
                    f"remote agent {self.agent_name!r} (pid {proc.pid}) did not answer "
                    f"{what!r} within {timeout:g}s"
                )
            try:
                ready = conn.poll(min(remaining, 0.05))
                msg = conn.recv() if ready else None
            except (EOFError, OSError) as exc:
                raise self._died(what) from exc
            if msg is None:
                if not proc.is_alive() and not conn.poll(0):
                    raise self._died(what)
                continue
            if msg[0] != seq:
                logger.debug("remote agent %s: dropping stale reply %s", self.agent_name, msg[0])
                continue
            if msg[1] == "ok":
                return msg[2]
            _, _, remote_exc, type_name, text, tb = msg
            if isinstance(remote_exc, BaseException):
                remote_exc.add_note(f"raised in remote agent {self.agent_name!r}:\n{tb}")
                raise remote_exc
            raise RemoteCallError(
                f"{what} failed in remote agent {self.agent_name!r}: {type_name}: {text}\n{tb}"
            )

    def call(self, cmd: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run command ``cmd`` in the child; the building block of every other method."""
        with self._lock:
            if self._closed:
                raise RemoteAgentError(f"remote agent {self.agent_name!r} is closed")
            self.wait_ready()
            proc = self._require_proc()
            if not proc.is_alive():
                raise self._died(cmd)
            seq = next(self._seq)
            assert self._conn is not None
            try:
                self._conn.send((seq, cmd, args, kwargs))
            except (OSError, ValueError) as exc:
                raise self._died(cmd) from exc
            return self._receive(seq, cmd, self.call_timeout if timeout is None else timeout)

    def ping(self) -> int:
        """Round-trip a no-op; returns the child's pid."""
        return int(self.call("ping"))

    def allocate(
        self,
        name: str,
        nbytes: int,
        fill: Fill = None,
        *,
        register: bool = True,
        region_offset: int = 0,
        region_length: int | None = None,
        watch: bool = True,
    ) -> RemoteBuffer:
        """Create a ``uint8`` buffer in the child, filled as :func:`fill_bytes` says.

        With ``register`` the span ``[region_offset, region_offset + region_length)`` (the
        whole buffer by default) is registered with the child's backend; bytes outside it
        are guard bytes a transfer must never touch. A ``watch``-ed buffer's digest is
        snapshotted whenever the child drains a notification. Call :meth:`metadata` again
        afterwards: peers only see regions registered before they loaded the metadata.
        """
        result: RemoteBuffer = self.call(
            "allocate", name, nbytes, fill, register, region_offset, region_length, watch
        )
        return result

    def free(self, name: str) -> None:
        """Deregister (if registered) and drop a buffer."""
        self.call("free", name)

    def watch(
        self,
        name: str,
        enabled: bool = True,
        offset: int = 0,
        length: int | None = None,
        stride: int = 1,
    ) -> None:
        """Start (or stop) snapshotting a buffer whenever the child drains a notification:
        the span ``[offset, offset + length)``, every ``stride``-th byte of it (see
        :func:`sampled_digest`)."""
        self.call("watch", name, enabled, offset, length, stride)

    def metadata(self) -> bytes:
        """The child backend's ``local_metadata()``."""
        return bytes(self.call("metadata"))

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset + length)`` of a buffer (to its end by default)."""
        return bytes(self.call("read", name, offset, length))

    def read_array(
        self, name: str, offset: int = 0, length: int | None = None
    ) -> NDArray[np.uint8]:
        """Like :meth:`read`, as a writable NumPy ``uint8`` array."""
        return np.frombuffer(bytearray(self.read(name, offset, length)), dtype=np.uint8)

    def digest(self, name: str, offset: int = 0, length: int | None = None) -> str:
        """:func:`digest` of a span of a buffer, computed in the child (no copy over the pipe)."""
        return str(self.call("digest", name, offset, length))

    def write(self, name: str, data: bytes | NDArray[np.uint8], offset: int = 0) -> None:
        """Overwrite bytes of a buffer from the test process."""
        payload = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        self.call("write", name, payload, offset)

    def notifications(
        self,
        timeout: float = 5.0,
        expect: int | None = None,
        progress: Callable[[], None] | None = None,
    ) -> list[RemoteNotification]:
        """Notifications the child drained, collected for up to ``timeout`` seconds.

        Returns as soon as ``expect`` notifications were collected (if given), else after the
        whole ``timeout``. ``progress`` (e.g. the local backend's ``progress``) is called
        while waiting, for engines that need the initiator's owner loop to run too.
        """
        out: list[RemoteNotification] = []
        deadline = time.monotonic() + timeout
        while True:
            if progress is not None:
                progress()
            out.extend(self.call("notifications"))
            if expect is not None and len(out) >= expect:
                return out
            if time.monotonic() >= deadline:
                return out
            time.sleep(0.002)

    def add_peer(self, metadata: bytes) -> str:
        """``add_peer`` in the child; returns the peer's name."""
        return str(self.call("add_peer", metadata))

    def remove_peer(self, peer: str) -> None:
        """``remove_peer`` in the child."""
        self.call("remove_peer", peer)

    def peers(self) -> list[str]:
        """``peers()`` of the child's backend."""
        return list(self.call("peers"))

    def prepare(self, peer: str, local_table: Any, remote_table: Any) -> int:
        """``prepare`` in the child; returns an id for the prepared pair."""
        return int(self.call("prepare", peer, local_table, remote_table))

    def release_prepared(self, pair_id: int) -> None:
        """``release_prepared`` in the child."""
        self.call("release_prepared", pair_id)

    def submit(
        self,
        op: Any,
        pair_id: int,
        local_idx: Any,
        remote_idx: Any,
        notification: bytes | None = None,
    ) -> int:
        """``submit`` in the child (it is the initiator); returns a handle id."""
        return int(self.call("submit", op, pair_id, local_idx, remote_idx, notification))

    def poll(self, handle_id: int) -> tuple[Any, str | None]:
        """``poll`` in the child: the state exactly as the backend returned it, and the
        handle's ``error``."""
        state, error = self.call("poll", handle_id)
        return state, error

    def wait(
        self,
        handle_id: int,
        timeout: float = 60.0,
        progress: Callable[[], None] | None = None,
    ) -> tuple[Any, str | None]:
        """Poll a child-side handle until it is terminal or ``timeout`` passed (then the
        last state, PENDING, is returned)."""
        from kvwire.backend import XferState

        deadline = time.monotonic() + timeout
        while True:
            if progress is not None:
                progress()
            state, error = self.poll(handle_id)
            if state != XferState.PENDING or time.monotonic() >= deadline:
                return state, error
            time.sleep(POLL_INTERVAL_S)

    def release(self, handle_id: int) -> None:
        """``release`` in the child."""
        self.call("release", handle_id)

    def attribute(self, name: str) -> Any:
        """A (picklable) attribute of the child's backend, e.g. ``live_handles``."""
        return self.call("attribute", name)
