"""What of the ``cudaipc`` backend runs without a GPU: metadata validation, the host
identity check and the refusals that need no device.

Only on a GPU machine (``scripts/gpu_cudaipc_bench.py``): exporting and opening IPC handles,
enabling peer access, the fused mover writing into a peer GPU, and the refusal of a peer GPU
this process cannot see or reach peer to peer."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from kvwire.backend import TransferBackend
from kvwire.config import KVWireConfig
from kvwire.descriptors import make_table
from kvwire.errors import ConfigError, DescriptorError, PeerError
from kvwire.layout import MemKind, MemoryRegion
from kvwire.selection import create_backend
from kvwire_cudaipc import _cuda
from kvwire_cudaipc.meta import IpcExport, parse_peer


@pytest.fixture
def agents() -> Iterator[tuple[TransferBackend, TransferBackend, np.ndarray]]:
    cfg = KVWireConfig(transfer_backend="cudaipc")
    a = create_backend(cfg, "prefill-a", need=())
    b = create_backend(cfg, "decode-b", need=())
    buf = np.zeros(1 << 16, dtype=np.uint8)
    b.register([MemoryRegion.from_tensor(buf, item_len=4096)])
    yield a, b, buf
    a.close()
    b.close()


def _edit(meta: bytes, **changes: object) -> bytes:
    d = msgpack.unpackb(meta, raw=False)
    d.update(changes)
    out: bytes = msgpack.packb(d, use_bin_type=True)
    return out


def test_metadata_carries_host_identity_and_parses(agents: tuple) -> None:
    a, b, buf = agents
    info = parse_peer(b.local_metadata(), "cudaipc", 1)
    assert info.name == "decode-b"
    assert info.host == _cuda.host_identity()
    assert info.host["boot_id"] and info.host["hostname"]
    assert [r.addr for r in info.regions] == [buf.ctypes.data]
    assert info.exports == ()
    assert a.add_peer(b.local_metadata()) == "decode-b"


def test_peer_on_another_host_is_refused(agents: tuple) -> None:
    a, b, _ = agents
    host = {**_cuda.host_identity(), "boot_id": "00000000-0000-0000-0000-000000000000"}
    with pytest.raises(ConfigError, match=r"another host.*nixl or mooncake"):
        a.add_peer(_edit(b.local_metadata(), host=host))
    host = {**_cuda.host_identity(), "hostname": "elsewhere"}
    with pytest.raises(ConfigError, match="another host"):
        a.add_peer(_edit(b.local_metadata(), host=host))
    assert a.peers() == []


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"host": "x"}, "host must be"),
        ({"pid": 0}, "pid"),
        ({"scratch": "x"}, "scratch"),
        ({"exports": [[1 << 40, b"x" * 63, 0, "GPU-1"]]}, "64 bytes"),
        ({"exports": [[1 << 40, b"x" * 64, -1, "GPU-1"]]}, "offset"),
        ({"exports": [[1 << 40, b"x" * 64, 0, ""]]}, "UUID"),
        ({"exports": [[1 << 40, b"x" * 64, 0, "GPU-1"]]}, "each VRAM region once"),
        ({"endpoint": "ipc://x"}, "tcp://"),
        ({"backend": "tcp"}, "not produced by a cudaipc"),
        ({"v": 99}, "version"),
    ],
)
def test_malformed_metadata_is_refused(agents: tuple, changes: dict, match: str) -> None:
    a, b, _ = agents
    with pytest.raises(PeerError, match=match):
        a.add_peer(_edit(b.local_metadata(), **changes))
    assert a.peers() == []


def test_export_rows_round_trip() -> None:
    e = IpcExport(addr=1 << 40, handle=bytes(range(64)), offset=4096, uuid="GPU-abc")
    assert IpcExport.from_row(e.to_row()) == e
    meta = msgpack.unpackb(msgpack.packb(e.to_row(), use_bin_type=True), raw=False)
    assert IpcExport.from_row(meta) == e


def test_remote_vram_rows_need_local_vram(agents: tuple) -> None:
    """A peer that published a VRAM region (here: fabricated, no GPU needed to parse it): a
    rank without VRAM of its own opens nothing and refuses VRAM rows at prepare, naming why."""
    a, b, _ = agents
    local = np.zeros(1 << 14, dtype=np.uint8)
    a.register([MemoryRegion.from_tensor(local, item_len=4096)])
    vaddr = 1 << 44
    meta = msgpack.unpackb(b.local_metadata(), raw=False)
    meta["regions"].append([vaddr, 1 << 20, 0, int(MemKind.VRAM)])
    meta["exports"] = [[vaddr, b"h" * 64, 0, "GPU-00000000"]]
    peer = a.add_peer(msgpack.packb(meta, use_bin_type=True))
    with pytest.raises(DescriptorError, match="registered no VRAM"):
        a.prepare(peer, make_table([local.ctypes.data], 4096), make_table([vaddr], 4096))


def test_vram_registration_without_a_gpu_is_a_config_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    a = create_backend(KVWireConfig(transfer_backend="cudaipc"), "x", need=())
    try:
        with pytest.raises(ConfigError, match="no CUDA device"):
            a.register([MemoryRegion.from_pointer(1 << 44, 1 << 20, 4096, kind=MemKind.VRAM)])
        assert a.registered_regions == []
    finally:
        a.close()
