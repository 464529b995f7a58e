"""An eviction is known to both sides at once (issue 26, found by the soak's freeze fault).

A prefill rank evicts a decode rank that was silent past the liveness bound; the decode rank,
back, still counts the prefill rank as a peer. These tests evict it on the prefill side by
hand (``RankContext.evict``, as the liveness thread does for silence: the test hook, so no
timing luck is needed) with a liveness bound of 100 s on both sides, so that nothing the tests
see can come from the decode rank's own liveness bound:

* the decode rank is told (protocol 1.9 ``evicted``) on its next heartbeat and drops its link;
* a request it asks for through the old link is answered ``unheard``: it handshakes again and
  repeats it, and the request succeeds, every element verified;
* a request it asked for before prefill created its sender (an early request, dropped by the
  eviction) is repeated the same way;
* a request the eviction failed on prefill fails on decode too, naming the eviction;
* a heartbeat (or request) from a session never handshaken, or from one evicted because its
  process is gone, is still dropped, and does not make prefill open a socket anywhere.
"""

from __future__ import annotations

import numpy as np

from kvwire.session import KVPoll
from kvwire.testing.kvfill import count_mismatches, fill_pages
from kvwire.testing.pair import Pair, config, no_rooms, pair, wait_for

#: 0.5 s beats, 200 misses: a 100 s liveness bound, far beyond every wait here (20 s).
BOUND = {"heartbeat_interval_s": 0.5, "heartbeat_misses": 200}
WAIT_S = 20.0


def _evict_decode(p: Pair) -> None:
    """The hook: prefill evicts the decode rank as its liveness thread does for silence."""
    assert p.decode.session in p.prefill.peers
    p.prefill.ctx.evict(p.decode.session, "no heartbeat for 3.0s (test)", silent=True)
    assert p.decode.session not in p.prefill.peers


def _serve(p: Pair, room: int, r: object, dst: np.ndarray, pages: int = 4) -> None:
    """Prefill's side of a request decode already asked for; checks it succeeds."""
    s = p.prefill.sender(room)
    src = np.arange(pages)
    fill_pages(p.play, p.parr, src, 0)
    wait_for(lambda: s.poll() >= KVPoll.WaitingForInput, WAIT_S)
    s.init(pages, aux_index=2)
    s.send(src, last=True)
    wait_for(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, WAIT_S)  # type: ignore[attr-defined]
    assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
    r.clear()  # type: ignore[attr-defined]
    s.clear()


def test_decode_is_told_on_its_next_heartbeat_and_handshakes_again() -> None:
    with pair(config(**BOUND)) as p:
        p.transfer(1)
        _evict_decode(p)
        # told by prefill's answer to its next heartbeat (0.5 s), not by its own bound (100 s)
        wait_for(lambda: p.prefill.session not in p.decode.peers, WAIT_S)
        p.transfer(2)  # looked up from cache, handshaken again, served
        assert p.decode.session in p.prefill.peers and p.prefill.session in p.decode.peers
        p.transfer(3)
        assert p.decode.room_tables()["handshakes_pending"] == 0
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_a_request_asked_through_the_old_link_is_repeated_and_served() -> None:
    with pair(config(**BOUND)) as p:
        p.transfer(1)
        r = p.decode.receiver(2, p.addr)
        r.init()
        wait_for(lambda: r.poll() == KVPoll.WaitingForInput, WAIT_S)  # sources: the old link
        _evict_decode(p)
        dst = np.arange(4) + 10
        r.send_metadata(dst, aux_index=1)  # goes to a prefill rank that evicted us
        _serve(p, 2, r, dst)
        p.transfer(3)
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_an_early_request_dropped_by_the_eviction_is_repeated() -> None:
    with pair(config(**BOUND)) as p:
        p.transfer(1)
        r = p.decode.receiver(2, p.addr)
        r.init()
        dst = np.arange(4) + 10
        r.send_metadata(dst, aux_index=1)
        wait_for(lambda: p.prefill.room_tables()["early_requests"] == 1, WAIT_S)
        _evict_decode(p)  # drops the early request
        assert p.prefill.room_tables()["early_requests"] == 0
        # decode hears of it on its next heartbeat, handshakes again and asks again
        wait_for(lambda: p.prefill.room_tables()["early_requests"] == 1, WAIT_S)
        _serve(p, 2, r, dst)
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_a_request_the_eviction_failed_fails_on_decode_naming_it() -> None:
    with pair(config(**BOUND)) as p:
        p.transfer(1)
        s, r, _src, _dst = p.start(2, 4)
        _evict_decode(p)
        assert s.poll() == KVPoll.Failed
        wait_for(lambda: r.poll() == KVPoll.Failed, WAIT_S)
        try:
            r.failure_exception()
        except Exception as exc:
            assert "no heartbeat for 3.0s (test)" in str(exc), exc
        else:
            raise AssertionError("a failed receiver raised nothing")
        r.clear()
        s.clear()
        p.transfer(3)  # the pair serves again
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_a_stranger_or_a_dead_session_is_not_answered() -> None:
    """A transfer request and a heartbeat from a session prefill never handshook with (no
    endpoint to answer), or from one it evicted because its process is gone (its last frames
    may be read after the eviction), are dropped: prefill opens no socket for them (one to a
    dead endpoint would never close)."""
    from kvwire.control.wire import Heartbeat, TransferRequest, pages_to_bytes

    with pair(config(**BOUND)) as p:
        p.transfer(1)
        prefill, gone = p.prefill, p.decode.session
        prefill.evict(gone, "its control connection closed (test)")  # not for silence
        before = len(prefill.channel._push)
        for session in ("never-seen", gone):
            prefill._dispatch(Heartbeat(session=session))
            prefill._dispatch(
                TransferRequest(room=9, session=session, dst_pages=pages_to_bytes(np.arange(2)))
            )
        assert len(prefill.channel._push) == before
        assert prefill.room_tables()["early_requests"] == 0
        assert p.prefill.session in p.decode.peers  # decode was told nothing
