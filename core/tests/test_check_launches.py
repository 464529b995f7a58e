"""Decode's device checks launch before they wait (issue 26 item 1).

A link whose hasher sums on the GPU is checked on the thread that handled the chunk's note
(``INLINE_CHECK``). The progress thread hands a whole drain of notifications to the decode
side first and runs the checks they completed afterwards
(:meth:`~kvwire.session.decode.side.DecodeSide.notifications_drained`): every check's sums are
launched (:meth:`ChunkCheck.start`, through ``LandedSums.chunk_later`` and the hasher's
``page_sums_later``) before the first one is waited for, so several chunks that landed
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
from kvwire.session.decode.checker import ChunkChecker
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
    """Three inline checks queued on one thread: ``run_deferred`` launches all three, then
    waits for each in the order they came; nothing stays in flight. Before this, each check
    launched and waited before the next one launched."""
    rooms: RoomTable[Any] = RoomTable({})
    checker = ChunkChecker("t", rooms, lambda *a, **k: None, lambda r: None, lambda r: None)
    events: list[tuple[str, int]] = []
    try:
        with rooms.lock:
            for i in range(3):
                assert checker.submit(_Stub(i, events))  # type: ignore[arg-type]
        assert events == [] and checker.in_flight() == 3  # nothing runs under the lock
        checker.run_deferred()
        launches = [("launch", i) for i in range(3)]
        assert events == [*launches, ("wait", 0), ("wait", 1), ("wait", 2)]
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


class _Armed:
    """A fake of an armed check (``ArmedSums``) for the host hasher: what a GPU enqueues
    behind a flag, summed here when it is read (after its release); records arm, release,
    drop and read with the calling thread. The sums are the real ones (``skew`` added to
    layer 0 when set: negative control)."""

    def __init__(self, hasher: RowHasher, side: Any, pages: Any, state: dict[str, Any]) -> None:
        self.pages = np.asarray(pages, dtype=np.int64).copy()
        self._hasher, self._side, self._state = hasher, side, state
        self.n = len(state["armed"])
        state["armed"].append(self)
        self.events: list[str] = ["arm:" + threading.current_thread().name]
        self.released = self.dropped = self.read = False

    def release(self) -> None:
        self.released = True
        self.events.append("release")

    def drop(self) -> None:
        self.released = self.dropped = True
        self.events.append("drop")

    def __call__(self) -> LayerSums:
        assert self.released and not self.dropped and not self.read
        self.read = True
        self.events.append("read")
        got = RowHasher.page_sums(self._hasher, self._side, self.pages, self._side, self.pages)
        if self._state["skew"] and 0 in got:
            got = {**got, 0: (got[0] + self._state["skew"]) % (1 << 64)}
        return got


@pytest.fixture()
def armed_checks(later_sums: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``later_sums`` and, as decode's GPU hasher arms checks, ``arm_page_sums`` giving
    :class:`_Armed` fakes (listed in ``armed``)."""
    later_sums["armed"] = []

    def arm(self: RowHasher, side: Any, pages: Any) -> _Armed:
        return _Armed(self, side, pages, later_sums)

    monkeypatch.setattr(RowHasher, "arm_page_sums", arm)
    return later_sums


def test_a_request_of_one_chunk_uses_its_armed_check(armed_checks: dict[str, Any]) -> None:
    """A request sent in one chunk: decode armed its check on the progress thread before the
    KV landed, the chunk's note released it and the verdict is its sums (nothing launched at
    the note: no ``page_sums_later``); with the armed sums skewed the request fails naming
    layer 0. A request of two chunks drops the armed check at its first chunk and checks
    both at their notes; a request aborted before its KV drops it too. Nothing stays armed."""
    state = armed_checks
    with pair(config(), config(kv_checksum=True)) as p:
        s, r, src, dst = p.start(71, 4)
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll())
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        (one,) = state["armed"]
        assert one.events[0].startswith("arm:kvwire-progress-decode"), one.events
        assert one.events[1:] == ["release", "read"], one.events
        assert one.pages.tolist() == np.asarray(dst).tolist()
        assert not state["events"], "a check was launched at the note"
        r.clear()
        s.clear()
        # two chunks: the armed check is dropped, both chunks are checked at their notes
        s, r, src, dst = p.start(72, 4)
        s.send(src[:2])
        s.send(src[2:], last=True)
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll())
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        assert state["armed"][1].events[1:] == ["drop"], state["armed"][1].events
        assert len([e for e in state["events"] if e[0] == "launch"]) == 2
        r.clear()
        s.clear()
        # skewed armed sums fail the request: the verdict is the armed check's
        state["skew"] = 1
        s, r, src, _ = p.start(73, 4)
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Failed)
        want = r"KV checksum mismatch in chunk 0 \(request pages \[0, 4\)\) from .* layers 0 differ"
        with pytest.raises(KVWireError, match=want):
            r.failure_exception()
        assert state["armed"][2].events[1:] == ["release", "read"]
        wait_for(lambda: s.poll() in (KVPoll.Failed, KVPoll.Success))
        r.clear()
        s.clear()
        # aborted before any KV: dropped
        state["skew"] = 0
        s, r, src, _ = p.start(74, 4)
        wait_for(lambda: len(state["armed"]) == 4)
        r.abort()
        wait_for(lambda: state["armed"][3].dropped)
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
        assert all(a.dropped or a.read for a in state["armed"])
        assert p.decode.side.checker.in_flight() == 0  # type: ignore[union-attr]
