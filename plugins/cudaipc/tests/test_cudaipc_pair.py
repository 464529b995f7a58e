"""Two managers of this process linked over ``cudaipc`` on host stand-ins
(:mod:`kvwire_cudaipc.host_stand_ins`: pools registered as GPU memory, a page mover that
copies on the host, events done at once, the link checks passed): the path a GPU host's
prefill worker runs for every equal-TP request (page writes held and launched per turn, the
note after the event, decode's Success), every element checked. No GPU here: CUDA IPC itself
is the stand-in, the session layer and the backend's Python are real."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvwire.config import KVWireConfig
from kvwire.errors import KVWireError
from kvwire.session import KVPoll, KVReceiver, KVSender
from kvwire.testing.kvfill import count_mismatches, fill_pages
from kvwire.testing.pair import MODEL, Pair, config, no_rooms, wait_for
from kvwire_cudaipc import host_stand_ins


def asked_for(s: KVSender) -> Callable[[], bool]:
    """Whether decode asked for ``s``'s request (prefill's poll says WaitingForInput)."""
    return lambda: s.poll() >= KVPoll.WaitingForInput


def both_are(r: KVReceiver, s: KVSender, status: KVPoll) -> Callable[[], bool]:
    """Whether a request's receiver and sender both poll ``status``."""
    return lambda: r.poll() == status and s.poll() == status


@pytest.fixture
def pages(monkeypatch: pytest.MonkeyPatch) -> host_stand_ins.HostPages:
    return host_stand_ins.install_for_managers(monkeypatch.setattr)


def cudaipc_config(**control: Any) -> KVWireConfig:
    """The pairs' configuration: ``cudaipc``, direct staging (bulk staging would allocate
    GPU buffers), one transfer worker, a secret; ``control`` adds control options."""
    return config(secret="pair-test", backend="cudaipc", staging="direct", num_workers=1, **control)


@pytest.fixture
def pair(pages: host_stand_ins.HostPages) -> Iterator[Pair]:
    cfg = cudaipc_config()
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
        wait_for(asked_for(s))
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


def test_decode_abort_mid_request_fails_prefill_and_quiesces(pair: Pair) -> None:
    """Decode aborts after the first of two chunks went out: prefill's request fails, decode
    reuses the pages only once prefill said no write of it is in flight, every table ends
    empty."""
    s, r, src, _ = pair.start(21, 2, dst=np.array([4, 5]))
    s.send(src[:1])
    r.abort()
    assert r.poll() is KVPoll.Failed
    wait_for(r.writes_quiesced, timeout=10)
    wait_for(lambda: s.poll() is KVPoll.Failed, timeout=10)
    s.clear()
    r.clear()
    wait_for(lambda: no_rooms(pair.prefill) and no_rooms(pair.decode), timeout=10)
    pair.transfer(22)  # the link still serves


def test_bad_pages_fail_both_sides_naming_them(pair: Pair) -> None:
    """A page past prefill's pool fails the request on both sides, naming the pages; nothing
    was written and the next request moves."""
    s, r, _, _ = pair.start(31, 2, dst=np.array([4, 5]))
    with pytest.raises(KVWireError, match="out of range"):
        s.send(np.array([0, 10_000]), last=True)
    wait_for(lambda: s.poll() is KVPoll.Failed and r.poll() is KVPoll.Failed, timeout=10)
    assert "out of range" in str(r.failure_report())
    s.clear()
    r.clear()
    pair.transfer(32)


def test_decode_restart_relinks_and_moves_again(pair: Pair) -> None:
    """Decode closes between requests and a new manager of the same name takes its place:
    prefill links to it again over cudaipc (its peer's handles gone, the new ones taken) and
    the next request lands whole."""
    from kvwire.session import KVManager, Role

    pair.transfer(41)
    pair.decode.close()
    cfg = cudaipc_config()
    pair.decode = KVManager(cfg, Role.DECODE, host_stand_ins.vram_layout(pair.dlay, pair.darr))
    pair.transfer(42)
    assert len(pair.prefill.peers) == 1


