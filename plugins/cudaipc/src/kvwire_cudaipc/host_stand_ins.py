"""Host stand-ins for ``cudaipc``'s CUDA calls, so its VRAM page-write path runs on a host
without a GPU: regions flagged VRAM over host memory, the exports, device UUIDs and events
played on the host, and a page mover given by the caller. For the plugin's tests and CPU
benches (``scripts/cudaipc_submit_bench.py``) only: CUDA IPC itself cannot run without a GPU,
so this is a fake of that alone, never imported by the backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvwire.layout import MemKind, MemoryRegion


class HostEvent:
    """A CUDA event stand-in: the stand-in movers finish synchronously, so it is always done."""

    def __init__(self, **kwargs: object) -> None:
        pass

    def record(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def install(setattr_: Callable[[Any, str, Any], None], pages: Any) -> None:
    """Replace ``cudaipc``'s CUDA calls with host stand-ins through ``setattr_`` (a test's
    ``monkeypatch.setattr``, which undoes them; or ``setattr`` in a bench process): exports
    whose handle is the address, one stand-in device, torch's CUDA events by
    :class:`HostEvent`, and ``pages`` as every backend's page mover (its ``copy_pages`` and
    ``copy_batch`` are what a launch calls). Imports torch."""
    import torch

    import kvwire_cudaipc.backend as backend_mod
    from kvwire_cudaipc import _cuda

    setattr_(_cuda, "export", lambda dev, addr: (addr.to_bytes(8, "little") * 8, 0, 1 << 46))
    setattr_(_cuda, "device_uuid", lambda i: "GPU-stand-in")
    setattr_(_cuda, "visible_uuids", lambda: {"GPU-stand-in": 0})

    def ensure(self: Any) -> None:
        self._pages = pages

    setattr_(backend_mod.CudaIpcBackend, "_ensure_gpu", ensure)
    setattr_(torch.cuda, "Event", HostEvent)


def vram_regions(arrays: Sequence[np.ndarray]) -> list[MemoryRegion]:
    """Host arrays registered as VRAM regions of device 0 (rows of ``array[0].nbytes``)."""
    return [
        MemoryRegion.from_pointer(a.ctypes.data, a.nbytes, a[0].nbytes, MemKind.VRAM, 0)
        for a in arrays
    ]
