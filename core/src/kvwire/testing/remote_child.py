"""The child process of a :class:`~kvwire.testing.remote.RemoteAgent`: it creates the backend,
owns the buffers and serves the parent's pipe commands, driving the backend's progress and
snapshotting watched buffers as notifications are drained (see :mod:`kvwire.testing.remote`).
"""

from __future__ import annotations

import logging
import os
import pickle
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.layout import MemoryRegion
from kvwire.testing.remote_common import (
    POLL_INTERVAL_S,
    Fill,
    RemoteBuffer,
    RemoteNotification,
    digest,
    fill_bytes,
)

logger = logging.getLogger(__name__)


class AgentServer:
    """Runs in the child: owns the backend and the buffers, serves pipe commands."""

    def __init__(self, conn: Connection, backend: Any) -> None:
        self.conn = conn
        self.backend = backend
        self.buffers: dict[str, NDArray[np.uint8]] = {}
        self.regions: dict[str, MemoryRegion | None] = {}
        self.watched: dict[str, tuple[int, int | None, int]] = {}
        self.pairs: dict[int, Any] = {}
        self.handles: dict[int, Any] = {}
        self.notes: list[RemoteNotification] = []

    def serve(self) -> None:
        while True:
            try:
                ready = self.conn.poll(POLL_INTERVAL_S)
            except (EOFError, OSError):
                return
            if ready:
                try:
                    seq, cmd, args, kwargs = self.conn.recv()
                except (EOFError, OSError):
                    return  # parent gone
                if cmd == "close":
                    self._close_backend()
                    self._send((seq, "ok", None))
                    return
                self._send((seq, *self._dispatch(cmd, args, kwargs)))
            self._tick()

    def _send(self, msg: tuple[Any, ...]) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            logger.debug("remote agent: could not send a reply (parent gone?)")

    def _dispatch(self, cmd: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        fn = getattr(self, f"cmd_{cmd}", None)
        if fn is None:
            return ("err", None, "RemoteCallError", f"unknown command {cmd!r}", "")
        try:
            return ("ok", fn(*args, **kwargs))
        except BaseException as exc:
            return error_reply(exc)

    def _tick(self) -> None:
        self.backend.progress()
        notes = self.backend.get_notifications()
        if notes:
            # Copy first (fast, sampled), hash afterwards: the hash is slow for big buffers.
            copies = {
                n: self._span(n, off, length)[::stride].copy()
                for n, (off, length, stride) in self.watched.items()
            }
            digests = {n: digest(c) for n, c in copies.items()}
            for n in notes:
                self.notes.append(RemoteNotification(str(n.peer), bytes(n.payload), digests))

    def _close_backend(self) -> None:
        try:
            self.backend.close()
        except Exception:
            logger.exception("remote agent: backend close failed")

    def _buf(self, name: str) -> NDArray[np.uint8]:
        try:
            return self.buffers[name]
        except KeyError:
            raise KeyError(f"no remote buffer named {name!r}") from None

    def _span(self, name: str, offset: int, length: int | None) -> NDArray[np.uint8]:
        buf = self._buf(name)
        if length is None:
            length = buf.size - offset
        if offset < 0 or length < 0 or offset + length > buf.size:
            raise IndexError(
                f"span [{offset}, {offset + length}) is outside buffer {name!r} of {buf.size} B"
            )
        return buf[offset : offset + length]

    # commands ---------------------------------------------------------------------------
    def cmd_ping(self) -> int:
        return os.getpid()

    def cmd_allocate(
        self,
        name: str,
        nbytes: int,
        fill: Fill,
        register: bool,
        region_offset: int,
        region_length: int | None,
        watch: bool,
    ) -> RemoteBuffer:
        if name in self.buffers:
            raise ValueError(f"a remote buffer named {name!r} already exists")
        buf = fill_bytes(nbytes, fill)
        addr = int(buf.ctypes.data)
        region = None
        if register:
            length = nbytes - region_offset if region_length is None else region_length
            if region_offset < 0 or length <= 0 or region_offset + length > nbytes:
                raise ValueError(
                    f"registered span [{region_offset}, {region_offset + length}) is not inside "
                    f"the {nbytes} B buffer"
                )
            region = MemoryRegion.from_pointer(addr + region_offset, length, item_len=1)
            self.backend.register([region])
        self.buffers[name] = buf
        self.regions[name] = region
        if watch:
            self.watched[name] = (0, None, 1)
        return RemoteBuffer(name, addr, nbytes, region)

    def cmd_free(self, name: str) -> None:
        self._buf(name)
        region = self.regions.pop(name)
        if region is not None:
            self.backend.deregister([region])
        self.watched.pop(name, None)
        del self.buffers[name]

    def cmd_watch(
        self, name: str, enabled: bool, offset: int, length: int | None, stride: int
    ) -> None:
        self._span(name, offset, length)  # validates the span
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        if enabled:
            self.watched[name] = (offset, length, stride)
        else:
            self.watched.pop(name, None)

    def cmd_metadata(self) -> bytes:
        return bytes(self.backend.local_metadata())

    def cmd_read(self, name: str, offset: int, length: int | None) -> bytes:
        return self._span(name, offset, length).tobytes()

    def cmd_digest(self, name: str, offset: int, length: int | None) -> str:
        return digest(self._span(name, offset, length))

    def cmd_write(self, name: str, data: bytes, offset: int) -> None:
        self._span(name, offset, len(data))[:] = np.frombuffer(data, dtype=np.uint8)

    def cmd_notifications(self) -> list[RemoteNotification]:
        self._tick()
        out, self.notes = self.notes, []
        return out

    def cmd_add_peer(self, metadata: bytes) -> str:
        return str(self.backend.add_peer(metadata))

    def cmd_remove_peer(self, peer: str) -> None:
        self.backend.remove_peer(peer)

    def cmd_peers(self) -> list[str]:
        return list(self.backend.peers())

    def cmd_prepare(self, peer: str, local_table: Any, remote_table: Any) -> int:
        pair = self.backend.prepare(peer, local_table, remote_table)
        self.pairs[pair.id] = pair
        return int(pair.id)

    def cmd_release_prepared(self, pair_id: int) -> None:
        self.backend.release_prepared(self._pair(pair_id))

    def _pair(self, pair_id: int) -> Any:
        try:
            return self.pairs[pair_id]
        except KeyError:
            raise KeyError(f"no prepared pair {pair_id} in the remote agent") from None

    def cmd_submit(
        self, op: Any, pair_id: int, local_idx: Any, remote_idx: Any, notification: bytes | None
    ) -> int:
        handle = self.backend.submit(op, self._pair(pair_id), local_idx, remote_idx, notification)
        self.handles[handle.id] = handle
        return int(handle.id)

    def _handle(self, handle_id: int) -> Any:
        try:
            return self.handles[handle_id]
        except KeyError:
            raise KeyError(f"no transfer handle {handle_id} in the remote agent") from None

    def cmd_poll(self, handle_id: int) -> tuple[Any, str | None]:
        handle = self._handle(handle_id)
        self.backend.progress()
        state = self.backend.poll(handle)
        return state, handle.error

    def cmd_release(self, handle_id: int) -> None:
        self.backend.release(self._handle(handle_id))

    def cmd_attribute(self, name: str) -> Any:
        return getattr(self.backend, name)


def error_reply(exc: BaseException) -> tuple[Any, ...]:
    tb = "".join(traceback.format_exception(exc))
    try:
        payload: BaseException | None = pickle.loads(pickle.dumps(exc))
    except Exception:
        payload = None
    return ("err", payload, type(exc).__name__, str(exc), tb)


def agent_main(
    conn: Connection, backend_name: str, options: dict[str, Any], agent_name: str
) -> None:
    """Entry point of the child process (must stay importable at module level for spawn)."""
    from kvwire.config import KVWireConfig
    from kvwire.selection import create_backend

    try:
        config = KVWireConfig(transfer_backend=backend_name, transfer_backend_options=options)
        backend = create_backend(config, agent_name, need=())
    except BaseException as exc:
        conn.send((0, *error_reply(exc)))
        return
    info = {
        "pid": os.getpid(),
        "backend": backend.name,
        "agent_name": backend.agent_name,
        "capabilities": backend.capabilities.model_dump(),
    }
    conn.send((0, "ok", info))
    server = AgentServer(conn, backend)
    try:
        server.serve()
    finally:
        if not backend.closed:
            server._close_backend()
        logger.debug("remote agent %s: exiting", agent_name)
