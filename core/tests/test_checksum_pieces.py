"""Decode checks a chunk piece by piece as the pieces land (issue 26 item 1, protocol 1.12).

Prefill cuts a large in-place chunk by layers into pieces (``SentSums.pieces``), each posted
with a note carrying its layer range and its rows' sums; decode checks each piece as soon as
its note arrives, and the chunk counts once its last piece's check passed. Two managers over
the real tcp backend, a model of 8 layers (so that a chunk has pieces) and a small first
piece (``RowHasher.PIECE_BYTES``) so that a few KiB make several pieces.

Older peers: a 1.11 decode ignores ``piece_layers`` (it adds the pieces' sums and checks the
chunk whole) and a 1.11 prefill sends parts with their own sums but no layer range (decode
checks the chunk whole); both are played here by stripping the field on one side.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any

import numpy as np
import pytest

from kvwire.config import KVWireConfig
from kvwire.descriptors import ADDR, LEN
from kvwire.errors import KVWireError, TransferError
from kvwire.integrity import RowHasher, add_sums
from kvwire.layout import RankPosition
from kvwire.session import KVPoll
from kvwire.session.checksums import LandedSums, SentSums
from kvwire.session.decode.checker import ChunkChecker
from kvwire.session.decode.rooms import ChunkCheck, RecvRoom
from kvwire.session.decode.side import DecodeSide
from kvwire.session.handshake import build_mapper
from kvwire.session.prefill.posting import SegmentPost
from kvwire.testing.faults import landed_flipper
from kvwire.testing.kvfill import count_mismatches, make_pool
from kvwire.testing.pair import MODEL, Pair, config, no_rooms, pair, wait_for

#: 8 layers of 256 bytes a page (K and V, 2 tokens x 2 heads x 8 x int32 each).
DEEP = MODEL.model_copy(update={"num_layers": 8})
#: The first piece's bytes: an 8-page chunk (16 KiB) is cut into 6 pieces.
FIRST = 1024


def _checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, tuple[int, int] | None]]:
    """Decode's checks as they run: (parts of the chunk, the piece's layers or None)."""
    monkeypatch.setattr(RowHasher, "PIECE_BYTES", FIRST)
    seen: list[tuple[int, tuple[int, int] | None]] = []
    original = ChunkCheck.run

    def spy(check: ChunkCheck, later: Any = None) -> Any:
        seen.append((check.msg.parts, check.msg.piece_layers))
        return original(check, later)

    monkeypatch.setattr(ChunkCheck, "run", spy)
    return seen


def _flip_layer(monkeypatch: pytest.MonkeyPatch, layer: int) -> None:
    """Decode's check of each landed piece holding ``layer`` starts by flipping one bit of
    byte 5 of the piece's first row of that layer (a transport corrupting one byte of one
    piece in flight: fault ``flip_on_landing``)."""
    monkeypatch.setattr(LandedSums, "chunk", landed_flipper(layer=layer, offset=5))


def _covering(pieces: list[tuple[int, int] | None]) -> list[tuple[int, int]]:
    """The pieces' layer ranges, in order; asserts they tile the model's layers."""
    ranges = sorted(p for p in pieces if p is not None)
    assert len(ranges) == len(pieces), pieces
    assert ranges[0][0] == 0 and ranges[-1][1] == DEEP.num_layers, ranges
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), ranges
    return ranges


def test_pieces_are_checked_as_they_land_and_a_flip_in_one_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A clean chunk of 6 pieces lands checked piece by piece (one check per piece, over its
    layers; the first one starts when only its own note has arrived), then a flip in the
    piece holding layer 5 fails the request naming chunk, layer and sender."""
    seen = _checks(monkeypatch)
    started: list[int] = []
    original_submit = ChunkChecker.submit

    def submit(self: ChunkChecker, check: ChunkCheck | None) -> bool:
        if check is not None:  # under the room lock: how many of its chunk's notes arrived
            room = self._rooms.get(check.room)
            assert room is not None
            started.append(sum(1 for n in room.notes_seen if n[2] == check.msg.chunk_id))
        return original_submit(self, check)

    monkeypatch.setattr(ChunkChecker, "submit", submit)
    with pair(config(), config(kv_checksum=True), model=DEEP) as p:
        s, r, src, dst = p.start(31, 8)
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll())
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        parts = {n for n, _ in seen}
        assert parts == {6} and len(seen) == 6, seen  # one check per piece, none whole
        _covering([layers for _, layers in seen])
        assert started[0] == 1, "the first piece is checked before the others arrived"
        r.clear()
        s.clear()
        seen.clear()
        _flip_layer(monkeypatch, 5)
        s, r, src, _ = p.start(32, 8)
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Failed)
        want = r"KV checksum mismatch in chunk 0 \(request pages \[0, 8\)\) from .* layers 5 differ"
        with pytest.raises(KVWireError, match=want):
            r.failure_exception()
        report = r.failure_report()
        assert report.cause == "checksum_mismatch" and report.chunk is not None
        assert report.chunk.layers == "5"
        wait_for(lambda: s.poll() in (KVPoll.Failed, KVPoll.Success))
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_older_peers_check_the_chunk_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1.11 decode (it ignores ``piece_layers``) gets the same pieces, adds their sums and
    checks the chunk once, whole; a 1.11 prefill (parts with their own sums, no layer range)
    is checked whole by this decode. Both verify, and both still catch a flip."""
    seen = _checks(monkeypatch)
    on_note = DecodeSide._note_landed

    def old_decode(self: DecodeSide, msg: Any) -> None:
        on_note(self, msg.model_copy(update={"piece_layers": None}))

    fields = SegmentPost.piece_fields

    def old_prefill(self: SegmentPost, i: int) -> dict[str, Any]:
        out = fields(self, i)
        out.pop("piece_layers")
        return out

    for room, (cls, name, old) in enumerate(
        [(DecodeSide, "_note_landed", old_decode), (SegmentPost, "piece_fields", old_prefill)]
    ):
        with monkeypatch.context() as m:
            m.setattr(cls, name, old)
            with pair(config(), config(kv_checksum=True), model=DEEP) as p:
                _request(p, 40 + room, None)
                assert seen == [(6, None)], seen  # 6 parts, one whole-chunk check
                seen.clear()
                with monkeypatch.context() as flip:
                    _flip_layer(flip, 2)
                    _request(p, 50 + room, r"chunk 0 .* layers 2 differ")
                seen.clear()
                wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def _request(p: Pair, room: int, fails: str | None) -> None:
    """One request of 8 pages in one chunk: verified, or failed matching ``fails``."""
    s, r, src, dst = p.start(room, 8)
    s.send(src, last=True)
    if fails is None:
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll())
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
    else:
        wait_for(lambda: r.poll() == KVPoll.Failed)
        with pytest.raises(KVWireError, match=fails):
            r.failure_exception()
        wait_for(lambda: s.poll() in (KVPoll.Failed, KVPoll.Success))
    r.clear()
    s.clear()


def test_a_room_cleared_while_a_piece_is_checked_drops_the_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first piece's check is held (a gated hasher, a fake for timing only) while the
    other pieces land and are checked: the request stays Transferring (Success waits for
    every piece's check); the engine clears it; the held verdict, released, is dropped: no
    Success, nothing left behind, and the next request is checked piecewise and succeeds."""
    seen = _checks(monkeypatch)
    original = LandedSums.chunk
    entered, gate = threading.Event(), threading.Event()
    calls = {"n": 0}
    lock = threading.Lock()

    def chunk(self: LandedSums, *args: Any) -> Any:
        with lock:
            calls["n"] += 1
            first = calls["n"] == 1
        if first:
            entered.set()
            assert gate.wait(120), "the test never released the first check"
        return original(self, *args)

    monkeypatch.setattr(LandedSums, "chunk", chunk)
    with pair(config(), config(kv_checksum=True), model=DEEP) as p:
        s, r, src, _ = p.start(61, 8)
        s.send(src, last=True)
        wait_for(entered.is_set, timeout=60)
        wait_for(lambda: len(seen) == 6, timeout=60)  # every piece's check started
        wait_for(lambda: p.decode.room_tables()["checks_in_flight"] == 1, timeout=60)
        assert r.poll() == KVPoll.Transferring
        r.clear()
        gate.set()
        wait_for(lambda: p.decode.room_tables()["checks_in_flight"] == 0, timeout=60)
        assert r.poll() != KVPoll.Success
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode), timeout=60)
        seen.clear()
        s2, r2, src2, dst2 = p.start(62, 8)
        s2.send(src2, last=True)
        wait_for(lambda: r2.poll() == KVPoll.Success == s2.poll(), timeout=60)
        assert count_mismatches(p.dlay, p.darr, dst2, 0) == 0
        assert len(seen) == 6 and all(layers is not None for _, layers in seen)
        r2.clear()
        s2.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode), timeout=60)


