"""The metadata envelope backends publish through the handshake.

A backend's :meth:`~kvwire.backend.TransferBackend.local_metadata` is opaque to the control
plane, but every backend needs the same outer checks when a peer's bytes come back in
``add_peer``: valid msgpack, produced by the same kind of backend, in a version this side reads.
:func:`pack_metadata` and :func:`unpack_metadata` do that once; the backend checks its own fields.
"""

from __future__ import annotations

from typing import Any

import msgpack


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
