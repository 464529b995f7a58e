"""Two managers of this process linked over ``cudaipc`` on host stand-ins
(:mod:`kvwire_cudaipc.host_stand_ins`: pools registered as GPU memory, a page mover that
copies on the host, events done at once, the link checks passed): the path a GPU host's
prefill worker runs for every equal-TP request (page writes held and launched per turn, the
note after the event, decode's Success), every element checked. No GPU here: CUDA IPC itself
is the stand-in, the session layer and the backend's Python are real."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvwire.session import KVPoll
from kvwire.testing.kvfill import count_mismatches, fill_pages
from kvwire.testing.pair import Pair, config, no_rooms, wait_for
from kvwire_cudaipc import host_stand_ins


@pytest.fixture
def pages(monkeypatch: pytest.MonkeyPatch) -> host_stand_ins.HostPages:
    mover = host_stand_ins.HostPages()
    host_stand_ins.install(monkeypatch.setattr, mover)
    host_stand_ins.install_links(monkeypatch.setattr)
    return mover


@pytest.fixture
def pair(pages: host_stand_ins.HostPages) -> Iterator[Pair]:
    cfg = config(secret="pair-test", backend="cudaipc", staging="direct", num_workers=1)
    p = Pair(cfg, slots=64, registered=host_stand_ins.vram_layout)
    try:
        yield p
    finally:
        p.close()


def test_requests_move_as_page_writes_and_land_whole(
    pair: Pair, pages: host_stand_ins.HostPages
) -> None:
    """Requests of one and of two chunks: every element lands, each chunk was a page write
    of the mover (not rows over the side channel), and nothing is left in any table."""
    for room, chunks in ((1, (4,)), (2, (2, 2)), (3, (1, 3))):
        before = pages.launches
        pair.transfer(room, pages=4, chunks=chunks)
        assert 1 <= pages.launches - before <= len(chunks)
    wait_for(lambda: no_rooms(pair.prefill) and no_rooms(pair.decode))


def test_sixty_four_requests_in_flight_each_verified(
    pair: Pair, pages: host_stand_ins.HostPages
) -> None:
    """64 requests of one page asked for at once, then sent in one burst (the worker's turns
    may hold several page writes and launch them together): every one succeeds on both sides
    with its own bytes, each through the page mover."""
    n, per = 64, 1
    src = np.arange(n * per).reshape(n, per)  # each request its own slot, the same on decode
    rx, tx = [], []
    for i in range(n):
        r = pair.decode.receiver(100 + i, pair.addr)
        r.init()
        r.send_metadata(src[i], aux_index=i)
        rx.append(r)
    fill_pages(pair.play, pair.parr, src.ravel(), 0)
    before = pages.launches
    for i in range(n):
        s = pair.prefill.sender(100 + i)
        wait_for(lambda s=s: s.poll() >= KVPoll.WaitingForInput)
        s.init(per, aux_index=i)
        tx.append(s)
    for i, s in enumerate(tx):
        s.send(src[i], last=True)
    wait_for(lambda: all(r.poll() == KVPoll.Success for r in rx), timeout=60)
    wait_for(lambda: all(s.poll() == KVPoll.Success for s in tx), timeout=60)
    assert count_mismatches(pair.dlay, pair.darr, src.ravel(), 0) == 0
    assert 0 < pages.launches - before <= n
    for r, s in zip(rx, tx, strict=True):
        r.clear()
        s.clear()
    wait_for(lambda: no_rooms(pair.prefill) and no_rooms(pair.decode))