def test_decode_gone_with_requests_asked_fails_them_on_prefill(
    pair: Pair, pages: host_stand_ins.HostPages
) -> None:
    """Decode asked for eight requests, then closed before prefill sent: once prefill heard
    its goodbye every request has failed naming the lost peer (nothing to write into), the
    engine's later sends are taken and move nothing, and prefill's tables end empty once the
    requests are cleared."""
    tx = []
    before = pages.launches
    for i in range(8):
        r = pair.decode.receiver(50 + i, pair.addr)
        r.init()
        r.send_metadata(np.array([i]), aux_index=i)
        s = pair.prefill.sender(50 + i)
        wait_for(asked_for(s))
        s.init(1, aux_index=i)
        tx.append(s)
    pair.decode.close()
    wait_for(lambda: len(pair.prefill.peers) == 0)  # its goodbye heard: the peer is gone
    assert all(s.poll() is KVPoll.Failed for s in tx)  # failed then, not at a deadline
    for i, s in enumerate(tx):
        s.send(np.array([i]), last=True)  # a failed request's send is taken, moves nothing
    for s in tx:  # each names the lost peer
        with pytest.raises(Exception, match=r"decode peer .* lost"):
            s.failure_exception()
    assert pages.launches == before
    for s in tx:
        s.clear()
    wait_for(lambda: no_rooms(pair.prefill), timeout=10)


def test_layer_groups_move_as_their_layers_are_marked(pages: host_stand_ins.HostPages) -> None:
    """Layer-wise over cudaipc (row writes of each layer group): nothing lands before its
    layers are marked, a marked group lands while later layers are not, and the request ends
    whole in two chunks of four groups each."""
    model = MODEL.model_copy(update={"num_layers": 8})
    cfg = cudaipc_config(layerwise_groups=4)
    p = Pair(cfg, slots=32, model=model, registered=host_stand_ins.vram_layout)
    try:
        s, r, src, dst = p.start(7, 6)

        def landed(layer: int, slots: np.ndarray) -> bool:  # K of ``layer`` on decode
            return bool((p.darr[layer][slots] == p.parr[layer][src[: slots.size]]).all())

        s.send(src[:2], layerwise=True)
        time.sleep(0.2)
        assert not any(landed(layer, dst[:2]) for layer in range(8))
        s.layer_ready(3)  # groups 0 and 1
        wait_for(lambda: all(landed(layer, dst[:2]) for layer in range(4)))
        assert not any(landed(layer, dst[:2]) for layer in range(4, 8))
        assert r.poll() == KVPoll.Transferring
        s.layer_ready(None)
        s.send(src[2:], last=True, layerwise=True)
        s.layer_ready(None)
        wait_for(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success)
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        assert s.metrics.chunks == 2 * 4
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
    finally:
        p.close()


@pytest.mark.parametrize("decode_page", [1, 4])
def test_decode_pages_of_another_size_land_in_one_launch(
    pages: host_stand_ins.HostPages, decode_page: int
) -> None:
    """Prefill pages of 2 tokens into decode pages of 1 or 4 (page-size conversion in page
    form: granules), one launch for the chunk, every element in place; decode pages for 6
    tokens, which no prompt of 4 prefill pages of 2 tokens fits (7 or 8 tokens), fail both
    sides at once, nothing written."""
    cfg = cudaipc_config()
    dmodel = MODEL.model_copy(update={"page_size": decode_page})
    p = Pair(cfg, dmodel=dmodel, slots=32, registered=host_stand_ins.vram_layout)
    try:
        src = np.arange(4)  # 8 tokens
        fill_pages(p.play, p.parr, src, 0)
        dst = np.arange(8 // decode_page) + 10
        for room, asked in ((1, dst), (2, dst[: 6 // decode_page])):  # 6 tokens: no prompt of 4
            r = p.decode.receiver(room, p.addr)
            r.init()
            r.send_metadata(asked, aux_index=1, cached_tokens=0)
            s = p.prefill.sender(room)
            wait_for(asked_for(s))
            s.init(src.size, aux_index=2)
            before = pages.launches
            if asked.size == dst.size:
                s.send(src, last=True)
                wait_for(both_are(r, s, KVPoll.Success))
                assert pages.launches - before == 1
                assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
            else:
                with contextlib.suppress(KVWireError):  # refused here or by the worker
                    s.send(src, last=True)
                wait_for(both_are(r, s, KVPoll.Failed))
                with pytest.raises(KVWireError, match="page"):
                    s.failure_exception()
                assert pages.launches == before
            r.clear()
            s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
    finally:
        p.close()
