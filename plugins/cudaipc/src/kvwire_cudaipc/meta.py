"""The ``cudaipc`` backend's handshake metadata: parsed and validated without a GPU.

A peer publishes (msgpack, in kvwire's metadata envelope): its agent name, the side
channel's ``tcp://`` endpoint, its registered regions, its host identity (boot id and
hostname), its process id, the address of its 8-byte scratch word (which a notification
without host rows writes), and one export per VRAM region: ``[addr, handle (64 bytes),
offset inside the allocation, GPU UUID]``. :func:`parse_peer` checks every field and raises
``ValueError`` naming what is wrong (the template turns it into a ``PeerError``);
:meth:`PeerInfo.check_same_host` refuses a peer on another host with a
:class:`~kvwire.errors.ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvwire.backends.envelope import regions_from_rows, unpack_metadata
from kvwire.errors import ConfigError
from kvwire.layout import MemKind, MemoryRegion

HANDLE_BYTES = 64


@dataclass(frozen=True)
class IpcExport:
    """A VRAM region as a peer can open it: the allocation's IPC handle and the region's
    offset inside that allocation, on the GPU with ``uuid``."""

    addr: int
    handle: bytes
    offset: int
    uuid: str

    def to_row(self) -> list[Any]:
        """The metadata row ``[addr, handle, offset, uuid]``."""
        return [self.addr, self.handle, self.offset, self.uuid]

    @classmethod
    def from_row(cls, row: Any) -> IpcExport:
        """Parse a metadata row; ``ValueError`` naming the field that is wrong."""
        if not isinstance(row, list | tuple) or len(row) != 4:
            raise ValueError("cudaipc export must be [addr, handle, offset, uuid]")
        addr, handle, offset, uuid = row
        if type(addr) is not int or addr < 0:
            raise ValueError(f"cudaipc export address {addr!r} is not an address")
        if not isinstance(handle, bytes) or len(handle) != HANDLE_BYTES:
            raise ValueError(f"cudaipc export of {addr:#x}: the IPC handle is not 64 bytes")
        if type(offset) is not int or offset < 0:
            raise ValueError(f"cudaipc export of {addr:#x}: offset {offset!r} is invalid")
        if not isinstance(uuid, str) or not uuid:
            raise ValueError(f"cudaipc export of {addr:#x} names no GPU UUID")
        return cls(addr=addr, handle=handle, offset=offset, uuid=uuid)


@dataclass(frozen=True)
class PeerInfo:
    """A peer's parsed metadata."""

    name: str
    endpoint: str
    regions: tuple[MemoryRegion, ...]
    host: dict[str, str]
    pid: int
    exports: tuple[IpcExport, ...]
    #: Address of the peer's scratch word (notification-only messages write it).
    scratch: int
    raw: dict[str, Any]
    #: The peer takes notes (``tcp`` data plane kind ``N``): a notification alone, not
    #: answered, instead of an acknowledged write of the scratch word. Older peers: False.
    notes: bool = False

    def check_same_host(self, local: dict[str, str]) -> None:
        """Refuse a peer on another host (or another boot of this one): CUDA IPC handles only
        open on the host that exported them."""
        if self.host != local:
            raise ConfigError(
                f"cudaipc: peer {self.name!r} runs on another host ({self.host.get('hostname')!r}, "
                f"boot {self.host.get('boot_id')!r}; this is {local.get('hostname')!r}, boot "
                f"{local.get('boot_id')!r}); CUDA IPC works between GPUs of one host only: "
                "use nixl or mooncake for this link"
            )


def parse_peer(metadata: bytes, backend: str, version: int) -> PeerInfo:
    """Validate a peer's metadata; ``ValueError`` naming what is wrong."""
    meta = unpack_metadata(metadata, backend, version, "kvwire-cudaipc")
    for key in ("name", "endpoint", "regions", "host", "pid", "exports", "scratch"):
        if key not in meta:
            raise ValueError(f"cudaipc metadata lacks {key!r}")
    name, endpoint = meta["name"], meta["endpoint"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"cudaipc metadata names no agent (name {name!r})")
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise ValueError(f"cudaipc metadata endpoint {endpoint!r} is not a tcp://host:port address")
    host = meta["host"]
    if (
        not isinstance(host, dict)
        or set(host) != {"boot_id", "hostname"}
        or not all(isinstance(v, str) for v in host.values())
    ):
        raise ValueError("cudaipc metadata host must be {boot_id, hostname} strings")
    if type(meta["pid"]) is not int or meta["pid"] <= 0:
        raise ValueError(f"cudaipc metadata pid {meta['pid']!r} is invalid")
    if type(meta["scratch"]) is not int or meta["scratch"] <= 0:
        raise ValueError(f"cudaipc metadata scratch {meta['scratch']!r} is not an address")
    regions = tuple(regions_from_rows(meta["regions"], backend, name))
    if not isinstance(meta["exports"], list | tuple):
        raise ValueError("cudaipc metadata exports must be a list")
    exports = tuple(IpcExport.from_row(r) for r in meta["exports"])
    vram = {r.addr for r in regions if r.kind == MemKind.VRAM}
    exported = [e.addr for e in exports]
    if set(exported) != vram or len(exported) != len(vram):
        raise ValueError(
            f"cudaipc metadata of {name!r}: exports must name each VRAM region once "
            f"({len(vram)} VRAM regions, {len(exported)} exports)"
        )
    return PeerInfo(
        name=name,
        endpoint=endpoint,
        regions=regions,
        host=dict(host),
        pid=meta["pid"],
        exports=exports,
        scratch=meta["scratch"],
        raw=meta,
        notes=meta.get("notes") is True,
    )
