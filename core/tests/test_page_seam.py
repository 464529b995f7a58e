"""The page-form seam between the prefill worker and a backend (issue 27): a direct plan of a
regular link carries its chunk in page form; a backend that declares ``page_writes`` gets it
as pages (rows never expanded), one that does not gets the same rows; bad page indices are
refused on both paths. Real ``tcp`` backends over loopback; the page-writing one is a test
subclass whose ``_submit_pages`` records the chunk and moves its rows (``cudaipc``, the real
page writer, needs two GPUs: scripts/gpu_cudaipc_bench.py). About a second."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvwire.backend import BackendCapabilities, PreparedPair, TransferHandle, XferOp, XferState
from kvwire.backends.tcp import TcpBackend
from kvwire.errors import CapabilityError, DescriptorError
from kvwire.index import HeadSliceMapper
from kvwire.layout import MemoryRegion, ModelSpec, RankPosition
from kvwire.page_form import PageChunk
from kvwire.session.prefill.posting import submit_rows
from kvwire.staging import ChunkPlan
from kvwire.testing.kvfill import make_pool

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=4, dtype="int32", page_size=4)


class _PagedTcp(TcpBackend):
    """``tcp`` declaring page writes: records each chunk, then moves its rows."""

    name = "tcp"
    capabilities = TcpBackend.capabilities.model_copy(update={"page_writes": True})

    def __init__(self, agent_name: str) -> None:
        super().__init__(agent_name)
        self.chunks: list[PageChunk] = []

    def _submit_pages(
        self,
        op: XferOp,
        pair: PreparedPair,
        chunk: PageChunk,
        notification: bytes | None,
        handle: TransferHandle,
    ) -> Any:
        self.chunks.append(chunk)
        return self._submit(op, pair, *chunk.rows(), notification, handle)


def _move(sender: TcpBackend) -> tuple[np.ndarray, HeadSliceMapper, ChunkPlan, Any]:
    """A TP 2 -> 1 head-slice link from rank 1's pool into a fresh decode pool, through
    ``sender``; returns the decode pool's bytes after the chunk, the mapper, the plan and
    what the seam submitted."""
    receiver = TcpBackend("decode")
    try:
        src, s_arrays = make_pool(MODEL, RankPosition(tp_size=2, tp_rank=1), 6)
        dst, d_arrays = make_pool(MODEL, RankPosition(), 6)
        for i, a in enumerate(s_arrays):
            a[...] = np.arange(a.size, dtype=np.int32).reshape(a.shape) * 7 + i
        sender.register([MemoryRegion.from_tensor(a, item_len=a[0].nbytes) for a in s_arrays])
        receiver.register([MemoryRegion.from_tensor(a, item_len=a[0].nbytes) for a in d_arrays])
        mapper = HeadSliceMapper(src, dst)
        tables = mapper.build_tables()
        pair = sender.prepare(sender.add_peer(receiver.local_metadata()), tables.src, tables.dst)
        plan = ChunkPlan.direct(mapper, [3, 0, 5], [1, 4, 2])
        h = submit_rows(sender, pair, plan.segment("kv"), b"note", lambda: None)
        deadline = time.monotonic() + 30
        while sender.poll(h) is XferState.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sender.poll(h) is XferState.DONE, h.error
        assert h.num_descs == mapper.map_chunk([3, 0, 5], [1, 4, 2])[0].size
        sender.release(h)
        # the out-of-range pages a page-form submit of this pair refuses, on both sides
        for sp, dp, what in (([0, 6], [1, 2], "source"), ([0, 1], [1, 6], "destination")):
            assert plan.pages is not None
            bad = PageChunk(plan.pages.geometry, np.array(sp), np.array(dp))
            err = CapabilityError if not sender.capabilities.page_writes else DescriptorError
            with pytest.raises(err, match="takes rows" if err is CapabilityError else what):
                sender.submit_pages(XferOp.WRITE, pair, bad, b"x")
        return np.concatenate([a.ravel() for a in d_arrays]), mapper, plan, h
    finally:
        sender.close()
        receiver.close()


def test_page_writer_gets_pages_and_others_get_the_same_rows() -> None:
    paged = _PagedTcp("prefill")
    got_pages, mapper, plan, _ = _move(paged)
    assert len(paged.chunks) == 1 and paged.chunks[0] is plan.pages  # the plan's own form
    got_rows, _, plan_rows, _ = _move(TcpBackend("prefill"))
    assert np.array_equal(got_pages, got_rows) and got_rows.any()
    # the rows the plan stands for are map_chunk's, and a plan read as rows expands them
    s, d = mapper.map_chunk([3, 0, 5], [1, 4, 2])
    assert np.array_equal(plan_rows.src_idx, s) and np.array_equal(plan_rows.dst_idx, d)


def test_bad_pages_are_refused_before_any_submit() -> None:
    src, _ = make_pool(MODEL, RankPosition(tp_size=2, tp_rank=0), 6)
    dst, _ = make_pool(MODEL, RankPosition(), 6)
    mapper = HeadSliceMapper(src, dst)
    with pytest.raises(DescriptorError, match="destination page indices out of range"):
        ChunkPlan.direct(mapper, [0, 1], [2, 9])  # the page path (a regular link)
    with pytest.raises(DescriptorError, match="destination page indices out of range"):
        mapper.map_chunk([0, 1], [2, 9])  # the rows path
    assert not BackendCapabilities().page_writes  # every backend keeps rows unless it says
