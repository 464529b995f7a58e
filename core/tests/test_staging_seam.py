"""The staging seam: direct plans come from the mapper; strategy memory goes through
register_fn and becomes reachable by a peer without backend-specific code."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvwire.backend import XferOp, XferState
from kvwire.backends.tcp import TcpBackend
from kvwire.descriptors import make_table
from kvwire.index import EqualTPMapper
from kvwire.layout import MemoryRegion, ModelSpec, RankPosition
from kvwire.staging import ChunkPlan, DirectStaging, PlanRequest, StagingContext, StagingStrategy
from kvwire.testing.kvfill import make_pool

MODEL = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=4, dtype="int32", page_size=2)


def test_direct_plan_is_the_mappers_index_arrays() -> None:
    src, _ = make_pool(MODEL, RankPosition(), 8)
    dst, _ = make_pool(MODEL, RankPosition(), 8)
    mapper = EqualTPMapper(src, dst)
    plan = DirectStaging().plan(PlanRequest(7, 0, mapper, [1, 5], [2, 3]))
    s_idx, d_idx = mapper.map_chunk([1, 5], [2, 3])
    assert plan.table == "kv" and not plan.empty
    assert np.array_equal(plan.src_idx, s_idx) and np.array_equal(plan.dst_idx, d_idx)
    assert DirectStaging().plan(PlanRequest(7, 1, mapper, [], [])).empty


class _RingStrategy(StagingStrategy):
    """A toy staging strategy that owns a buffer and registers it only through register_fn."""

    name = "toy"

    def setup(self, context: StagingContext) -> None:
        super().setup(context)
        self.buffer = np.zeros(4096, dtype=np.uint8)
        self.region = MemoryRegion.from_tensor(self.buffer, item_len=1024)
        context.register_fn([self.region])
        context.publish_fn()

    def plan(self, req: PlanRequest) -> ChunkPlan:
        raise NotImplementedError

    def close(self) -> None:
        assert self.context is not None
        self.context.deregister_fn([self.region])
        super().close()


def test_strategy_memory_registered_through_callbacks_is_reachable() -> None:
    sender, receiver = TcpBackend("sender"), TcpBackend("receiver")
    published: list[bytes] = []
    try:
        src = np.arange(1024, dtype=np.uint8)
        sender.register([MemoryRegion.from_tensor(src, item_len=1024)])
        layout, _ = make_pool(MODEL, RankPosition(), 4)
        strategy = _RingStrategy()
        strategy.setup(
            StagingContext(
                layout=layout,
                register_fn=receiver.register,
                deregister_fn=receiver.deregister,
                publish_fn=lambda: published.append(receiver.local_metadata()),
            )
        )
        assert strategy.region in receiver.registered_regions and len(published) == 1
        peer = sender.add_peer(published[0])
        pair = sender.prepare(
            peer,
            make_table([src.ctypes.data], 1024),
            make_table([strategy.region.addr + 2048], 1024),
        )
        h = sender.submit(XferOp.WRITE, pair, [0], [0], b"staged")
        deadline = time.monotonic() + 10
        while sender.poll(h) is XferState.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sender.poll(h) is XferState.DONE, h.error
        sender.release(h)
        assert np.array_equal(strategy.buffer[2048:3072], src)
        strategy.close()
        assert strategy.region not in receiver.registered_regions
    finally:
        sender.close()
        receiver.close()


CONSENT_PLUGIN = '''
import threading
from typing import Any

from pydantic import BaseModel

from kvwire.plugins import Implementation, hookimpl
from kvwire.staging.base import ChunkPlan, QueuedChunk, StagingStrategy

KVWIRE_PLUGIN_API = "2.0"


class MayI(BaseModel):
    room: int
    chunk_id: int


class Consent(StagingStrategy):
    """Asks the receiver before writing each chunk: a request/grant protocol of its own."""

    name = "consent"

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.lock = threading.Lock()
        self.asked: list[tuple[int, int]] = []
        self.answered: list[tuple[int, int]] = []
        self.granted: set[tuple[int, int]] = set()
        self.refused: list[tuple[int, int]] = []

    def link_tables(self, mapper, remote, *, session="", tables=None):
        if self.context.role != "prefill" or mapper.is_dummy:
            return {}
        return {"consent": mapper.build_tables()}

    def on_queued(self, chunk: QueuedChunk) -> None:
        self.asked.append((chunk.room, chunk.chunk_id))
        body = MayI(room=chunk.room, chunk_id=chunk.chunk_id)
        self.context.post(chunk.endpoint, self.name, "may_i", body)

    def on_message(self, peer_endpoint: str, msg: Any) -> None:
        body = MayI.model_validate(msg.body)
        key = (body.room, body.chunk_id)
        if msg.type == "may_i":
            if self.context.room_pages(body.room) is None:
                self.refused.append(key)
                return
            self.answered.append(key)
            self.context.post(peer_endpoint, self.name, "yes", body)
        elif msg.type == "yes":
            with self.lock:
                self.granted.add(key)

    def plan(self, req):
        with self.lock:
            if (req.room, req.chunk_id) not in self.granted:
                return None
        src, dst = req.mapper.map_chunk(req.src_pages, req.dst_pages)
        return ChunkPlan(table="consent", src_idx=src, dst_idx=dst)


@hookimpl
def kvwire_staging_strategies():
    return [Implementation("consent", "fakeplug_consent:Consent", "asks before each chunk")]
'''


def test_a_third_party_strategy_with_its_own_request_grant_messages(make_dist: Any) -> None:
    """A plugin strategy that asks decode before every chunk works through the seam alone:
    its messages travel in core's staging envelope, decode's copy answers from the room's
    pages, and the data is verified on decode (no edit in ``session/`` needed)."""
    from kvwire.config import KVWireConfig
    from kvwire.testing.pair import config, pair

    make_dist(
        "fakeplug-consent", {"consent": "fakeplug_consent"}, {"fakeplug_consent": CONSENT_PLUGIN}
    )
    cfg = KVWireConfig(**{**config().model_dump(), "staging": "consent"})
    with pair(cfg) as p:
        pre, dec = p.prefill.staging, p.decode.staging
        assert pre.name == dec.name == "consent"
        p.transfer(5, pages=4, chunks=(2, 2))  # every element verified on decode
        assert pre.asked == [(5, 0), (5, 1)]
        assert dec.answered == [(5, 0), (5, 1)] and pre.granted == {(5, 0), (5, 1)}
        # a message from a session that never shook hands never reaches the strategy
        from kvwire.control.wire import StagingMessage

        before = p.decode.dropped.get("staging_unknown_peer", 0)
        p.prefill.channel.tell(
            p.decode.channel.endpoint,
            StagingMessage(session="stranger", strategy="consent", type="may_i", body={}),
        )
        deadline = time.monotonic() + 5
        while p.decode.dropped.get("staging_unknown_peer", 0) == before:
            assert time.monotonic() < deadline, "the stranger's message was not dropped"
            time.sleep(0.01)
        assert dec.refused == []
