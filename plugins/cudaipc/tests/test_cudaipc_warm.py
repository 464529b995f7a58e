"""A link's page writes prepared at its handshake (``PageLane.warm``: ``cudaipc``'s lane
gathers the pair's addresses and compiles the page mover's kernels on a thread of its own),
between two managers of this process on host stand-ins (:mod:`kvwire_cudaipc.host_stand_ins`:
their mover records what it was asked to warm; no GPU here, so nothing compiles: the compile
itself is checked on two GPUs by ``scripts/gpu_warm_check.py``)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from kvwire.testing.pair import Pair, config, no_rooms, wait_for
from kvwire_cudaipc import host_stand_ins
from kvwire_cudaipc.lane import CudaIpcLane
from kvwire_cudaipc.state import IpcPair


def _pair(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any] | None = None
) -> tuple[Pair, host_stand_ins.HostPages]:
    movers = host_stand_ins.install_for_managers(monkeypatch.setattr)
    cfg = config(secret="warm-test", backend="cudaipc", staging="direct", num_workers=1)
    if options:
        cfg = cfg.model_copy(update={"transfer_backend_options": options})
    return Pair(cfg, slots=64, registered=host_stand_ins.vram_layout), movers


def _warmed_link(p: Pair, movers: host_stand_ins.HostPages) -> tuple[Any, Any]:
    """Once the mover was asked to warm ahead (at prefill's start) and then the pair's link:
    the link's KV pair and geometry."""
    wait_for(lambda: len(movers.warmed) == 2)
    peer = p.prefill.ctx.peers.get(p.decode.ctx.session)
    assert peer is not None
    kv = peer.link.pools["kv"]
    return peer.link.pairs[kv.table], kv.mapper.page_geometry


def test_a_prefill_rank_warms_writes_to_its_own_layout_at_its_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before any request or link, the prefill rank asks its mover to warm the writes of a
    link to a decode rank of its own layout, with its own buffers' addresses on both sides;
    that geometry is the one the pair's link (same layout) then moves with."""
    p, movers = _pair(monkeypatch)
    try:
        wait_for(lambda: len(movers.warmed) == 1)
        assert not p.prefill.ctx.peers.snapshot()  # no link yet
        ahead, src, dst = movers.warmed[0]
        own = np.array([b.addr for b in p.play.buffers], dtype=np.int64)
        assert np.array_equal(src, own[ahead.src_rows // ahead.src_slots])
        assert np.array_equal(dst, own[ahead.dst_rows // ahead.dst_slots])
        p.transfer(1, pages=2, chunks=(2,))
        _, geometry = _warmed_link(p, movers)
        fields = ("src_slot", "dst_slot", "src_row", "dst_row", "n", "tokens", "heads")
        assert all(getattr(ahead, f) == getattr(geometry, f) for f in fields)
    finally:
        p.close()


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "general-path"])
def test_the_handshake_warms_the_links_page_writes(
    monkeypatch: pytest.MonkeyPatch, lane: bool
) -> None:
    """Once a link is built, the mover is asked to warm exactly the link's page geometry
    with its pair's addresses, once per link, whether or not the lane carries its chunks
    (``batch_max_bytes=0``: every chunk takes the general path, which launches the same
    mover); requests land as before (element by element)."""
    p, movers = _pair(monkeypatch, None if lane else {"batch_max_bytes": 0})
    try:
        p.transfer(1, pages=3, chunks=(3,))
        pair, geometry = _warmed_link(p, movers)
        g, src, dst = movers.warmed[1]
        assert g is geometry
        st: IpcPair = pair.state
        want_src, want_dst = st.addresses(g)
        assert np.array_equal(src, want_src) and np.array_equal(dst, want_dst)
        p.transfer(2, pages=2, chunks=(2,))
        assert len(movers.warmed) == 2  # per link, not per request
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
    finally:
        p.close()


def test_a_failed_warm_up_is_logged_and_the_link_serves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A warm-up that raises on the handshake thread, or whose compile raises on the lane's
    thread, is logged; the handshake completes and requests land whole."""
    p, movers = _pair(monkeypatch)

    def compile_fails(*args: Any) -> int:
        raise RuntimeError("stand-in compile failure")

    monkeypatch.setattr(movers, "warm", compile_fails)
    caplog.set_level(logging.WARNING)
    try:
        p.transfer(1, pages=2, chunks=(2,))  # verified element by element
        failed = "compiling cudaipc's page mover"
        wait_for(lambda: any(failed in r.getMessage() for r in caplog.records))
    finally:
        p.close()

    def warm_fails(self: CudaIpcLane, *args: Any) -> None:
        raise RuntimeError("stand-in warm-up failure")

    monkeypatch.setattr(CudaIpcLane, "warm", warm_fails)
    p, movers = _pair(monkeypatch)
    try:
        p.transfer(2, pages=2, chunks=(2,))
        assert any("preparing page writes failed" in r.getMessage() for r in caplog.records)
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
    finally:
        p.close()


def test_a_closed_backend_starts_no_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the backend's close, a warm-up asked late (a handshake racing shutdown) starts
    nothing and raises nothing."""
    p, movers = _pair(monkeypatch)
    try:
        p.transfer(1, pages=2, chunks=(2,))
        pair, geometry = _warmed_link(p, movers)
        lane = p.prefill.ctx.backend.page_lane
        assert isinstance(lane, CudaIpcLane)
        lane.close()
        lane.warm(pair, geometry)
        lane.warm_ahead(geometry, np.zeros(1, np.int64), np.zeros(1, np.int64))
        assert len(movers.warmed) == 2
    finally:
        p.close()
