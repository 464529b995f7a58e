"""KV checksums' kernels compiled at the handshake: each side of a checksummed link hands a
warm-up of its sums (``SentSums.warm_up``, ``LandedSums.warm_up``) to its handshake owner's
warm-up thread, which runs it once and logs it; host sums have nothing to compile and hand
none over. No GPU here: the device hasher's warm-ups (a real launch on the link's first page)
are checked on two GPUs (docs/benchmarks.md, session 39)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvwire.session.checksums import LandedSums, SentSums
from kvwire.testing.pair import config, pair, wait_for


def test_each_side_of_a_checked_link_warms_its_sums_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[str] = []

    def warm_up(side: str) -> Any:
        def make(self: Any) -> Any:
            assert isinstance(self, SentSums if side == "prefill" else LandedSums)
            return lambda: ran.append(side)

        return make

    monkeypatch.setattr(SentSums, "warm_up", warm_up("prefill"))
    monkeypatch.setattr(LandedSums, "warm_up", warm_up("decode"))
    caplog.set_level(logging.INFO, logger="kvwire.movers.warmup")
    with pair(config(secret="sums-warm", kv_checksum=True)) as p:
        p.transfer(1, pages=4, chunks=(2, 2))  # verified, every chunk's sums checked
        wait_for(lambda: sorted(ran) == ["decode", "prefill"])
        p.transfer(2, pages=2, chunks=(2,))
        assert sorted(ran) == ["decode", "prefill"]  # per link, not per request
        msgs = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("KV checksums for ") and " ready in " in m for m in msgs)
        assert any(m.startswith("KV checks of ") and " ready in " in m for m in msgs)


def test_host_sums_have_no_warm_up() -> None:
    """On host memory the sums are NumPy's: nothing to compile, no warm-up handed over."""
    with pair(config(secret="sums-host", kv_checksum=True)) as p:
        p.transfer(1, pages=2, chunks=(2,))
        link = p.prefill.ctx.peers.get(p.decode.ctx.session).link  # type: ignore[union-attr]
        assert link.checksums is not None and link.checksums.warm_up() is None
        landed = next(iter(p.decode.side.sources.links.values())).checksums  # type: ignore[union-attr]
        assert landed is not None and landed.warm_up() is None
