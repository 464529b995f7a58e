"""The aux row carried in the last chunk's note (protocol 1.11), both sides.

A request's aux row (kvwire's room stamp plus the engine's aux buffers, one slot each) is
a few hundred bytes. Instead of a transfer of its own after the last KV chunk (a second
post, a second completion, a second notification), the aux sender puts the row's bytes in
the last note of its last chunk (``ChunkNote.aux``) when decode announced it takes them
(``Hello.aux_in_note``) and both sides' aux regions are in host memory; decode writes them
into its aux slot when that note is handled. The note arrives only after the chunk's data
landed (a backend's notification, or the note prefill tells over the control channel once its
own copy into a shared pool finished: HiSparse's ``mapped`` path), so the request completes
with its last note. Stateless functions; the caller holds
whatever lock guards the slot.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from kvwire.layout import MemoryRegion
from kvwire.regions import MemKind

#: Largest aux row carried in a note (bytes, all regions); a larger one moves as a transfer.
MAX_AUX_IN_NOTE = 4096


def carries_aux(regions: Sequence[MemoryRegion]) -> bool:
    """Whether this rank's aux rows can travel in notes: every region in host memory, one
    slot's row at most :data:`MAX_AUX_IN_NOTE` bytes in all."""
    return all(r.kind == MemKind.DRAM for r in regions) and (
        sum(r.item_len for r in regions) <= MAX_AUX_IN_NOTE
    )


def read_row(regions: Sequence[MemoryRegion], slot: int) -> list[bytes]:
    """Prefill, transfer worker: the bytes of aux slot ``slot`` of every region."""
    return [ctypes.string_at(r.addr + slot * r.item_len, r.item_len) for r in regions]


def write_row(regions: Sequence[MemoryRegion], slot: int, row: Sequence[bytes]) -> str | None:
    """Decode: write a carried aux row into slot ``slot``; the problem (nothing written)
    when it does not match this rank's aux regions."""
    if len(row) != len(regions):
        return f"aux row of {len(row)} regions, this rank has {len(regions)}"
    for i, (r, b) in enumerate(zip(regions, row, strict=True)):
        if len(b) != r.item_len:
            return f"aux region {i}: {len(b)} bytes carried, its rows are {r.item_len}"
        if not 0 <= slot < r.num_items:
            return f"aux slot {slot} is outside the {r.num_items} slots"
    for r, b in zip(regions, row, strict=True):
        # a ctypes array's slice assignment keeps the GIL (ctypes.memmove lets go of it for
        # these few bytes, and beside a busy engine thread the progress thread could then
        # wait a switch interval for it; docs/control-plane.md)
        (ctypes.c_char * r.item_len).from_address(r.addr + slot * r.item_len).raw = b
    return None
