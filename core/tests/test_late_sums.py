"""A whole chunk's checksums after its rows (issue 26 item 1, :mod:`.prefill.late_sums`).

Two managers over the real tcp backend: a checked chunk posted whole sends its rows with notes
that carry no sums, sums them while they fly and tells the sums as its last part over the
control channel. Prefill's request is not done before that part was sent; a sum that raises
fails both sides; a sums part that never arrives fails decode by its waiting timeout, naming
the chunk it misses. Each test is one or two small requests (about a second each).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvwire.control.wire import ChunkNote, Message
from kvwire.errors import KVWireError
from kvwire.integrity import RowHasher
from kvwire.session import KVPoll
from kvwire.session.checksums import SentSums
from kvwire.session.context import RankContext
from kvwire.session.decode.side import DecodeSide
from kvwire.testing.kvfill import count_mismatches
from kvwire.testing.pair import config, no_rooms, pair, wait_for


@pytest.fixture(autouse=True)
def _late(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk here (a few KiB) is summed after its rows (host pools: from 8 MiB on)."""
    monkeypatch.setattr(RowHasher, "LATE_BYTES", 0)


def _notes(monkeypatch: pytest.MonkeyPatch) -> list[ChunkNote]:
    """Every KV note decode takes (data-plane or control channel), in arrival order."""
    seen: list[ChunkNote] = []
    original = DecodeSide._note_landed

    def spy(self: DecodeSide, msg: Any) -> None:
        if isinstance(msg, ChunkNote) and msg.what == "kv":
            seen.append(msg)
        original(self, msg)

    monkeypatch.setattr(DecodeSide, "_note_landed", spy)
    return seen


def test_prefill_is_done_only_after_the_sums_part_was_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chunk's sum is held (a gate: a fake for timing only) after its rows were posted:
    the rows land on decode (their note arrived, without sums), yet neither side succeeds;
    once the sum is released its sums arrive as the chunk's last part, decode checks the
    chunk and both sides succeed with correct KV."""
    seen = _notes(monkeypatch)
    gate, entered = threading.Event(), threading.Event()
    original = SentSums.chunk

    def held(self: SentSums, *args: Any) -> Any:
        entered.set()
        assert gate.wait(120), "the test never released the sum"
        return original(self, *args)

    monkeypatch.setattr(SentSums, "chunk", held)
    with pair(config(), config(kv_checksum=True)) as p:
        s, r, src, dst = p.start(61, 4)
        s.send(src, last=True)
        wait_for(lambda: entered.is_set() and len(seen) == 1, timeout=60)  # the rows landed
        assert (seen[0].part, seen[0].parts, seen[0].sums) == (0, 2, [])
        time.sleep(0.2)  # the rows' write completed on prefill long ago
        assert s.poll() == KVPoll.Transferring, "prefill done before its sums were sent"
        assert r.poll() == KVPoll.Transferring
        gate.set()
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll(), timeout=60)
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        last = seen[1]
        assert (last.part, last.parts, last.span, last.last) == (1, 2, (0, 4), True)
        assert sorted(last.sum_layers) == list(range(p.play.model.num_layers))
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_a_sum_that_raises_after_the_post_fails_both_sides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chunk's rows are posted, then its sum raises: prefill fails the request naming
    the chunk's checksums and the cause, decode hears of it and fails too (it never counts
    the chunk without its sums); the next request on the pair succeeds."""
    original = SentSums.chunk
    broken = {"on": True}

    def raising(self: SentSums, *args: Any) -> Any:
        if broken["on"]:
            raise RuntimeError("injected hasher failure")
        return original(self, *args)

    monkeypatch.setattr(SentSums, "chunk", raising)
    with pair(config(), config(kv_checksum=True)) as p:
        s, r, src, _ = p.start(62, 4)
        s.send(src, last=True)
        wait_for(lambda: s.poll() == KVPoll.Failed == r.poll(), timeout=60)
        want = r"checksums of chunk 0 could not be computed .*injected hasher failure"
        for side in (s, r):
            with pytest.raises(KVWireError, match=want):
                side.failure_exception()
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode), timeout=60)
        broken["on"] = False
        p.transfer(63, 4, (4,))


def test_a_lost_sums_part_fails_decode_by_its_timeout_naming_the_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control channel loses the chunk's sums part (a fake: the note is dropped as sent):
    the rows landed but the chunk is never counted unchecked; decode's waiting timeout (1 s
    here) fails the request naming the chunk that has no part with its checksums."""
    original = RankContext.tell

    def losing(self: RankContext, endpoint: str, msg: Message) -> bool:
        if isinstance(msg, ChunkNote) and msg.sums:
            return True  # lost on the way
        return original(self, endpoint, msg)

    monkeypatch.setattr(RankContext, "tell", losing)
    with pair(config(), config(kv_checksum=True, waiting_timeout_s=3.0)) as p:
        s, r, src, _ = p.start(64, 4)
        t0 = time.monotonic()
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Failed, timeout=60)
        assert time.monotonic() - t0 < 30
        want = r"waiting timeout.*chunk 0 from sender \d+: 1 parts arrived, none with its checksums"
        with pytest.raises(KVWireError, match=want):
            r.failure_exception()
        r.clear()
        wait_for(lambda: s.poll() in (KVPoll.Failed, KVPoll.Success), timeout=60)
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode), timeout=60)


def test_only_large_host_chunks_are_summed_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """The size rule (:meth:`SentSums.late`): a host pool's chunk from the hasher's
    ``LATE_BYTES`` on is summed after its rows, a smaller one before; a GPU pool's chunk is
    summed before its rows whatever its size (on two H100s its own sums part cost more than
    the ~0.2 ms sum: docs/benchmarks.md). Real hashers' classes, no link needed."""
    pytest.importorskip("triton")
    from kvwire.integrity_device import DeviceRowHasher

    sent = object.__new__(SentSums)  # only the two attributes the rule reads
    sent.page_bytes = 1 << 20
    sent.hasher = object.__new__(RowHasher)
    monkeypatch.setattr(RowHasher, "LATE_BYTES", 8 << 20)  # the default (the fixture set 0)
    assert sent.late(8) and not sent.late(7)
    sent.hasher = object.__new__(DeviceRowHasher)
    assert not sent.late(1 << 20)  # a TiB chunk
