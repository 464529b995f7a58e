"""The decode-side staging ring: allocation that never waits, and watermarks.

A decode rank owns one ring of ``size`` bytes. Each staged chunk gets an allocation
``(id, round, offset, end)``; allocations advance a head through the ring and wrap into the next
*round* when they do not fit at its end. Allocation never waits: a writer may hold an allocation
whose bytes are still in use by an older round, and simply waits to write until the ring says
they are free.

Freed space is published as a *watermark* ``(round, tail)``: the position of the oldest
allocation still live (everything before it is free), or the head when none is. A writer may
write an allocation of round ``k`` ending at ``end`` when ``k == 0``, or the watermark's round is
above ``k - 1``, or it is ``k - 1`` and ``end <= tail`` (:func:`ready`). Watermarks only grow;
writers keep the largest they have seen (:class:`WatermarkView`), so a reordered or repeated
broadcast is harmless.

Used by the control thread and the transfer workers under the manager's lock; not thread-safe
on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from kvwire.errors import ConfigError

Watermark = tuple[int, int]


@dataclass(frozen=True)
class Allocation:
    """Bytes ``[offset, end)`` of the ring in round ``round``."""

    id: int
    round: int
    offset: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.offset


def ready(alloc: Allocation, watermark: Watermark) -> bool:
    """Whether the bytes of ``alloc`` are free to write, given the ring's ``watermark``."""
    k = alloc.round
    return k == 0 or watermark[0] > k - 1 or (watermark[0] == k - 1 and alloc.end <= watermark[1])


class RingAllocator:
    """Allocations in ring order; idempotent by key (a repeated request gets the same answer)."""

    def __init__(self, size: int, granularity: int = 1) -> None:
        if size <= 0 or granularity <= 0 or size % granularity:
            raise ConfigError(
                f"staging ring of {size} bytes must be a positive multiple of its granularity "
                f"({granularity} bytes)"
            )
        self.size = size
        self.granularity = granularity
        self._round = 0
        self._head = 0
        self._next_id = 1
        self._live: OrderedDict[int, Allocation] = OrderedDict()
        self._by_key: dict[Hashable, Allocation] = {}
        self._key_of: dict[int, Hashable] = {}

    def rounded(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the granularity."""
        g = self.granularity
        return -(-nbytes // g) * g

    def allocate(self, nbytes: int, key: Hashable) -> Allocation:
        """Allocate ``nbytes`` (rounded up) for ``key``, or return ``key``'s live allocation."""
        found = self._by_key.get(key)
        if found is not None:
            return found
        need = self.rounded(nbytes)
        if need <= 0 or need > self.size:
            raise ConfigError(
                f"a staged chunk of {nbytes} bytes does not fit the {self.size}-byte staging "
                "ring; raise ring_bytes or lower the chunk size"
            )
        if self._head + need > self.size:
            self._round += 1
            self._head = 0
        alloc = Allocation(self._next_id, self._round, self._head, self._head + need)
        self._next_id += 1
        self._head += need
        self._live[alloc.id] = alloc
        self._by_key[key] = alloc
        self._key_of[alloc.id] = key
        return alloc

    def ready_now(self, nbytes: int) -> bool:
        """Whether an allocation of ``nbytes`` made now would be free to write at once (the
        readiness rule against the current watermark); allocates nothing."""
        need = self.rounded(nbytes)
        if need <= 0 or need > self.size:
            return False
        rnd, off = self._round, self._head
        if off + need > self.size:
            rnd, off = rnd + 1, 0
        return ready(Allocation(0, rnd, off, off + need), self.watermark)

    def free(self, alloc_id: int) -> bool:
        """Free an allocation (idempotent); True if the watermark moved."""
        before = self.watermark
        if self._live.pop(alloc_id, None) is None:
            return False
        self._by_key.pop(self._key_of.pop(alloc_id), None)
        return self.watermark != before

    def free_where(self, pred: Callable[[Any], bool]) -> int:
        """Free every allocation whose key satisfies ``pred(key)``; returns how many."""
        ids = [i for i, k in self._key_of.items() if pred(k)]
        for i in ids:
            self.free(i)
        return len(ids)

    def get(self, key: Hashable) -> Allocation | None:
        """The live allocation of ``key``, if any."""
        return self._by_key.get(key)

    @property
    def watermark(self) -> Watermark:
        """Position of the oldest live allocation, or of the head when none is live."""
        oldest = next(iter(self._live.values()), None)
        if oldest is None:
            return (self._round, self._head)
        return (oldest.round, oldest.offset)

    @property
    def live(self) -> int:
        """Allocations not yet freed."""
        return len(self._live)

    @property
    def live_bytes(self) -> int:
        """Bytes held by live allocations."""
        return sum(a.nbytes for a in self._live.values())


class WatermarkView:
    """A writer's view of one ring's watermark: keeps the largest seen."""

    def __init__(self) -> None:
        self.value: Watermark = (0, 0)

    def update(self, wm: Watermark) -> bool:
        """Merge a broadcast; True if it moved forward."""
        wm = (int(wm[0]), int(wm[1]))
        if wm > self.value:
            self.value = wm
            return True
        return False

    def ready(self, alloc: Allocation) -> bool:
        """Whether ``alloc`` may be written now."""
        return ready(alloc, self.value)
