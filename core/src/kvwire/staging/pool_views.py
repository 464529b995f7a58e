"""Byte views of a rank's KV buffers built from its layout alone (each region's address,
length, memory kind and device), for bulk staging when the engine does not hand its KV
tensors to :class:`~kvwire.session.manager.KVManager` (``kv_tensors=None``): the vLLM and
SGLang adapters build their layouts from the engine's caches and pass no tensors.

A host region becomes a NumPy ``uint8`` array over its memory; a GPU region a ``torch``
``uint8`` tensor over its device memory, through the CUDA array interface (no copy, no
allocation). The views alias the engine's memory and stay valid as long as the layout does
(the engine keeps its caches registered for the manager's lifetime). Called once per rank by
:meth:`kvwire.staging.bulk.BulkStaging.setup`, on the thread that builds the manager.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvwire.errors import ConfigError
from kvwire.layout import KVLayout
from kvwire.regions import MemKind, MemoryRegion

__all__ = ["layout_views"]


class _DeviceBytes:
    """``length`` bytes of device memory at ``addr``, described by the CUDA array interface
    (version 2: no stream to synchronise with; the memory is the engine's, already written)."""

    def __init__(self, addr: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 2,
        }


def _host_view(region: MemoryRegion) -> np.ndarray[Any, np.dtype[np.uint8]]:
    buf = (ctypes.c_uint8 * region.length).from_address(region.addr)
    return np.ctypeslib.as_array(buf)


def _device_view(region: MemoryRegion) -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - GPU pools come with torch
        raise ConfigError(
            "bulk staging on a GPU pool views its buffers with torch; install it"
        ) from exc
    device = torch.device("cuda", region.device_id)
    try:
        with torch.cuda.device(device):
            view = torch.as_tensor(_DeviceBytes(region.addr, region.length), device=device)
    except Exception as exc:  # no CUDA here, or not that device's memory
        raise ConfigError(
            f"bulk staging cannot view GPU buffer {region.addr:#x} ({region.length} bytes) on "
            f"cuda:{region.device_id}: {exc}; pass the KV tensors (KVManager(kv_tensors=...))"
        ) from exc
    if view.data_ptr() != region.addr:  # pragma: no cover - torch aliases the memory
        raise ConfigError(f"bulk staging: a view of GPU buffer {region.addr:#x} is a copy")
    return view


def layout_views(layout: KVLayout) -> list[Any]:
    """One flat byte view per KV buffer of ``layout``, in its order (what
    :class:`~kvwire.staging.kernels.KVTensors` takes in place of the engine's tensors)."""
    return [_device_view(r) if r.kind == MemKind.VRAM else _host_view(r) for r in layout.buffers]
