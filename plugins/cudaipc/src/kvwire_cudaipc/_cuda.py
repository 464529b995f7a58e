"""The few CUDA driver calls the backend needs, through NVIDIA's ``cuda-bindings``.

Why ``cuda-bindings`` (``cuda.bindings.driver``): it is NVIDIA's own maintained Python
binding of the driver API, installed with every CUDA build of torch (a torch dependency, so no
new package), and it exposes exactly the calls an IPC importer needs: the allocation that holds
a pointer (``cuMemGetAddressRange``), exporting it (``cuIpcGetMemHandle``) and opening it in
another process on the writing device with lazy peer access (``cuIpcOpenMemHandle``). torch's
own IPC works on storages (this backend gets raw registered regions), and CuPy would be a
large extra dependency for four calls.

Every function raises :class:`~kvwire.errors.ConfigError` naming the call and the driver's
error name. Called on the control path only (registration, handshake, peer removal, close),
with the device's primary context current (torch makes it current).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
from typing import Any

from kvwire.errors import ConfigError

#: Bytes of a CUDA IPC memory handle (``CUipcMemHandle``).
HANDLE_BYTES = 64


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise ConfigError(
            "the cudaipc backend needs NVIDIA's cuda-bindings (installed with CUDA builds of "
            "torch): pip install cuda-bindings"
        ) from exc
    return driver


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ConfigError("the cudaipc backend needs torch with CUDA for VRAM regions") from exc
    return torch


def _check(result: Any, call: str) -> Any:
    """Unpack a cuda-bindings result tuple ``(err, *values)``; raise on an error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise ConfigError(f"{call} failed: {getattr(err, 'name', err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _handle_bytes(handle: Any) -> bytes:
    if hasattr(handle, "reserved"):
        raw = handle.reserved
        return bytes(b & 0xFF for b in raw) if not isinstance(raw, bytes) else raw
    return ctypes.string_at(handle.getPtr(), HANDLE_BYTES)


def _handle_from_bytes(raw: bytes) -> Any:
    drv = _driver()
    handle = drv.CUipcMemHandle()
    if len(raw) != HANDLE_BYTES:
        raise ConfigError(f"a CUDA IPC handle has {HANDLE_BYTES} bytes, got {len(raw)}")
    if hasattr(handle, "reserved"):
        handle.reserved = raw
    else:
        ctypes.memmove(handle.getPtr(), raw, HANDLE_BYTES)
    return handle


def host_identity() -> dict[str, str]:
    """This host's identity: its boot id (differs between hosts, and between boots) and its
    hostname. Two processes may share GPU memory only if both match."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return {"boot_id": boot, "hostname": socket.gethostname()}


def cuda_problem() -> str | None:
    """Why this process cannot use a CUDA device, or None. Cheap where there is no GPU (no
    ``/dev/nvidia*`` device node: torch is not imported)."""
    if not any(os.path.exists(f"/dev/{d}") for d in ("nvidiactl", "nvidia0", "dxg")):
        return "no CUDA device on this host (no /dev/nvidia* device node)"
    try:
        torch = _torch()
    except ConfigError as exc:
        return str(exc)
    if not torch.cuda.is_available():
        return "no CUDA device visible to this process (torch.cuda.is_available() is False)"
    return None


def p2p_problem(writer: int, owner: int) -> str | None:
    """Why device ``writer`` cannot store into device ``owner`` peer to peer, or None."""
    if writer == owner:
        return None
    if not _torch().cuda.can_device_access_peer(writer, owner):
        return f"no P2P from cuda:{writer} to cuda:{owner} (no NVLink/PCIe peer access)"
    return None


def device_uuid(ordinal: int) -> str:
    """The UUID of visible CUDA device ``ordinal`` (as torch reports it)."""
    torch = _torch()
    return str(torch.cuda.get_device_properties(ordinal).uuid)


def visible_uuids() -> dict[str, int]:
    """UUID -> ordinal of every CUDA device this process sees."""
    torch = _torch()
    if not torch.cuda.is_available():
        return {}
    return {device_uuid(i): i for i in range(torch.cuda.device_count())}


def export(ordinal: int, addr: int) -> tuple[bytes, int, int]:
    """``(handle, offset, allocation bytes)`` of the allocation holding ``addr`` on device
    ``ordinal``: a peer opens ``handle`` and adds ``offset`` to reach ``addr``."""
    torch = _torch()
    if not torch.cuda.is_available():
        raise ConfigError(
            "cudaipc: a VRAM region was registered but torch sees no CUDA device; CUDA IPC "
            "needs a GPU (host memory alone works without one)"
        )
    drv = _driver()
    with torch.cuda.device(ordinal):
        _current(ordinal)
        base, size = _check(drv.cuMemGetAddressRange(addr), "cuMemGetAddressRange")
        handle = _check(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
    return _handle_bytes(handle), addr - int(base), int(size)


def _current(ordinal: int) -> None:
    """Make device ``ordinal``'s primary context current in this thread, for the driver calls
    that follow (a handshake thread that never touched the device has none: torch skips its
    device switch when the device is already its current one, and ``cuIpcOpenMemHandle``
    then failed with CUDA_ERROR_INVALID_CONTEXT where the peer's memory is on this rank's own
    GPU). Called inside ``torch.cuda.device(ordinal)``."""
    from cuda.bindings import runtime

    _torch().cuda.current_stream()
    _check(runtime.cudaSetDevice(ordinal), "cudaSetDevice")


def enable_peer_access(writer: int, owner: int) -> None:
    """Let device ``writer`` store into memory of device ``owner`` (a no-op when they are the
    same device or access is already enabled); ConfigError if the pair has no P2P."""
    if writer == owner:
        return
    torch = _torch()
    if not torch.cuda.can_device_access_peer(writer, owner):
        raise ConfigError(
            f"cuda:{writer} cannot access cuda:{owner} peer to peer (no NVLink/PCIe P2P "
            "between them); use another backend (nixl) for this link"
        )
    from cuda.bindings import runtime

    with torch.cuda.device(writer):
        torch.cuda.current_stream()
        # The bindings' runtime keeps its own current device: name the writer there too.
        _check(runtime.cudaSetDevice(writer), "cudaSetDevice")
        (err,) = runtime.cudaDeviceEnablePeerAccess(owner, 0)
    if int(err) not in (0, int(runtime.cudaError_t.cudaErrorPeerAccessAlreadyEnabled)):
        raise ConfigError(f"cudaDeviceEnablePeerAccess(cuda:{writer} -> cuda:{owner}): {err}")
    runtime.cudaGetLastError()  # clear a sticky "already enabled"


class OpenedHandles:
    """IPC handles opened in this process, shared by every backend in it and refcounted:
    CUDA maps one allocation once per process and device, so two peers (or two regions) on
    one allocation reuse one mapping. Any thread; one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[bytes, int], list[int]] = {}  # -> [ptr, refs]

    def open(self, raw: bytes, ordinal: int) -> int:
        """Map the allocation of ``raw`` into device ``ordinal``'s context; its base."""
        key = (raw, ordinal)
        with self._lock:
            entry = self._open.get(key)
            if entry is not None:
                entry[1] += 1
                return entry[0]
            torch = _torch()
            drv = _driver()
            flags = int(drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            with torch.cuda.device(ordinal):
                _current(ordinal)
                ptr = int(
                    _check(
                        drv.cuIpcOpenMemHandle(_handle_from_bytes(raw), flags),
                        "cuIpcOpenMemHandle",
                    )
                )
            self._open[key] = [ptr, 1]
            return ptr

    def close(self, raw: bytes, ordinal: int) -> None:
        """Drop one reference; unmap at the last. The caller has synchronised every stream
        that could still store into it."""
        key = (raw, ordinal)
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._open[key]
            torch = _torch()
            drv = _driver()
            with torch.cuda.device(ordinal):
                _current(ordinal)
                _check(drv.cuIpcCloseMemHandle(entry[0]), "cuIpcCloseMemHandle")


#: The process's opened handles.
OPENED = OpenedHandles()


def pid() -> int:
    """This process's id (a peer in the same process uses addresses as they are)."""
    return os.getpid()