def test_pieces_tile_the_layers_ramp_up_and_down_and_their_sums_add_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cut itself: pieces hold every row once, each piece the rows of its layer range
    (in the chunk's order), ranges tile the layers, the first and last pieces are the
    smallest, each piece's sums equal the chunk's over its layers, and decode's sums of a
    piece's layers equal prefill's."""
    monkeypatch.setattr(RowHasher, "PIECE_BYTES", FIRST)
    layout, arrs = make_pool(DEEP, RankPosition(), 32)
    rng = np.random.default_rng(3)
    for a in arrs:
        a.view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
    mapper = build_mapper(KVWireConfig(), layout, layout)
    sent = SentSums(mapper, layout)
    src_pages, dst_pages = np.array([3, 4, 9, 10, 11, 20, 2, 30]), np.arange(8) + 12
    src_idx, dst_idx = mapper.map_chunk(src_pages, dst_pages)
    pieces = sent.pieces(src_idx, dst_idx)
    assert len(pieces) == 6
    ranges = _covering([r for *_, r in pieces])
    assert ranges == [r for *_, r in pieces], "pieces in layer order"
    src = np.asarray(src_idx)
    layer_of = sent.hasher.row_layers(sent.tables.src, src)
    whole = sent.chunk(src_pages, dst_pages)
    sizes = []
    for (a, b, (lo, hi)), got in zip(pieces, ranges, strict=True):
        rows = np.flatnonzero((layer_of >= lo) & (layer_of < hi))
        np.testing.assert_array_equal(a, src[rows])  # its layers' rows, in the chunk's order
        np.testing.assert_array_equal(b, np.asarray(dst_idx)[rows])
        own = sent.rows(a, b)
        assert own == {x: whole[x] for x in range(*got)}
        sizes.append(int(sent.tables.src[a, LEN].sum()))
    assert sizes[0] == sizes[-1] == min(sizes) and max(sizes) > sizes[0], sizes
    total: dict[int, int] = {}
    for a, b, _ in pieces:
        add_sums(total, sent.rows(a, b))
    assert total == whole
    landed = LandedSums(KVWireConfig(), layout, layout)
    for a, b, _ in pieces:  # decode reads the same rows: copy them over first
        for s_row, d_row in zip(a.tolist(), b.tolist(), strict=True):
            n = int(sent.tables.src[s_row, LEN])
            ctypes.memmove(int(landed.dst[d_row, ADDR]), int(sent.tables.src[s_row, ADDR]), n)
    for _, _, (lo, hi) in pieces:
        assert landed.chunk(8, dst_pages, None, (0, 8), (lo, hi)) == {
            x: whole[x] for x in range(lo, hi)
        }
    monkeypatch.setattr(RowHasher, "PIECE_BYTES", 0)
    assert sent.pieces(src_idx, dst_idx) == []
    monkeypatch.setattr(RowHasher, "PIECE_BYTES", 8 << 10)  # a chunk of < 3 first pieces
    assert sent.pieces(src_idx, dst_idx) == []


def test_a_chunk_mixing_pieces_and_whole_parts_is_refused() -> None:
    """A chunk is cut in pieces or not at all: a sender that mixes them fails the request
    (no part of it would be left unchecked)."""
    from kvwire.control.wire import ChunkNote

    room = RecvRoom(room=7, bootstrap_addr="x")

    def note(part: int, piece: tuple[int, int] | None) -> ChunkNote:
        return ChunkNote(
            room=7, sender_id=0, session="p", chunk_id=0, parts=2, part=part, piece_layers=piece
        )

    first, second = note(0, (0, 4)), note(1, None)
    assert room.fresh_part(first) and room.fresh_part(second)
    assert not room.fresh_part(first), "a note counted once"
    assert not room.take_part(first)
    with pytest.raises(TransferError, match="1 pieces and 1 whole parts"):
        room.take_part(second)
    with pytest.raises(ValueError, match="piece layers"):
        ChunkNote(room=7, sender_id=0, session="p", piece_layers=(2, 4), sum_layers=[1], sums=[3])
