"""The aux row carried in the last chunk's note (protocol 1.11): decode writes it on arrival
and completes the request with that note; an older decode rank (which does not announce
``Hello.aux_in_note``) still gets it as a transfer of its own. Two managers in one process
over tcp, every element and aux byte checked."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvwire.layout import MemoryRegion, RankPosition
from kvwire.regions import MemKind
from kvwire.session import KVManager, KVPoll, Role, aux_note
from kvwire.testing.kvfill import count_mismatches, fill_pages, make_pool
from kvwire.testing.pair import MODEL, config, wait_for

SLOTS = 8
#: Two engine aux buffers per rank: 40 and 12 bytes a slot.
AUX = (40, 12)


def aux_buffers() -> tuple[list[np.ndarray], list[MemoryRegion]]:
    arrays = [np.zeros((SLOTS, n), dtype=np.uint8) for n in AUX]
    regions = [MemoryRegion.from_pointer(a.ctypes.data, a.nbytes, a.shape[1]) for a in arrays]
    return arrays, regions


@contextlib.contextmanager
def managers() -> Iterator[dict[str, Any]]:
    play, parr = make_pool(MODEL, RankPosition(), 16)
    dlay, darr = make_pool(MODEL, RankPosition(), 16)
    paux, pregions = aux_buffers()
    daux, dregions = aux_buffers()
    pre = KVManager(config(), Role.PREFILL, play, aux_buffers=pregions)
    try:
        dec = KVManager(config(), Role.DECODE, dlay, aux_buffers=dregions)
    except BaseException:
        pre.close()
        raise
    try:
        yield dict(pre=pre, dec=dec, play=play, parr=parr, dlay=dlay, darr=darr, paux=paux,
                   daux=daux)  # fmt: skip
    finally:
        dec.close()
        pre.close()


@pytest.fixture
def ranks() -> Iterator[dict[str, Any]]:
    with managers() as r:
        yield r


def run_request(r: dict[str, Any], room: int, chunks: tuple[int, ...]) -> Any:
    """One verified request (prefill aux slot 2 -> decode aux slot 5); its sender metrics."""
    for i, a in enumerate(r["paux"]):
        a[2] = (np.arange(a.shape[1]) * 7 + room + i) % 251
    rx = r["dec"].receiver(room, r["pre"].bootstrap_addr)
    rx.init()
    dst = np.arange(sum(chunks)) + 6
    rx.send_metadata(dst, aux_index=5)
    tx = r["pre"].sender(room)
    src = np.arange(sum(chunks))
    fill_pages(r["play"], r["parr"], src, room)
    wait_for(lambda: tx.poll() >= KVPoll.WaitingForInput)
    tx.init(sum(chunks), aux_index=2)
    off = 0
    for i, n in enumerate(chunks):
        tx.send(src[off : off + n], last=i == len(chunks) - 1)
        off += n
    wait_for(lambda: rx.poll() == KVPoll.Success and tx.poll() == KVPoll.Success)
    assert count_mismatches(r["dlay"], r["darr"], dst, room) == 0
    for p, d in zip(r["paux"], r["daux"], strict=True):
        assert np.array_equal(d[5], p[2])  # the engine's aux row arrived
    metrics = tx.metrics
    rx.clear()
    tx.clear()
    return metrics


def kv_bytes(pages: int) -> int:
    row = MODEL.page_size * MODEL.head_dim * 4 * MODEL.total_kv_heads
    return pages * row * 2 * MODEL.num_layers


def test_the_aux_row_rides_in_the_last_note(ranks: dict[str, Any]) -> None:
    for room, chunks in ((1, (3,)), (2, (2, 1, 1))):
        mt = run_request(ranks, room, chunks)
        assert mt.chunks == len(chunks)  # no transfer for the aux row
        assert mt.bytes == kv_bytes(sum(chunks))


def test_an_older_decode_gets_the_aux_row_as_a_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode rank that does not announce ``aux_in_note`` (as 1.10 and older)."""
    import kvwire.session.decode.links as dlinks

    monkeypatch.setattr(dlinks, "carries_aux", lambda regions: False)
    with managers() as r:
        mt = run_request(r, 3, (2, 2))
        assert mt.chunks == 3  # two KV chunks and the aux row
        assert mt.bytes == kv_bytes(4) + 64 + sum(AUX)  # the stamp row and the engine's


def test_a_carried_row_must_match_the_aux_regions() -> None:
    arrays, regions = aux_buffers()
    ok = [bytes(range(40)), bytes(12)]
    for a in arrays:
        a[...] = 0xAB
    assert aux_note.write_row(regions, 3, ok) is None
    assert bytes(arrays[0][3]) == bytes(range(40))
    assert bytes(arrays[1][3]) == bytes(12)
    for a in arrays:  # exactly slot 3 of each region written, nothing around it
        assert (np.delete(a, 3, axis=0) == 0xAB).all()
    before = [a.copy() for a in arrays]
    assert "this rank has 2" in (aux_note.write_row(regions, 1, ok[:1]) or "")
    assert "13 bytes carried" in (aux_note.write_row(regions, 1, [ok[0], bytes(13)]) or "")
    assert "outside the 8 slots" in (aux_note.write_row(regions, SLOTS, ok) or "")
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before, strict=True))  # untouched
    assert aux_note.read_row(regions, 3) == ok
    assert aux_note.carries_aux(regions)
    gpu = [
        MemoryRegion.from_pointer(r.addr, r.length, r.item_len, kind=MemKind.VRAM) for r in regions
    ]
    assert not aux_note.carries_aux(gpu)
    big = [MemoryRegion.from_pointer(regions[0].addr, 40 * 200, 40 * 200)]
    assert not aux_note.carries_aux(big)  # above MAX_AUX_IN_NOTE: a transfer of its own
