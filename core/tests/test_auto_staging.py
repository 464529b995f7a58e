"""``--staging auto`` (the default) for the KV pool: bulk staging where the pool is in GPU
memory, with the GPU sizes unless the operator set them, ``direct`` where bulk cannot set up
(logged, never a failed start) and on host pools. No GPU here: a pool of host memory flagged
VRAM plays the GPU pool (bulk's views of it then fail as they would without torch's CUDA)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError
from kvwire.layout import KVLayout, MemKind, ModelSpec, RankPosition
from kvwire.session.context import kv_staging
from kvwire.staging.base import StagingContext
from kvwire.staging.bulk import GPU_SIZES, BulkOptions, BulkStaging
from kvwire.staging.direct import DirectStaging
from kvwire.testing.kvfill import make_pool

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=2)


def _context(layout: KVLayout, tensors: Any, registered: list[Any]) -> StagingContext:
    return StagingContext(
        layout,
        registered.extend,
        lambda regions: None,
        role="decode",
        num_workers=1,
        kv_tensors=tensors,
        send_fn=lambda ep, msg: True,
        session="d",
        room_pages=lambda room: None,
    )


def _flagged_vram(layout: KVLayout) -> KVLayout:
    bufs = tuple(b.model_copy(update={"kind": MemKind.VRAM}) for b in layout.buffers)
    return layout.model_copy(update={"buffers": bufs})


def test_gpu_sizes_apply_where_the_operator_set_none() -> None:
    host = BulkOptions()
    assert host.for_memory(False) is host
    gpu = host.for_memory(True)
    assert {k: getattr(gpu, k) for k in GPU_SIZES} == GPU_SIZES
    mine = BulkOptions(block_bytes=1 << 20, buffers_per_worker=3).for_memory(True)
    assert mine.block_bytes == 1 << 20 and mine.buffers_per_worker == 3
    assert mine.ring_bytes == GPU_SIZES["ring_bytes"]
    assert mine.buffer_bytes == GPU_SIZES["buffer_bytes"]
    with pytest.raises(ValueError, match="multiple of block_bytes"):  # still validated
        BulkOptions(block_bytes=3 << 20).for_memory(True)


def test_auto_takes_bulk_for_a_gpu_pool_that_it_can_serve(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout, arrays = make_pool(MODEL, RankPosition(), 16)
    registered: list[Any] = []
    with caplog.at_level(logging.INFO, logger="kvwire.session.context"):
        strategy = kv_staging(KVWireConfig(), {MemKind.VRAM},
                              _context(layout, arrays, registered), "d")  # fmt: skip
    try:
        assert isinstance(strategy, BulkStaging) and strategy.ring is not None
        assert registered == [strategy.ring.region]  # its ring went to the backend
        # the engine's arrays live on the host: host sizes
        assert strategy.opts.ring_bytes == BulkOptions().ring_bytes
        # the startup line says what the default took beside the pool
        mib = BulkOptions().ring_bytes >> 20
        (line,) = [r.getMessage() for r in caplog.records if "staging auto ->" in r.getMessage()]
        assert f"decode's staging ring: {mib} MiB in host memory (ring_bytes)" in line, line
    finally:
        strategy.close()


def test_auto_falls_back_to_direct_when_bulk_cannot_set_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A GPU pool whose memory bulk staging cannot view (no CUDA torch here): the rank starts
    with ``direct`` and says why; named ``bulk`` fails the start with the same reason."""
    layout, _ = make_pool(MODEL, RankPosition(), 16)
    vram = _flagged_vram(layout)
    registered: list[Any] = []
    with caplog.at_level(logging.WARNING, logger="kvwire.session.context"):
        strategy = kv_staging(KVWireConfig(), {MemKind.VRAM}, _context(vram, None, registered),
                              "d")  # fmt: skip
    assert isinstance(strategy, DirectStaging) and registered == []
    (record,) = [r for r in caplog.records if "cannot serve the KV pool" in r.getMessage()]
    assert "'bulk'" in record.getMessage() and "trying 'direct'" in record.getMessage()
    with pytest.raises(ConfigError):
        kv_staging(KVWireConfig(staging="bulk"), {MemKind.VRAM}, _context(vram, None, []), "d")


def test_auto_is_direct_on_host_pools() -> None:
    layout, arrays = make_pool(MODEL, RankPosition(), 16)
    strategy = kv_staging(KVWireConfig(), {MemKind.DRAM}, _context(layout, arrays, []), "d")
    assert isinstance(strategy, DirectStaging)
