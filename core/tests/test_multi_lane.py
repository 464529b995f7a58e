"""A backend list's lean lane (:mod:`kvwire.backends.multi_lane`) joining its members'
launches, with member lanes played by small fakes (no backend in this repository but
``cudaipc`` offers a lane, so a turn over two members with lanes cannot be made with real
ones): the routing of each write to its link's current member, the join (the turn's launch
finishes once every member's did), the failover of a member whose write failed for its link,
and retries only where the link has another healthy member."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvwire.backends.multi_lane import MultiLane
from kvwire.backends.multi_routes import Pair, Route
from kvwire.page_form import PageChunk, PageGeometry
from kvwire.page_lane import LaneLaunch, LaneWrite
from kvwire.transfers import PreparedPair


class FakeLane:
    """A member's lane: launches are kept, finished by the test (``finish_all``)."""

    def __init__(self, fail: dict[int, tuple[str, bool]] | None = None, raises: bool = False):
        self.launches: list[LaneLaunch] = []
        self.fail = fail or {}
        self.raises = raises
        self.warmed: list[tuple[int, PageGeometry]] = []

    def takes(self, pair: PreparedPair, nbytes: int) -> bool:
        return True

    def warm(self, pair: PreparedPair, geometry: PageGeometry) -> None:
        self.warmed.append((pair.id, geometry))

    def warm_ahead(self, geometry: PageGeometry, src: Any, dst: Any) -> None:
        self.warmed.append((-1, geometry))

    def launch(self, writes: Sequence[LaneWrite], wake: Callable[[], None]) -> LaneLaunch:
        if self.raises:
            raise RuntimeError("member lane broke")
        launch = LaneLaunch(writes, wake)
        self.launches.append(launch)
        return launch

    def finish_all(self) -> None:
        for launch in self.launches:
            for i, (why, link) in self.fail.items():
                launch.fail([i], why, link=link)
            launch.finish()


class FakeMember:
    def __init__(self, name: str, lane: FakeLane | None) -> None:
        self.name = name
        self.page_lane = lane


class FakeList:
    """The list's side the lane uses: members, the routes lock, the failover hook."""

    def __init__(self, members: list[FakeMember]) -> None:
        self.members: list[Any] = members
        self._routes_lock = threading.Lock()
        self.failed: list[tuple[str, int, str]] = []

    def _member_failed(self, route: Route, i: int, why: str) -> None:
        self.failed.append((route.peer, i, why))
        route.healthy[i] = False


def _chunk() -> PageChunk:
    one = np.zeros(1, dtype=np.int64)
    g = PageGeometry(one, one, 1, 1, 1, 1, 8, 8, 8, 8, 8, 1, 4, 4)
    return PageChunk(g, one, one, checked=True)


def _write(peer: str, order: list[int], healthy: dict[int, bool]) -> LaneWrite:
    route = Route(peer, order, {i: peer for i in order}, {}, healthy)
    lens = np.zeros(1, dtype=np.uint64)
    inner = {i: PreparedPair(10 + i, peer, 1, 1, lens, lens) for i in order}
    outer = PreparedPair(1, peer, 1, 1, lens, lens, state=Pair(route, inner, lens, lens))
    return LaneWrite(outer, _chunk(), b"note")


def test_writes_go_to_their_links_current_members_and_the_turn_joins_them() -> None:
    a, b = FakeLane(), FakeLane()
    multi = FakeList([FakeMember("a", a), FakeMember("b", b)])
    lane = MultiLane(multi)  # type: ignore[arg-type]
    w0 = _write("p0", [0, 1], {0: True, 1: True})  # member a
    w1 = _write("p1", [0, 1], {0: False, 1: True})  # a failed over: member b
    woke: list[bool] = []
    launch = lane.launch([w0, w1], lambda: woke.append(True))
    assert [len(x.writes) for x in a.launches] == [1] and [len(x.writes) for x in b.launches] == [1]
    assert a.launches[0].writes[0].pair.id == 10 and b.launches[0].writes[0].pair.id == 11
    a.finish_all()
    assert not launch.done and not woke  # b's launch still runs
    b.finish_all()
    assert launch.done and woke == [True] and launch.errors == [None, None]


def test_a_link_failure_fails_the_member_over_and_retries_where_a_fallback_is_healthy() -> None:
    a = FakeLane(fail={0: ("kernel failed", True), 1: ("kernel failed", True)})
    multi = FakeList([FakeMember("a", a), FakeMember("b", None)])
    lane = MultiLane(multi)  # type: ignore[arg-type]
    with_fallback = _write("p0", [0, 1], {0: True, 1: True})
    alone = _write("p1", [0], {0: True})
    launch = lane.launch([with_fallback, alone], lambda: None)
    a.finish_all()
    assert launch.done
    assert launch.errors == ["a: kernel failed", "a: kernel failed"]
    assert launch.retry == [True, False]  # p1 has no other member to carry it
    assert [(p, i) for p, i, _ in multi.failed] == [("p0", 0), ("p1", 0)]


def test_a_writes_own_failure_is_not_the_links() -> None:
    a = FakeLane(fail={0: ("pages out of range", False)})
    multi = FakeList([FakeMember("a", a), FakeMember("b", None)])
    lane = MultiLane(multi)  # type: ignore[arg-type]
    launch = lane.launch([_write("p0", [0, 1], {0: True, 1: True})], lambda: None)
    a.finish_all()
    assert launch.errors == ["a: pages out of range"] and launch.retry == [False]
    assert multi.failed == []  # the member stays the link's


def test_a_member_lane_that_raises_fails_its_writes_and_a_member_without_one_retries() -> None:
    multi = FakeList([FakeMember("a", FakeLane(raises=True)), FakeMember("b", None)])
    lane = MultiLane(multi)  # type: ignore[arg-type]
    on_a = _write("p0", [0, 1], {0: True, 1: True})
    no_lane = _write("p1", [1], {1: True})  # the link's member offers no lane
    launch = lane.launch([on_a, no_lane], lambda: None)
    assert launch.done
    assert launch.errors[0] is not None and "member lane broke" in launch.errors[0]
    assert launch.retry[0] is True  # a link failure, and member b is healthy for p0
    assert launch.errors[1] is not None and launch.retry[1] is True


def test_a_link_warms_every_member_lane_with_its_own_pair() -> None:
    """The list's warm-up goes to each member of the link that offers a lane (the one it
    may fail over to included), with that member's pair; a member without a lane and a
    member outside the link are left alone."""
    a, c = FakeLane(), FakeLane()
    multi = FakeList([FakeMember("a", a), FakeMember("b", None), FakeMember("c", c)])
    lane = MultiLane(multi)  # type: ignore[arg-type]
    w = _write("p0", [0, 1], {0: False, 1: True})  # c is not a member of this link
    g = w.chunk.geometry
    lane.warm(w.pair, g)
    assert a.warmed == [(10, g)] and c.warmed == []


def test_warming_ahead_goes_to_every_member_with_a_lane() -> None:
    a, c = FakeLane(), FakeLane()
    lane = MultiLane(FakeList([FakeMember("a", a), FakeMember("b", None), FakeMember("c", c)]))  # type: ignore[arg-type]
    g = _chunk().geometry
    one = np.zeros(1, dtype=np.int64)
    lane.warm_ahead(g, one, one)
    assert a.warmed == [(-1, g)] and c.warmed == [(-1, g)]
