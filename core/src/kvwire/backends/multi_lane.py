"""A backend list's lean lane (:mod:`kvwire.page_lane`): the lane of each link's current
member, so ``--transfer-backend auto`` (``cudaipc`` first on a GPU host) keeps it.

A write goes to the lane of its link's first healthy member, when that member offers one
and takes the write (:meth:`MultiLane.takes`); a turn's writes to members of different
links are launched per member and joined into one launch. When a write fails there for its
link (not its own check), the member is failed over for the link as a failed transfer fails
it (:meth:`~kvwire.backends.multi.MultiBackend._member_failed`: logged, counted, probed),
and the write is marked :attr:`~kvwire.page_lane.LaneLaunch.retry` when another member of
the link is healthy: the worker posts it again on its general path, which goes to that
member. A failed write delivered no note, so decode counts the chunk once.

Lock contract: the list's routes lock for reading a link's health (never across a member
call); the joined launch's own lock for its count of members still running.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from kvwire.backend import TransferBackend
from kvwire.backends.multi_routes import Pair as _Pair
from kvwire.backends.multi_routes import Route
from kvwire.page_form import PageGeometry
from kvwire.page_lane import LaneLaunch, LaneWrite, PageLane
from kvwire.transfers import PreparedPair


class _List(Protocol):
    """What the lane uses of its list (:class:`~kvwire.backends.multi.MultiBackend`)."""

    members: list[TransferBackend]
    _routes_lock: threading.Lock

    def _member_failed(self, route: Route, i: int, why: str) -> None: ...


@dataclass(eq=False)
class _Joined:
    """One turn's launch on a list: each member's launch and its writes' places in the
    turn's. It finishes once ``counted`` reaches ``expected``: every member's launch done,
    and the launching call returned."""

    launch: LaneLaunch
    parts: list[tuple[int, list[int], LaneLaunch]] = field(default_factory=list)
    expected: int = 1
    counted: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class MultiLane:
    """The lane of a :class:`~kvwire.backends.multi.MultiBackend` (its ``page_lane``)."""

    def __init__(self, multi: _List) -> None:
        self._multi = multi

    def _member(self, pair: PreparedPair) -> tuple[int, PreparedPair, PageLane] | None:
        """The link's first healthy member, its pair and its lane (None: it has none)."""
        st: _Pair = pair.state
        route, multi = st.route, self._multi
        with multi._routes_lock:
            i = next((i for i in route.order if route.healthy[i] and i in st.inner), None)
        if i is None:
            return None
        lane = multi.members[i].page_lane
        return None if lane is None else (i, st.inner[i], lane)

    def takes(self, pair: PreparedPair, nbytes: int) -> bool:
        """Prefill worker: the link's current member offers a lane that takes the chunk."""
        m = self._member(pair)
        return m is not None and m[2].takes(m[1], nbytes)

    def launch(self, writes: Sequence[LaneWrite], wake: Callable[[], None]) -> LaneLaunch:
        """Prefill worker, at its turn's end: each write on its link's current member's
        lane, one launch per member, joined."""
        joined = _Joined(LaneLaunch(writes, wake))
        by_member: dict[int, tuple[PageLane, list[int], list[LaneWrite]]] = {}
        for k, w in enumerate(writes):
            m = self._member(w.pair)
            if m is None:  # the link failed over since the write was taken: retry it
                joined.launch.fail([k], "the link's backend offers no lane now")
                joined.launch.retry[k] = True
                continue
            i, inner, lane = m
            entry = by_member.setdefault(i, (lane, [], []))
            entry[1].append(k)
            entry[2].append(LaneWrite(inner, w.chunk, w.note))
        joined.expected = len(by_member) + 1  # + this call's share, counted at its end
        for i, (lane, places, inner_writes) in by_member.items():
            refused = None
            try:
                part = lane.launch(inner_writes, lambda: self._count(joined))
            except Exception as exc:
                why = f"the lane's launch failed: {exc}"
                part = refused = LaneLaunch.refused(inner_writes, why)
            with joined.lock:
                joined.parts.append((i, places, part))
            if refused is not None:  # no wake will count it
                self._count(joined)
        joined.launch.poll = lambda: self._poll(joined)
        self._count(joined)
        return joined.launch

    def warm(self, pair: PreparedPair, geometry: PageGeometry) -> None:
        """Prefill's handshake thread: every member of the link that offers a lane warms its
        own pair (a failover later finds the next member ready too)."""
        st: _Pair = pair.state
        for i, inner in st.inner.items():
            lane = self._multi.members[i].page_lane
            if lane is not None:
                lane.warm(inner, geometry)

    def warm_ahead(
        self, geometry: PageGeometry, src_addrs: NDArray[np.int64], dst_addrs: NDArray[np.int64]
    ) -> None:
        """Prefill, at its start: every member that offers a lane warms ahead."""
        for member in self._multi.members:
            if member.page_lane is not None:
                member.page_lane.warm_ahead(geometry, src_addrs, dst_addrs)

    def _poll(self, joined: _Joined) -> None:
        """A worker's poll: each member's launch polled (its ended groups handled)."""
        with joined.lock:
            polls = [p.poll for _, _, p in joined.parts]  # read once (None once finished)
        for poll in polls:
            if poll is not None:
                poll()

    def _count(self, joined: _Joined) -> None:
        """A member's launch finished, or the launching call returned (any thread): after
        the last of them, every member's outcomes go into the turn's launch, which
        finishes."""
        with joined.lock:
            joined.counted += 1
            if joined.counted != joined.expected:
                return
            parts = list(joined.parts)
        for i, places, part in parts:
            self._merge(joined.launch, i, places, part)
        joined.launch.finish()

    def _merge(self, launch: LaneLaunch, i: int, places: list[int], part: LaneLaunch) -> None:
        """Member ``i``'s outcomes into the turn's launch: a write failed for its link fails
        the member over (once) and is retried where the link has another healthy member."""
        multi = self._multi
        for j, k in enumerate(places):
            why = part.errors[j]
            if why is None:
                continue
            launch.fail([k], f"{multi.members[i].name}: {why}", link=part.links[j])
            if not part.links[j]:
                continue
            route = launch.writes[k].pair.state.route
            multi._member_failed(route, i, why)
            with multi._routes_lock:
                launch.retry[k] = any(route.healthy[o] for o in route.order if o != i)
