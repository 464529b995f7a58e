"""The staging ring: allocations never wait, the readiness rule never lets a writer overwrite
live bytes, watermarks are monotone, duplicates are harmless."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import ConfigError
from kvwire.staging.ring import Allocation, RingAllocator, WatermarkView, ready


def test_wraps_into_rounds_and_rounds_up() -> None:
    r = RingAllocator(1000, granularity=100)
    a = r.allocate(250, "a")
    b = r.allocate(600, "b")
    c = r.allocate(100, "c")  # does not fit after b (900 + 100 = 1000 fits exactly)
    d = r.allocate(100, "d")  # wraps
    assert (a.round, a.offset, a.end) == (0, 0, 300)
    assert (b.round, b.offset, b.end) == (0, 300, 900)
    assert (c.round, c.offset, c.end) == (0, 900, 1000)
    assert (d.round, d.offset, d.end) == (1, 0, 100)
    assert r.watermark == (0, 0)
    assert not ready(d, r.watermark)  # a still holds [0, 300) of round 0
    assert r.free(a.id)
    assert r.watermark == (0, 300) and ready(d, r.watermark)


def test_duplicate_requests_get_the_same_allocation_and_frees_are_idempotent() -> None:
    r = RingAllocator(1024, 64)
    a = r.allocate(100, ("room", 1, 0))
    assert r.allocate(100, ("room", 1, 0)) == a
    assert r.live == 1 and r.live_bytes == 128
    assert r.free(a.id)
    assert not r.free(a.id)
    assert r.live == 0 and r.get(("room", 1, 0)) is None


def test_out_of_order_frees_hold_the_watermark_at_the_oldest() -> None:
    r = RingAllocator(400, 100)
    a, b, c = (r.allocate(100, k) for k in "abc")
    assert not r.free(b.id)  # a still live: no move
    assert r.watermark == (0, 0)
    assert r.free(a.id)
    assert r.watermark == (0, 200)
    r.free(c.id)
    assert r.watermark == (0, 300)  # the head


def test_free_where_releases_a_rooms_allocations() -> None:
    r = RingAllocator(1000, 10)
    for room in (1, 2):
        for chunk in range(3):
            r.allocate(50, (room, chunk))
    assert r.free_where(lambda k: k[0] == 1) == 3
    assert r.live == 3 and all(k[0] == 2 for k in r._by_key)


def test_refuses_what_can_never_fit() -> None:
    r = RingAllocator(1000, 10)
    with pytest.raises(ConfigError, match="does not fit"):
        r.allocate(1001, "x")
    with pytest.raises(ConfigError):
        RingAllocator(1000, 300)


def test_watermark_view_is_monotone() -> None:
    v = WatermarkView()
    assert v.update((1, 50))
    assert not v.update((0, 900))  # stale, reordered broadcast
    assert not v.update((1, 50))  # duplicate
    assert v.value == (1, 50)
    assert v.ready(Allocation(9, 2, 0, 50)) and not v.ready(Allocation(9, 2, 0, 60))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 400), min_size=1, max_size=120),
    st.integers(0, 2**32 - 1),
)
def test_simulated_writers_never_overwrite_live_bytes(sizes: list[int], seed: int) -> None:
    """Writers write when ready, readers free in random order; a byte is never written while
    an older allocation that covers it is still live, and everything completes."""
    rng = random.Random(seed)
    ring = RingAllocator(1000, 10)
    owner: list[int | None] = [None] * 1000  # which live allocation's data sits in each byte
    pending = [ring.allocate(n, i) for i, n in enumerate(sizes)]  # overcommitted up front
    written: list[Allocation] = []
    view = WatermarkView()
    steps = 0
    while pending or written:
        steps += 1
        assert steps < 100_000, "no progress: the readiness rule deadlocked"
        view.update(ring.watermark)
        for alloc in list(pending):
            if view.ready(alloc):
                for i in range(alloc.offset, alloc.end):
                    assert owner[i] is None, f"byte {i} overwritten while live"
                    owner[i] = alloc.id
                pending.remove(alloc)
                written.append(alloc)
            else:
                break  # writers write their allocations in order
        if written and rng.random() < 0.7:
            done = written.pop(rng.randrange(len(written)))
            for i in range(done.offset, done.end):
                owner[i] = None
            ring.free(done.id)
    assert ring.live == 0
