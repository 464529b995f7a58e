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
from kvwire.index.base import IndexMapper
from kvwire.layout import MemoryRegion, ModelSpec, RankPosition
from kvwire.staging import ChunkPlan, DirectStaging, StagingContext, StagingStrategy
from kvwire.testing.kvfill import make_pool

MODEL = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=4, dtype="int32", page_size=2)


def test_direct_plan_is_the_mappers_index_arrays() -> None:
    src, _ = make_pool(MODEL, RankPosition(), 8)
    dst, _ = make_pool(MODEL, RankPosition(), 8)
    mapper = EqualTPMapper(src, dst)
    plan = DirectStaging().plan(7, 0, mapper, [1, 5], [2, 3])
    s_idx, d_idx = mapper.map_chunk([1, 5], [2, 3])
    assert plan.table == "kv" and not plan.empty
    assert np.array_equal(plan.src_idx, s_idx) and np.array_equal(plan.dst_idx, d_idx)
    assert DirectStaging().plan(7, 1, mapper, [], []).empty


class _RingStrategy(StagingStrategy):
    """A toy staging strategy that owns a buffer and registers it only through register_fn."""

    name = "toy"

    def setup(self, context: StagingContext) -> None:
        super().setup(context)
        self.buffer = np.zeros(4096, dtype=np.uint8)
        self.region = MemoryRegion.from_tensor(self.buffer, item_len=1024)
        context.register_fn([self.region])
        context.publish_fn()

    def plan(
        self, room: int, chunk_id: int, mapper: IndexMapper, src_pages: Any, dst_pages: Any
    ) -> ChunkPlan:
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
