"""The metadata envelope backends publish through the handshake.

A backend's :meth:`~kvwire.backend.TransferBackend.local_metadata` is opaque to the control
plane, but every backend needs the same outer checks when a peer's bytes come back in
``add_peer``: valid msgpack, produced by the same kind of backend, in a version this side reads.
:func:`pack_metadata` and :func:`unpack_metadata` do that once; the backend checks its own fields.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgpack

from kvwire.layout import MemKind, MemoryRegion


def pack_metadata(backend: str, version: int, **fields: Any) -> bytes:
    """``fields`` with the backend name and metadata version, msgpack-encoded."""
    packed: bytes = msgpack.packb({"v": version, "backend": backend, **fields}, use_bin_type=True)
    return packed


def unpack_metadata(raw: bytes, backend: str, version: int, reader: str) -> dict[str, Any]:
    """Decode a peer's metadata; ``ValueError`` naming what is wrong (``reader`` says which
    software reads it, for the version message)."""
    try:
        meta = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"{backend} backend metadata is not valid msgpack: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("backend") != backend:
        raise ValueError(f"metadata was not produced by a {backend} backend agent")
    if meta.get("v") != version:
        raise ValueError(
            f"{backend} metadata version {meta.get('v')!r}; this {reader} reads {version}"
        )
    return meta


def region_rows(regions: Iterable[MemoryRegion]) -> list[list[int]]:
    """Registered regions as ``[addr, length, device, kind]`` rows for the metadata."""
    return [[r.addr, r.length, r.device_id, int(r.kind)] for r in regions]


def regions_from_rows(rows: Any, backend: str, peer: str) -> list[MemoryRegion]:
    """A peer's published regions back from :func:`region_rows`; ``ValueError`` naming the
    backend and peer when they are malformed."""
    if not isinstance(rows, list | tuple) or not all(
        isinstance(r, list | tuple) and len(r) == 4 and all(type(v) is int for v in r) for r in rows
    ):
        raise ValueError(
            f"{backend} metadata regions must be a list of [addr, length, device, kind] ints"
        )
    try:
        return [
            MemoryRegion(addr=a, length=n, item_len=1, kind=MemKind(k), device_id=d)
            for a, n, d, k in rows
        ]
    except ValueError as exc:
        raise ValueError(f"{backend} metadata of {peer!r} holds an invalid region: {exc}") from exc
