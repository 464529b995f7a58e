"""In-process test pairs: one prefill and one decode :class:`~kvwire.KVManager` (TP 1 each) on
threads of this process, over the real tcp backend, bootstrap service and ZeroMQ channels, with
verification pools. Used by core's session tests and by strategy tests that swap a manager's
staging strategy in place."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from pydantic import SecretStr

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import KVLayout, ModelSpec, RankPosition
from kvwire.session import KVManager, KVPoll, Role
from kvwire.testing.kvfill import count_mismatches, fill_pages, make_pool

MODEL = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype="int32", page_size=2)


def config(
    secret: str | None = None, *, backend: str = "tcp", staging: str = "auto", **control: Any
) -> KVWireConfig:
    """A test pair's configuration: ``backend`` and ``staging`` (kvwire's names), the
    control options ``control`` over the pair's defaults."""
    # 0.5 s beats (eviction after 1.5 s of silence): 0.1 s evicted live managers whose
    # threads were starved for 0.3 s on a loaded 2-core host. Tests of liveness set their own.
    opts = {"heartbeat_interval_s": 0.5, "handshake_timeout_s": 3.0, **control}
    return KVWireConfig(
        transfer_backend=backend,
        staging=staging,
        control=ControlOptions(**opts),
        secret=SecretStr(secret) if secret is not None else None,
    )


def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


class Pair:
    """One prefill and one decode manager (TP 1 each) with verification pools."""

    def __init__(
        self,
        pcfg: KVWireConfig,
        dcfg: KVWireConfig | None = None,
        dmodel: ModelSpec | None = None,
        slots: int = 32,
        model: ModelSpec = MODEL,
        registered: Callable[[KVLayout, list[Any]], KVLayout] | None = None,
    ) -> None:
        """``registered`` (optional): the layout each manager registers, given its pool's
        layout and arrays (a backend's host stand-ins register host pools as GPU memory);
        :attr:`play` and :attr:`dlay` stay the pools' own layouts, for filling and checks."""
        self.play, self.parr = make_pool(model, RankPosition(), slots)
        self.dlay, self.darr = make_pool(dmodel or model, RankPosition(), slots)
        as_registered = registered or (lambda layout, arrays: layout)
        self.prefill = KVManager(pcfg, Role.PREFILL, as_registered(self.play, self.parr))
        try:
            self.decode = KVManager(dcfg or pcfg, Role.DECODE, as_registered(self.dlay, self.darr))
        except BaseException:
            self.prefill.close()
            raise
        assert self.prefill.bootstrap_addr
        self.addr: str = self.prefill.bootstrap_addr

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()

    def start(self, room: int, pages: int, dst: Any = None) -> tuple[Any, Any, Any, Any]:
        """A request up to ``init()`` on both sides: decode asked for ``dst`` (default: slots
        10...), prefill filled slots 0... and was asked. Returns (sender, receiver, src, dst)."""
        r = self.decode.receiver(room, self.addr)
        r.init()
        dst = np.arange(pages) + 10 if dst is None else dst
        r.send_metadata(dst, aux_index=1)
        s = self.prefill.sender(room)
        src = np.arange(pages)
        fill_pages(self.play, self.parr, src, 0)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(pages, aux_index=2)
        return s, r, src, dst

    def transfer(self, room: int, pages: int = 4, chunks: tuple[int, ...] = (2, 2)) -> None:
        """A whole verified request."""
        s, r, src, dst = self.start(room, pages)
        off = 0
        for i, n in enumerate(chunks):
            s.send(src[off : off + n], last=i == len(chunks) - 1)
            off += n
        wait_for(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success)
        assert count_mismatches(self.dlay, self.darr, dst, 0) == 0
        r.clear()
        s.clear()


@contextlib.contextmanager
def pair(*args: Any, **kw: Any) -> Iterator[Pair]:
    p = Pair(*args, **kw)
    try:
        yield p
    finally:
        p.close()


def no_rooms(mgr: KVManager) -> bool:
    return not any(mgr.room_tables().values())
