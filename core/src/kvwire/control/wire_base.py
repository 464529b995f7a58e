"""The base of the control-plane wire schema (:mod:`kvwire.control.wire`): the message base
class, the page-index encoding, and the leniency that lets strict layout models read what a
newer peer sends. Kept apart so that :mod:`kvwire.control.wire` holds the messages themselves.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict

from kvwire.errors import ProtocolError
from kvwire.layout import (
    BufferGroup,
    GroupSection,
    KVLayout,
    MemoryRegion,
    ModelSpec,
    RankPosition,
)


class Message(BaseModel):
    """Base of every control message. Unknown fields (from newer peers) are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    kind: ClassVar[str] = ""


def pages_to_bytes(pages: NDArray[np.int64]) -> bytes:
    """Page indices as little-endian int64 bytes (compact on the wire)."""
    return np.ascontiguousarray(pages, dtype="<i8").tobytes()


def pages_from_bytes(raw: bytes, what: str = "page indices") -> NDArray[np.int64]:
    """Inverse of :func:`pages_to_bytes`; refuses a length that is not a multiple of 8."""
    if len(raw) % 8:
        raise ProtocolError(f"{what}: {len(raw)} bytes is not a whole number of int64 values")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


def known_fields(cls: type[BaseModel], data: Any) -> Any:
    """Drop keys ``cls`` does not know from ``data`` (and from nested layout models), so that
    strict models such as :class:`KVLayout` accept what a newer peer sends."""
    if not isinstance(data, dict):
        return data
    nested: dict[str, type[BaseModel]] = _NESTED.get(cls, {})
    out = {}
    for k, v in data.items():
        if k not in cls.model_fields:
            continue
        sub = nested.get(k)
        if sub is not None:
            v = (
                [known_fields(sub, x) for x in v]
                if isinstance(v, list | tuple)
                else (known_fields(sub, v))
            )
        out[k] = v
    return out


_NESTED: dict[type[BaseModel], dict[str, type[BaseModel]]] = {
    KVLayout: {
        "model": ModelSpec,
        "rank": RankPosition,
        "buffers": MemoryRegion,
        "groups": BufferGroup,
    },
    BufferGroup: {"buffers": MemoryRegion, "sections": GroupSection},
}
