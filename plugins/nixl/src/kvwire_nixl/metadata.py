"""What a nixl agent publishes at handshake, and how a peer's publication is read.

The envelope (backend name, version, msgpack) is :mod:`kvwire.backends.envelope`'s; inside
it the agent's name, the NIXL build, its registered regions and NIXL's own agent metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvwire.backends.envelope import (
    pack_metadata,
    region_rows,
    regions_from_rows,
    unpack_metadata,
)
from kvwire.layout import MemoryRegion

METADATA_VERSION = 2


def pack_agent_metadata(
    agent_name: str, build: str, registered: Mapping[MemoryRegion, Any], md: bytes
) -> bytes:
    """This agent's publication: its name, NIXL ``build``, ``registered`` regions and NIXL
    agent metadata ``md`` (called by ``local_metadata``, under the control lock)."""
    return pack_metadata(
        "nixl",
        METADATA_VERSION,
        name=agent_name,
        nixl=build,
        regions=region_rows(registered),
        md=md,
    )


def unpack_peer_metadata(metadata: bytes) -> dict[str, Any]:
    """A peer's publication, checked: ``name`` (non-empty str) and ``md`` (non-empty bytes)
    are there. ``ValueError`` naming what is wrong (the template makes it a ``PeerError``)."""
    meta = unpack_metadata(metadata, "nixl", METADATA_VERSION, "kvwire-nixl")
    name, md = meta.get("name"), meta.get("md")
    if not isinstance(name, str) or not name:
        raise ValueError(f"nixl metadata names no agent (name {name!r})")
    if not isinstance(md, bytes) or not md:
        raise ValueError("nixl metadata carries no NIXL agent metadata")
    return meta


def peer_regions(meta: Mapping[str, Any], peer: str) -> list[MemoryRegion]:
    """The regions a peer's unpacked publication names."""
    return regions_from_rows(meta.get("regions"), "nixl", peer)
