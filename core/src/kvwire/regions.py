"""Memory regions: the registered buffers of a rank's pools, and the dtypes they may hold.

Built by the engine side of either role when it describes its pools (:mod:`kvwire.layout`
holds what the regions are *for*); registered with the transfer backend by the session layer.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvwire.errors import LayoutError

ADDR_LIMIT = 1 << 64

#: Bytes per element of the dtypes a KV pool may use.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
}


class MemKind(enum.IntEnum):
    """Where a region lives: host memory or device memory."""

    DRAM = 0
    VRAM = 1


_FROZEN = ConfigDict(frozen=True, extra="forbid")


class MemoryRegion(BaseModel):
    """One registered buffer: ``length`` bytes at ``addr``, cut into slots of ``item_len`` bytes.

    Built by the engine side of either role (prefill or decode) when it describes its KV pool,
    with :meth:`from_pointer` or :meth:`from_tensor`.
    """

    model_config = _FROZEN

    addr: int = Field(ge=0, lt=ADDR_LIMIT, description="Base address (unsigned 64-bit).")
    length: int = Field(description="Length in bytes.")
    item_len: int = Field(description="Bytes per page slot.")
    kind: MemKind = MemKind.DRAM
    device_id: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.length <= 0:
            raise LayoutError(f"region at {self.addr:#x} has length {self.length}; it must be > 0")
        if self.item_len <= 0:
            raise LayoutError(
                f"region at {self.addr:#x} has item_len {self.item_len}; it must be > 0 "
                "(item_len is the number of bytes of one page slot)"
            )
        if self.length % self.item_len:
            raise LayoutError(
                f"region at {self.addr:#x}: length {self.length} is not a multiple of "
                f"item_len {self.item_len}; pass the slot size that divides the buffer"
            )
        if self.addr + self.length > ADDR_LIMIT:
            raise LayoutError(f"region at {self.addr:#x} + {self.length} bytes overflows 64 bits")
        return self

    @property
    def end(self) -> int:
        """One past the last byte of the region."""
        return self.addr + self.length

    @property
    def num_items(self) -> int:
        """Number of page slots in the region."""
        return self.length // self.item_len

    @classmethod
    def from_pointer(
        cls,
        addr: int,
        length: int,
        item_len: int,
        kind: MemKind = MemKind.DRAM,
        device_id: int = 0,
    ) -> MemoryRegion:
        """Describe a raw buffer (e.g. memory an engine allocated itself)."""
        return cls(addr=addr, length=length, item_len=item_len, kind=kind, device_id=device_id)

    @classmethod
    def from_tensor(cls, tensor: Any, item_len: int | None = None) -> MemoryRegion:
        """Describe a contiguous torch tensor (CPU or CUDA) or NumPy array.

        ``item_len`` defaults to the bytes of one entry along the first dimension, which is the
        page-slot dimension of a KV buffer shaped ``[num_slots, page_size, heads, head_dim]``.

        The region records the address only: keep the tensor alive for as long as the region is
        registered (an engine's KV pool lives as long as the process; a freed tensor would leave
        the backend reading freed memory).
        """
        if hasattr(tensor, "data_ptr") and hasattr(tensor, "element_size"):
            if not tensor.is_contiguous():
                raise LayoutError("tensor is not contiguous; call .contiguous() before registering")
            addr = int(tensor.data_ptr())
            length = int(tensor.numel()) * int(tensor.element_size())
            is_cuda = bool(getattr(tensor, "is_cuda", False))
            kind = MemKind.VRAM if is_cuda else MemKind.DRAM
            device_id = int(tensor.device.index or 0) if is_cuda else 0
            first = int(tensor.shape[0]) if tensor.dim() > 0 else 1
        elif isinstance(tensor, np.ndarray):
            if not tensor.flags.c_contiguous:
                raise LayoutError("array is not C-contiguous; use np.ascontiguousarray first")
            addr = int(tensor.ctypes.data)
            length = int(tensor.nbytes)
            kind, device_id = MemKind.DRAM, 0
            first = int(tensor.shape[0]) if tensor.ndim > 0 else 1
        else:
            raise LayoutError(
                f"cannot build a region from {type(tensor).__name__}; "
                "pass a torch tensor, a NumPy array, or use MemoryRegion.from_pointer"
            )
        if length == 0:
            raise LayoutError("cannot register an empty tensor (0 bytes)")
        if item_len is None:
            item_len = length // max(first, 1)
        return cls(addr=addr, length=length, item_len=item_len, kind=kind, device_id=device_id)


def check_no_overlap(regions: Sequence[MemoryRegion], what: str = "regions") -> None:
    """Raise :class:`LayoutError` if any two of ``regions`` share a byte (same memory space)."""
    if len(regions) < 2:
        return
    keys = np.array([(int(r.kind), r.device_id) for r in regions], dtype=np.int64)
    addr = np.array([r.addr for r in regions], dtype=np.uint64)
    end = np.array([r.end for r in regions], dtype=np.uint64)
    order = np.lexsort((addr, keys[:, 1], keys[:, 0]))
    same_space = np.all(keys[order][1:] == keys[order][:-1], axis=1)
    overlap = same_space & (addr[order][1:] < end[order][:-1])
    if overlap.any():
        i = int(np.argmax(overlap))
        a, b = regions[int(order[i])], regions[int(order[i + 1])]
        raise LayoutError(
            f"{what} overlap: [{a.addr:#x}, {a.end:#x}) and [{b.addr:#x}, {b.end:#x}) "
            f"({a.kind.name} device {a.device_id}); register each byte once"
        )
