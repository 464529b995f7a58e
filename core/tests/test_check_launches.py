"""Decode's device checks launch before they wait (issue 26 item 1).

A link whose hasher sums on the GPU is checked on the thread that handled the chunk's note
(``INLINE_CHECK``). The progress thread hands a whole drain of notifications to the decode
side first and runs the checks they completed afterwards
(:meth:`~kvwire.session.decode.side.DecodeSide.notifications_drained`): every check's sums are
launched (:meth:`ChunkCheck.start`, through ``LandedSums.chunk_later`` and the hasher's
``page_sums_later``; four at most) before the first one is waited for, so chunks that landed
together cost one wait, not one each.

No GPU runs this suite: the host hasher is flagged ``INLINE_CHECK`` and given a
``page_sums_later`` that records when it is launched and waited for (a fake for the order of
calls only; the sums it returns are the real ones, or skewed for the negative control).
``scripts/gpu_later_sums_run.sh`` times the real one on a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvwire.errors import KVWireError
from kvwire.integrity import LayerSums, RowHasher
from kvwire.session import KVPoll
from kvwire.session.decode.checker import CHECK_BATCH, ChunkChecker
from kvwire.session.rooms import RoomTable
from kvwire.testing.kvfill import count_mismatches
from kvwire.testing.pair import config, no_rooms, pair, wait_for


class _Stub:
    """A check of a room the table does not hold (its verdict is dropped): it records when
    its sums are launched and waited for."""

    def __init__(self, room: int, events: list[tuple[str, int]]) -> None:
        self.room, self.events = room, events
        self.dst_pages = np.zeros(1, dtype=np.int64)
        self.checksums = SimpleNamespace(inline=True)
        self.msg = SimpleNamespace(chunk_id=0, piece_layers=None)

    def start(self) -> Callable[[], LayerSums]:
        self.events.append(("launch", self.room))

        def wait() -> LayerSums:
            self.events.append(("wait", self.room))
            return {}

        return wait

    def run(self, later: Callable[[], LayerSums] | None) -> None:
        assert later is not None, "run without the launch start() made"
        later()


def test_deferred_checks_launch_all_then_wait_in_order() -> None:
    """Six inline checks queued on one thread: ``run_deferred`` launches a batch of
    ``CHECK_BATCH`` (4), then waits for each in the order they came, then the next batch;
    nothing stays in flight. Before this, each check launched and waited before the next one
    launched."""
    assert CHECK_BATCH == 4
    rooms: RoomTable[Any] = RoomTable({})
    checker = ChunkChecker("t", rooms, lambda *a, **k: None, lambda r: None, lambda r: None)
    events: list[tuple[str, int]] = []
    try:
        with rooms.lock:
            for i in range(6):
                assert checker.submit(_Stub(i, events))  # type: ignore[arg-type]
        assert events == [] and checker.in_flight() == 6  # nothing runs under the lock
        checker.run_deferred()
        first = [("launch", i) for i in range(4)] + [("wait", i) for i in range(4)]
        assert events == [*first, ("launch", 4), ("launch", 5), ("wait", 4), ("wait", 5)]
        assert checker.in_flight() == 0
    finally:
        checker.close()


@pytest.fixture()
def later_sums(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The host hasher as decode's GPU hasher is called: inline checks, with sums launched
    by ``page_sums_later`` (recorded with the calling thread) and waited for by calling the
    result; ``skew`` added to layer 0's sum when set (negative control)."""
    monkeypatch.setattr(RowHasher, "INLINE_CHECK", True)
    state: dict[str, Any] = {"events": [], "skew": 0}
    lock = threading.Lock()
    count = iter(range(1 << 30))

    def page_sums_later(self: RowHasher, *args: Any) -> Callable[[], LayerSums]:
        got = RowHasher.page_sums(self, *args)
        with lock:
            n = next(count)
            state["events"].append(("launch", n, threading.current_thread().name))
        if state["skew"] and 0 in got:
            got = {**got, 0: (got[0] + state["skew"]) % (1 << 64)}

        def wait() -> LayerSums:
            with lock:
                state["events"].append(("wait", n, threading.current_thread().name))
            return got

        return wait

    monkeypatch.setattr(RowHasher, "page_sums_later", page_sums_later)
    yield state


def test_checks_of_landed_chunks_use_the_launched_sums(later_sums: dict[str, Any]) -> None:
    """A chunked request over a page-form link: each chunk's check is launched and waited for
    on decode's progress thread (never a checker thread), each launch before its wait, and
    the request lands right. Then the launched sums are skewed on layer 0: the request fails
    naming chunk 0 and layer 0, so the verdict is the launched sums' (without ``start``,
    decode would sum the chunk itself and pass)."""
    events = later_sums["events"]
    with pair(config(), config(kv_checksum=True)) as p:
        s, r, src, dst = p.start(61, 6)
        s.send(src[:2])
        s.send(src[2:4])
        s.send(src[4:], last=True)
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll())
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        launches = [e for e in events if e[0] == "launch"]
        assert len(launches) == 3, events  # one per chunk
        for kind, n, thread in events:
            assert thread.startswith("kvwire-progress-decode"), events
            if kind == "wait":
                assert ("launch", n, thread) in events[: events.index((kind, n, thread))]
        waited = {n for kind, n, _ in events if kind == "wait"}
        assert waited == {n for _, n, _ in launches}
        r.clear()
        s.clear()
        later_sums["skew"] = 1
        s, r, src, _ = p.start(62, 4)
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Failed)
        want = r"KV checksum mismatch in chunk 0 \(request pages \[0, 4\)\) from .* layers 0 differ"
        with pytest.raises(KVWireError, match=want):
            r.failure_exception()
        wait_for(lambda: s.poll() in (KVPoll.Failed, KVPoll.Success))
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
        assert p.decode.side.checker.in_flight() == 0  # type: ignore[union-attr]
