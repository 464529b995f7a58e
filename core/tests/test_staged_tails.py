"""A staged chunk's partly filled last block goes as a tail row (:mod:`kvwire.staging.spans`),
end to end through two managers over the real ``tcp`` backend: every element lands, and the
bytes a request moved are its blocks' bytes less what the tail row leaves out."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.session import KVPoll
from kvwire.testing.kvfill import count_mismatches, fill_pages
from kvwire.testing.pair import MODEL, Pair, config, no_rooms, wait_for

BLOCK = 8192  # tails of 4 KiB (kvwire.staging.spans.MIN_TAIL_BYTES)
PAGE = MODEL.num_layers * 2 * MODEL.page_size * MODEL.total_kv_heads * MODEL.head_dim * 4


@pytest.mark.parametrize(
    ("pages", "moved"),
    [
        (4, 4096),  # 2 KiB: one tail row of 4 KiB, not a block of 8
        (16, BLOCK),  # 8 KiB: one full block
        (20, BLOCK + 4096),  # a block and 2 KiB: the block, then a tail of 4 KiB
        (28, 2 * BLOCK),  # a block and 6 KiB: more than half of the second, so all of it
    ],
)
def test_a_staged_request_moves_its_last_block_as_a_tail(pages: int, moved: int) -> None:
    cfg = config(secret="tails", staging="bulk", num_workers=1)
    opts = {"equal_tp": "always", "block_bytes": BLOCK, "buffer_bytes": 8 * BLOCK,
            "ring_bytes": 64 * BLOCK, "buffers_per_worker": 2}  # fmt: skip
    cfg = cfg.model_copy(update={"staging_options": opts})
    p = Pair(cfg, slots=64)
    try:
        assert pages * PAGE == {4: 2048, 16: 8192, 20: 10240, 28: 14336}[pages]
        r = p.decode.receiver(1, p.addr)
        r.init()
        dst = np.arange(pages) + 30
        r.send_metadata(dst, aux_index=1)
        s = p.prefill.sender(1)
        src = np.arange(pages)
        fill_pages(p.play, p.parr, src, 0)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(pages, aux_index=2)
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success)
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        assert s.metrics.bytes == moved
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
    finally:
        p.close()
