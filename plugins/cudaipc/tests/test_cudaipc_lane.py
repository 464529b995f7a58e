"""The lean lane (:mod:`kvwire.session.prefill.lane`, ``cudaipc``'s
:mod:`kvwire_cudaipc.lane`) between two managers of this process on host stand-ins
(:mod:`kvwire_cudaipc.host_stand_ins`: pools registered as GPU memory, a page mover that
copies on the host, events a test may hold "in flight"). No GPU here: CUDA IPC and the
kernel are the stand-ins; the session layer, the lane and the backend's Python are real."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvwire.page_lane import LaneLaunch, LaneWrite
from kvwire.session import KVPoll
from kvwire.testing.kvfill import count_mismatches, fill_pages
from kvwire.testing.pair import Pair, config, no_rooms, wait_for
from kvwire_cudaipc import host_stand_ins
from kvwire_cudaipc.lane import CudaIpcLane


@pytest.fixture
def lane_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of writes of every lane launch, in order (the lane's launch wrapped)."""
    seen: list[int] = []
    launch = CudaIpcLane.launch

    def counted(self: CudaIpcLane, writes: Any, wake: Any) -> LaneLaunch:
        seen.append(len(writes))
        return launch(self, writes, wake)

    monkeypatch.setattr(CudaIpcLane, "launch", counted)
    return seen


def make_pair(
    monkeypatch: pytest.MonkeyPatch,
    backend: str = "cudaipc",
    options: dict[str, Any] | None = None,
    **control: Any,
) -> Pair:
    """A pair over ``backend`` (its ``options``) on the stand-ins, its events gated
    (:class:`~kvwire_cudaipc.host_stand_ins.GatedEvent`, open unless a test closes it)."""
    host_stand_ins.install_for_managers(monkeypatch.setattr, event=host_stand_ins.GatedEvent)
    host_stand_ins.GatedEvent.gate.set()
    cfg = config(secret="lane-test", backend=backend, staging="direct", num_workers=1, **control)
    if options:
        cfg = cfg.model_copy(update={"transfer_backend_options": options})
    return Pair(cfg, slots=64, registered=host_stand_ins.vram_layout)


def closing(p: Pair) -> Iterator[Pair]:
    """A fixture's life of pair ``p``: yielded, then its events let end and it is closed."""
    try:
        yield p
    finally:
        host_stand_ins.GatedEvent.gate.set()
        p.close()


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    yield from closing(make_pair(monkeypatch))


def test_whole_requests_take_the_lane_others_the_general_path(
    pair: Pair, lane_writes: list[int]
) -> None:
    """A request sent as one chunk goes through the lane (one write per request); a
    request of two chunks takes the general path (ordered chunks), and both land whole."""
    pair.transfer(1, pages=4, chunks=(4,))
    assert sum(lane_writes) == 1
    pair.transfer(2, pages=4, chunks=(2, 2))
    assert sum(lane_writes) == 1
    pair.transfer(3, pages=3, chunks=(3,))
    assert sum(lane_writes) == 2
    wait_for(lambda: no_rooms(pair.prefill) and no_rooms(pair.decode))


def test_a_burst_goes_out_in_shared_launches_every_element_right(
    pair: Pair, lane_writes: list[int]
) -> None:
    """48 one-page requests asked for first, then sent in one burst: the worker's turns
    launch several together (fewer launches than requests), and each lands its own bytes."""
    n = 48
    src = np.arange(n)
    rx = []
    for i in range(n):
        r = pair.decode.receiver(200 + i, pair.addr)
        r.init()
        r.send_metadata(src[i : i + 1], aux_index=i)
        rx.append(r)
    fill_pages(pair.play, pair.parr, src, 0)
    tx = []
    for i in range(n):
        s = pair.prefill.sender(200 + i)
        wait_for(lambda s=s: s.poll() >= KVPoll.WaitingForInput)
        s.init(1, aux_index=i)
        tx.append(s)
    for i, s in enumerate(tx):
        s.send(src[i : i + 1], last=True)
    wait_for(lambda: all(r.poll() == KVPoll.Success for r in rx), timeout=60)
    wait_for(lambda: all(s.poll() == KVPoll.Success for s in tx), timeout=60)
    assert count_mismatches(pair.dlay, pair.darr, src, 0) == 0
    assert sum(lane_writes) == n
    assert len(lane_writes) < n  # turns carried several writes each
    for r, s in zip(rx, tx, strict=True):
        r.clear()
        s.clear()
    wait_for(lambda: no_rooms(pair.prefill) and no_rooms(pair.decode))


