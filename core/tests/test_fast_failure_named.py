"""Fast, named failures that used to wait for a timeout (issue 24, item 4).

* A decode request given a bootstrap address where nothing serves (connection refused, a
  name that does not resolve) fails within a couple of seconds naming the address, not
  after ``bootstrap_timeout_s`` (60 s here).
* A decode request for a room the prefill rank will never hold, when the engine told the
  prefill manager which rooms it issues (``room_issuer``), is answered at once: it fails
  within 1 s naming the room, not after decode's ``waiting_timeout_s`` (60 s here). The
  legitimate race — decode's request arriving before prefill's engine created the sender —
  still works, with an issuer and without one (SGLang's flow).

In-process managers over the real tcp backend, bootstrap service and ZeroMQ channels (as in
``test_fast_failure.py``); every deadline long, so only the new answers can make these fast.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvwire.errors import KVWireError
from kvwire.layout import RankPosition
from kvwire.session import KVManager, KVPoll, Role
from kvwire.testing.kvfill import count_mismatches, fill_pages, make_pool
from kvwire.testing.pair import MODEL, config, no_rooms, pair, wait_for

SLOW = {"bootstrap_timeout_s": 60.0, "waiting_timeout_s": 60.0, "handshake_timeout_s": 30.0}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _failure(handle: object, limit_s: float) -> tuple[float, str]:
    t0 = time.monotonic()
    wait_for(lambda: handle.poll() is KVPoll.Failed, timeout=limit_s)  # type: ignore[attr-defined]
    took = time.monotonic() - t0
    with pytest.raises(KVWireError) as ei:
        handle.failure_exception()  # type: ignore[attr-defined]
    return took, str(ei.value)


# ------------------------------------------------------------------ bootstrap address
@pytest.mark.parametrize("kind", ["refused", "unresolvable"])
def test_bootstrap_address_where_nothing_serves_fails_fast_naming_it(kind: str) -> None:
    addr = f"127.0.0.1:{_closed_port()}" if kind == "refused" else "no-such-prefill.invalid:8998"
    with pair(config(**SLOW)) as p:
        r = p.decode.receiver(11, addr)
        r.init()
        r.send_metadata([3, 4], aux_index=0)
        took, err = _failure(r, 10.0)
        assert took < 5.0  # the old path waited bootstrap_timeout_s (60 s)
        assert addr in err, err
        r.clear()
        p.transfer(12)  # the decode manager still works
        wait_for(lambda: no_rooms(p.decode))


# --------------------------------------------------------------------- unknown rooms
class Watermark:
    """A room issuer like an engine that picks rooms in order (vLLM's push flow): rooms up
    to the latest created are gone once cleared; rooms past it may still come."""

    def __init__(self) -> None:
        self.latest = -1
        self.asked: list[int] = []

    def created(self, room: int) -> None:
        self.latest = max(self.latest, room)

    def never(self, room: int) -> str | None:
        self.asked.append(room)
        return "issued and gone already" if room <= self.latest else None


@pytest.fixture
def issued() -> Iterator[tuple[KVManager, KVManager, Watermark, str]]:
    cfg = config(**SLOW)
    play, parr = make_pool(MODEL, RankPosition(), 32)
    dlay, darr = make_pool(MODEL, RankPosition(), 32)
    mark = Watermark()
    pre = KVManager(cfg, Role.PREFILL, play, room_issuer=mark)
    try:
        dec = KVManager(cfg, Role.DECODE, dlay)
    except BaseException:
        pre.close()
        raise
    pre.test_pool = (play, parr)  # type: ignore[attr-defined]
    dec.test_pool = (dlay, darr)  # type: ignore[attr-defined]
    try:
        assert pre.bootstrap_addr
        yield pre, dec, mark, pre.bootstrap_addr
    finally:
        dec.close()
        pre.close()


def _serve(pre: KVManager, room: int, pages: int = 2) -> object:
    """Prefill's engine creates the room's sender and pushes ``pages`` pages."""
    s = pre.sender(room)
    play, parr = pre.test_pool  # type: ignore[attr-defined]
    src = np.arange(pages)
    fill_pages(play, parr, src, 0)
    wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
    s.init(pages, aux_index=2)
    s.send(src, last=True)
    return s


def test_room_the_prefill_will_never_hold_fails_within_a_second(
    issued: tuple[KVManager, KVManager, Watermark, str],
) -> None:
    pre, dec, mark, addr = issued
    ok = dec.receiver(40, addr)  # warm the handshake, and make room 40 issued and served
    ok.init()
    ok.send_metadata(np.array([10, 11]), aux_index=1)
    s = _serve(pre, 40)
    wait_for(lambda: ok.poll() is KVPoll.Success)
    ok.clear()
    s.clear()  # type: ignore[attr-defined]
    for room in (7, 40):  # never created / created, served and cleared
        r = dec.receiver(room, addr)
        r.init()
        r.send_metadata(np.array([12, 13]), aux_index=1)
        took, err = _failure(r, 5.0)
        # the old path waited waiting_timeout_s (60 s); well under 1 s on an idle machine,
        # bounded loosely so a loaded 2-core host cannot fail it
        assert took < 5.0, took
        assert f"does not hold room {room}" in err and "issued and gone" in err, err
        r.clear()
    assert room in mark.asked
    wait_for(lambda: no_rooms(pre) and no_rooms(dec))


def test_decode_ahead_of_prefill_still_works_with_an_issuer(
    issued: tuple[KVManager, KVManager, Watermark, str],
) -> None:
    """The legitimate race: decode asks for a room the engine has not created yet (but
    will): kept as an early request, served when the sender comes."""
    pre, dec, mark, addr = issued
    r = dec.receiver(50, addr)
    r.init()
    dst = np.array([20, 21, 22])
    r.send_metadata(dst, aux_index=1)
    wait_for(lambda: 50 in mark.asked)
    # decode marks the room Transferring once its request left (prefill may see it first)
    wait_for(lambda: r.poll() is KVPoll.Transferring)
    time.sleep(0.3)
    assert r.poll() is KVPoll.Transferring  # waiting, not refused
    s = _serve(pre, 50, 3)
    wait_for(lambda: r.poll() is KVPoll.Success)
    dlay, darr = dec.test_pool  # type: ignore[attr-defined]
    assert count_mismatches(dlay, darr, dst, 0) == 0
    r.clear()
    s.clear()  # type: ignore[attr-defined]


def test_early_request_refused_once_the_engine_moves_past_its_room(
    issued: tuple[KVManager, KVManager, Watermark, str],
) -> None:
    """An early request the issuer first allowed is answered as soon as the engine creates
    a later room without creating this one (e.g. it gave up on the request)."""
    pre, dec, mark, addr = issued
    r = dec.receiver(60, addr)
    r.init()
    r.send_metadata(np.array([14, 15]), aux_index=1)
    wait_for(lambda: 60 in mark.asked)
    wait_for(lambda: r.poll() is KVPoll.Transferring)  # set once the request left decode
    t0 = time.monotonic()
    later = pre.sender(61)
    took, err = _failure(r, 5.0)
    assert time.monotonic() - t0 < 5.0, took  # < 1 s idle; 60 s before the issuer
    assert "does not hold room 60" in err, err
    r.clear()
    later.abort()
    later.clear()


def test_without_an_issuer_decode_may_come_first() -> None:
    """SGLang's flow (no issuer): a request for a room with no sender yet waits, and is
    served when the engine creates it a while later."""
    with pair(config(**SLOW)) as p:
        r = p.decode.receiver(70, p.addr)
        r.init()
        dst = np.array([5, 6])
        r.send_metadata(dst, aux_index=1)
        wait_for(lambda: r.poll() is KVPoll.Transferring)  # the request left decode
        time.sleep(1.0)
        assert r.poll() is KVPoll.Transferring  # and waits: not refused
        s = p.prefill.sender(70)
        src = np.arange(2)
        fill_pages(p.play, p.parr, src, 0)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(2, aux_index=2)
        s.send(src, last=True)
        wait_for(lambda: r.poll() is KVPoll.Success)
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        r.clear()
        s.clear()
