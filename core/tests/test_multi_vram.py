"""A backend list (``auto`` on a GPU rank: ``cudaipc`` and NIXL) registers GPU memory: the
list passes either memory kind on to its members, each takes or refuses it, and only a list
none of whose members takes it refuses it. Found on two H200s: ``--transfer-backend auto``
failed every rank at startup ("backend 'multi' cannot register VRAM memory"), the list's
own capabilities being the template's default (host memory only). The GPU is played by
host memory flagged VRAM and a ``tcp`` subclass that takes it (no GPU here)."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.backend import BackendCapabilities
from kvwire.backends.multi import MultiBackend
from kvwire.backends.tcp import TcpBackend
from kvwire.errors import CapabilityError
from kvwire.layout import MemKind, MemoryRegion


class VramTcp(TcpBackend):
    """Stands in for a GPU backend: takes regions flagged VRAM (host memory here)."""

    name = "vramtcp"
    capabilities = BackendCapabilities(dram=True, vram=True)


def regions() -> tuple[list[MemoryRegion], list[np.ndarray]]:
    arrays = [np.zeros(4096, dtype=np.uint8) for _ in range(2)]
    vram = MemoryRegion.from_pointer(arrays[0].ctypes.data, 4096, 1024, kind=MemKind.VRAM)
    dram = MemoryRegion.from_pointer(arrays[1].ctypes.data, 4096, 1024)
    return [vram, dram], arrays


def test_a_list_registers_gpu_memory_with_the_members_that_take_it() -> None:
    members = [VramTcp("a"), TcpBackend("a")]
    multi = MultiBackend("a", members)
    regs, keep = regions()
    try:
        multi.register(regs)
        assert multi.member_names == ["vramtcp"]  # tcp refused the VRAM region: disabled
        assert "cannot register VRAM" in multi.disabled[1]
        assert members[0].registered_regions == regs == multi.registered_regions
    finally:
        multi.close()
    del keep


def test_a_list_none_of_whose_members_takes_gpu_memory_refuses_it() -> None:
    class Other(TcpBackend):
        name = "other"

    multi = MultiBackend("b", [TcpBackend("b"), Other("b")])
    regs, keep = regions()
    try:
        with pytest.raises(CapabilityError, match="cannot register VRAM"):
            multi.register(regs)
    finally:
        multi.close()
    del keep
