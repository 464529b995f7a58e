"""Prefill's note frames packed from a template (:mod:`kvwire.session.prefill.notes`) decode
to the very note the model path encodes, are signed as any frame, and the engine's room ids
are plain integers before a note carries them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvwire.control.wire import ChunkNote, Codec, ProtocolError
from kvwire.errors import ConfigError
from kvwire.session.common import room_id
from kvwire.session.prefill.notes import NoteFrames

CASES = [
    dict(room=0, what="kv", chunk_id=0, last=False, span=(0, 1), num_pages=1, aux=None),
    dict(room=7, what="kv", chunk_id=3, last=True, span=(12, 20), num_pages=20, aux=[b"a", b""]),
    dict(room=2**40, what="staged", chunk_id=9, last=True, span=(0, 0), num_pages=None, aux=None),
]


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_chunk_frames_decode_to_the_model_paths_note(secret: bytes | None) -> None:
    codec = Codec(secret)
    frames = NoteFrames(codec, sender_id=5, session="prefill-x", page_size=16)
    for case in CASES:
        fast = codec.decode(frames.chunk(**case))  # type: ignore[arg-type]
        model = ChunkNote(sender_id=5, session="prefill-x", page_size=16, **case)  # type: ignore[arg-type]
        slow = codec.decode(codec.encode(model))
        assert fast == slow == model


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_plain_frames_decode_to_the_model_paths_note(secret: bytes | None) -> None:
    codec = Codec(secret)
    frames = NoteFrames(codec, sender_id=1, session="p", page_size=64)
    for room, what in itertools.product([0, 3, 99], ["aux", "state"]):
        got = codec.decode(frames.plain(room, what))
        assert got == ChunkNote(room=room, sender_id=1, session="p", what=what)  # type: ignore[arg-type]


def test_frames_are_signed_and_a_wrong_secret_refuses_them() -> None:
    frames = NoteFrames(Codec(b"right"), sender_id=0, session="p", page_size=16)
    frame = frames.chunk(1, "kv", 0, True, (0, 2), 2)
    assert isinstance(Codec(b"right").decode(frame), ChunkNote)
    with pytest.raises(ProtocolError, match="failed authentication"):
        Codec(b"wrong").decode(frame)
    with pytest.raises(ProtocolError, match="no MAC"):
        Codec(b"right").decode(NoteFrames(Codec(), 0, "p", 16).chunk(1, "kv", 0, True, (0, 2), 2))


def test_each_signed_frame_has_its_own_stamp() -> None:
    """The keyed MAC is copied per frame: two frames of one note differ (their freshness
    stamps) and both verify; a tampered body does not."""
    codec = Codec(b"k")
    frames = NoteFrames(codec, sender_id=0, session="p", page_size=16)
    a, b = frames.plain(4, "aux"), frames.plain(4, "aux")
    assert a != b
    assert codec.decode(a) == codec.decode(b)
    tampered = a.replace(b"aux", b"kv\xa0", 1)
    with pytest.raises(ProtocolError):
        codec.decode(tampered)


def test_room_ids_are_plain_ints_and_garbage_is_refused() -> None:
    assert room_id(np.int64(12)) == 12 and type(room_id(np.int64(12))) is int
    assert room_id(3) == 3
    for bad in ["7", 1.5, None, -1, True, np.float32(2.0)]:
        with pytest.raises(ConfigError, match="room must be a non-negative integer"):
            room_id(bad)


def test_managers_refuse_a_room_that_is_no_integer() -> None:
    from kvwire.testing.pair import Pair, config

    p = Pair(config(), slots=4)
    try:
        with pytest.raises(ConfigError, match="room must be"):
            p.prefill.sender("r1")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="room must be"):
            p.decode.receiver(-3, p.addr)
        assert type(p.prefill.sender(np.int64(8)).room) is int
    finally:
        p.close()