def test_a_failed_launch_fails_both_sides_and_the_link_serves_on(
    pair: Pair, lane_writes: list[int]
) -> None:
    """The mover's launch raises: the turn's request fails on both sides naming the launch,
    decode's pages quiesce (no write counted in flight), and the next request moves."""

    def broken(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("stand-in launch failure")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_stand_ins.HostPages, "copy_batch", broken)
        s, r, src, _ = pair.start(11, 2)
        s.send(src, last=True)
        wait_for(lambda: s.poll() is KVPoll.Failed and r.poll() is KVPoll.Failed, timeout=10)
        assert "launch failed" in str(r.failure_report())
        assert lane_writes == [1]
        wait_for(r.writes_quiesced, timeout=10)
        s.clear()
        r.clear()
    pair.transfer(12, pages=2, chunks=(2,))
    wait_for(lambda: no_rooms(pair.prefill) and no_rooms(pair.decode))


def test_an_overdue_launch_fails_at_once_but_stays_counted_until_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel that does not end within transfer_timeout_s: the request fails on both sides
    then, but decode may not reuse its pages (prefill does not answer that no write is in
    flight) until the kernel ended; after it, everything quiesces and the link serves on."""
    p = make_pair(monkeypatch, transfer_timeout_s=0.5)
    try:
        host_stand_ins.GatedEvent.gate.clear()
        s, r, src, _ = p.start(21, 2)
        s.send(src, last=True)
        wait_for(lambda: s.poll() is KVPoll.Failed and r.poll() is KVPoll.Failed, timeout=10)
        assert "transfer_timeout_s" in str(r.failure_report())
        assert p.prefill.room_tables()["writes_inflight"] == 1  # the kernel still runs
        assert not r.writes_quiesced()
        host_stand_ins.GatedEvent.gate.set()  # the kernel ends
        wait_for(r.writes_quiesced, timeout=10)
        wait_for(lambda: p.prefill.room_tables()["writes_inflight"] == 0, timeout=10)
        s.clear()
        r.clear()
        p.transfer(22, pages=2, chunks=(2,))
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
    finally:
        host_stand_ins.GatedEvent.gate.set()
        p.close()


def test_a_write_that_fails_its_check_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lane checks each write as ``submit_pages`` does: of two writes launched together,
    the one whose pages lie outside the pools fails with the check's reason and the other
    lands (no request fails for another's problem)."""
    p = make_pair(monkeypatch)
    try:
        p.transfer(31, pages=2, chunks=(2,))  # linked, the pair prepared
        lane = p.prefill.ctx.backend.page_lane
        assert lane is not None
        good, bad = _two_writes(p)
        woke: list[bool] = []
        launch = lane.launch([good, bad], lambda: woke.append(True))
        wait_for(lambda: launch.done, timeout=10)
        assert launch.poll is None  # let go with the launch: no cycle left per turn
        assert launch.errors[0] is None
        assert launch.errors[1] is not None and "out of range" in launch.errors[1]
        assert woke == [True]
    finally:
        p.close()


def _two_writes(p: Pair) -> tuple[LaneWrite, LaneWrite]:
    """Two lane writes on the pair's prepared KV tables: pages 0-1 to 40-41, and a page
    beyond prefill's pool (its note, an empty frame, is sent for the good one only)."""
    peer = p.prefill.ctx.peers.get(p.decode.ctx.session)
    assert peer is not None
    link = peer.link
    mapper, pair = link.mapper, link.pairs["kv"]
    ok = mapper.page_chunk(np.array([0, 1]), np.array([40, 41]))
    bad = mapper.page_chunk(np.array([0]), np.array([41]))
    assert ok is not None and bad is not None
    bad = type(bad)(bad.geometry, np.array([10_000]), bad.dst_pages)  # unchecked, out of range
    return LaneWrite(pair, ok, b""), LaneWrite(pair, bad, b"")


@pytest.fixture
def listed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    """A pair over the list ``cudaipc,flaky`` on the stand-ins (``flaky``,
    :mod:`kvwire.testing.flaky`: ``tcp`` that fails on command, here taking the stand-in GPU
    memory too, so it is a fallback that moves it over TCP): the shape of ``auto`` on a GPU
    host, whose first member offers the lane."""
    from kvwire import plugins
    from kvwire.plugins import PluginRegistry
    from kvwire.testing import flaky

    caps = flaky.FlakyTcpBackend.capabilities.model_copy(update={"vram": True})
    monkeypatch.setattr(flaky.FlakyTcpBackend, "capabilities", caps)
    monkeypatch.setattr(plugins, "_registry", PluginRegistry(extra=[("flaky", flaky)]))
    yield from closing(make_pair(monkeypatch, "cudaipc,flaky"))


def test_a_backend_list_keeps_the_lane_of_its_first_member(
    listed: Pair, lane_writes: list[int]
) -> None:
    """Over ``cudaipc,flaky`` whole requests still take ``cudaipc``'s lane (through the
    list's), and land whole."""
    assert listed.prefill.ctx.backend.page_lane is not None
    for room in (1, 2, 3):
        listed.transfer(room, pages=2, chunks=(2,))
    assert sum(lane_writes) == 3


def test_a_lane_write_failed_for_its_link_fails_over_and_the_request_succeeds(
    listed: Pair, lane_writes: list[int]
) -> None:
    """The lane's launch fails (the link's fault, not the write's): the list fails
    ``cudaipc`` over for the link (counted) and the write goes again on ``flaky``, so the
    request succeeds with every element right, on both sides; later requests take the
    fallback until the probe brings ``cudaipc`` back."""

    def broken(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("stand-in launch failure")

    multi = listed.prefill.ctx.backend
    before = multi.failovers  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_stand_ins.HostPages, "copy_batch", broken)
        listed.transfer(11, pages=2, chunks=(2,))  # verified element by element
        assert lane_writes == [1]
        assert multi.failovers == before + 1  # type: ignore[attr-defined]
        listed.transfer(12, pages=2, chunks=(2,))  # on the fallback: no lane write
        assert lane_writes == [1]
    wait_for(lambda: no_rooms(listed.prefill) and no_rooms(listed.decode))


def test_the_handshake_says_whether_the_lane_serves_the_link(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefill's handshake line names the lean lane's verdict for the link: whole-request
    page writes over ``cudaipc``; over ``tcp``, which offers none, the reason."""
    import logging

    from kvwire.testing.pair import pair as tcp_pair

    caplog.set_level(logging.INFO, logger="kvwire.session.prefill.links")
    p = make_pair(monkeypatch)
    try:
        p.transfer(1, pages=2, chunks=(2,))
    finally:
        p.close()
    with tcp_pair(config(secret="lane-tcp")) as t:
        t.transfer(2, pages=2, chunks=(2,))
    lines = [r.getMessage() for r in caplog.records if "handshake with" in r.getMessage()]
    assert any("lean lane: whole-request page writes" in m for m in lines), lines
    assert any("lean lane: the backend offers none" in m for m in lines), lines


def test_each_reason_a_link_leaves_the_lane(pair: Pair) -> None:
    """:func:`~kvwire.session.prefill.links.lane_problem` over a real link changed one field
    at a time: each change gives its own reason; the link as it is gives none."""
    import dataclasses

    from kvwire.session.prefill.links import lane_problem

    pair.transfer(1, pages=2, chunks=(2,))
    peer = pair.prefill.ctx.peers.get(pair.decode.ctx.session)
    assert peer is not None
    link = peer.link
    assert lane_problem(link, True) is None and link.lane_problem is None
    kv = link.pools["kv"]
    changed = {
        "the backend offers none": (link, False),
        "KV checksums are on": (dataclasses.replace(link, checksums=object()), True),
        "this rank sends no KV to it": (dataclasses.replace(link, dummy=True), True),
        "the aux row moves as a write of its own": (
            dataclasses.replace(link, sends_aux=True, aux_in_note=False),
            True,
        ),
        "the link is staged": (
            dataclasses.replace(link, pools={"kv": dataclasses.replace(kv, staged=True)}),
            True,
        ),
        "its KV rows mix memory kinds": (dataclasses.replace(link, splits={kv.table: None}), True),
        "no prepared KV tables": (dataclasses.replace(link, pairs={}), True),
    }
    for why, (changed_link, offered) in changed.items():
        assert lane_problem(changed_link, offered) == why


def test_batch_max_bytes_zero_turns_the_lane_off(
    monkeypatch: pytest.MonkeyPatch, lane_writes: list[int]
) -> None:
    """``batch_max_bytes=0`` (a launch and an event per chunk): the lane takes no chunk, and
    whole requests still land through the general path."""
    p = make_pair(monkeypatch, options={"batch_max_bytes": 0})
    try:
        for room in (1, 2):
            p.transfer(room, pages=2, chunks=(2,))
        assert lane_writes == []
    finally:
        p.close()
