"""Chunks that move as several segments, each with its own completion.

- ``split_tables``: pairs whose regions mix memory kinds split into one pair per (source kind,
  destination kind), and a chunk's rows land in the right one (pure table logic: VRAM regions
  here are addresses only, nothing is copied).
- End to end through the real tcp backend: a strategy that moves half of each chunk through the
  engine and copies the other half itself (a :class:`LocalCopy`) -- decode reports Success only
  once both have landed, every element is verified, and a failing copy fails both sides.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvwire.descriptors import ADDR, LEN, make_table
from kvwire.errors import TransferError
from kvwire.index.base import TablePair
from kvwire.layout import MemKind, MemoryRegion
from kvwire.session.poll import KVPoll
from kvwire.session.segments import split_tables
from kvwire.staging.base import ChunkPlan, PlanRequest, Segment, StagingStrategy
from kvwire.testing.kvfill import count_mismatches
from kvwire.testing.pair import config, no_rooms, pair, wait_for


# ------------------------------------------------------------------------------- table split
def _region(addr: int, kind: MemKind, n: int = 8, item: int = 64) -> MemoryRegion:
    return MemoryRegion(addr=addr, length=n * item, item_len=item, kind=kind, device_id=0)


def _rows(regions: list[MemoryRegion]) -> Any:
    addr = np.concatenate([r.addr + np.arange(r.num_items) * r.item_len for r in regions])
    return make_table(addr, regions[0].item_len, 0)


def test_single_kind_pairs_are_not_split() -> None:
    src = [_region(0x10000, MemKind.DRAM), _region(0x20000, MemKind.DRAM)]
    dst = [_region(0x90000, MemKind.DRAM)]
    tables = TablePair(_rows(src), _rows(dst + dst))
    pairs, split = split_tables("kv", tables, src, dst)
    assert split is None and list(pairs) == ["kv"] and pairs["kv"] is tables


def test_mixed_kinds_split_into_homogeneous_pairs_and_rows_keep_their_addresses() -> None:
    src = [_region(0x10000, MemKind.VRAM), _region(0x20000, MemKind.DRAM)]
    dst = [_region(0x90000, MemKind.DRAM), _region(0xA0000, MemKind.VRAM)]
    tables = TablePair(_rows(src), _rows(dst))
    pairs, split = split_tables("host", tables, src, dst)
    assert split is not None
    assert sorted(pairs) == [
        "host@DRAM>DRAM",
        "host@DRAM>VRAM",
        "host@VRAM>DRAM",
        "host@VRAM>VRAM",
    ]
    kind_of = {r.addr: r.kind for r in (*src, *dst)}

    def kinds(table: Any) -> set[MemKind]:
        return {kind_of[int(a) & ~0xFFFF] for a in table[:, ADDR]}

    for name, tp in pairs.items():
        s_kind, d_kind = name.split("@")[1].split(">")
        assert kinds(tp.src) == {MemKind[s_kind]} and kinds(tp.dst) == {MemKind[d_kind]}

    rng = np.random.default_rng(3)
    s_idx = rng.permutation(16)[:11].astype(np.int64)
    d_idx = rng.permutation(16)[:11].astype(np.int64)
    moved = set()
    for seg in split.segments(s_idx, d_idx):
        tp = pairs[seg.table]
        assert seg.label == seg.table.split("@")[1]
        moved |= set(
            zip(tp.src[seg.src_idx, ADDR].tolist(), tp.dst[seg.dst_idx, ADDR].tolist(), strict=True)
        )
    want = set(zip(tables.src[s_idx, ADDR].tolist(), tables.dst[d_idx, ADDR].tolist(), strict=True))
    assert moved == want  # every row exactly once, to the same place


# ------------------------------------------------------------------ segments end to end
class _GatedCopy:
    """A copy the strategy runs itself: it moves its rows when the gate opens."""

    def __init__(self, rows: list[tuple[int, int, int]], gate: threading.Event, fail: bool):
        self.rows, self.gate, self.fail = rows, gate, fail
        self.nbytes = sum(n for _, _, n in rows)
        self.num_rows = len(rows)
        self._done = False

    def done(self) -> bool:
        if not self.gate.is_set():
            return False
        if self.fail:
            raise TransferError("injected copy failure")
        if not self._done:
            for dst, src, n in self.rows:
                ctypes.memmove(dst, src, n)
            self._done = True
        return True


class _HalfCopied(StagingStrategy):
    """Engine segment for the first half of each chunk's rows, a gated copy for the rest."""

    name = "half-copied"

    def __init__(self, gate: threading.Event, fail: bool = False) -> None:
        super().__init__()
        self.gate, self.fail = gate, fail
        self.sent: list[bool] = []
        self._tables: TablePair | None = None

    def plan(self, req: PlanRequest) -> ChunkPlan:
        mapper = req.mapper
        if self._tables is None:
            self._tables = mapper.build_tables()
        t = self._tables
        s, d = mapper.map_chunk(req.src_pages, req.dst_pages)
        h = s.size // 2
        rows = [
            (int(t.dst[j, ADDR]), int(t.src[i, ADDR]), int(t.src[i, LEN]))
            for i, j in zip(s[h:], d[h:], strict=True)
        ]
        return ChunkPlan(
            "kv",
            s,
            d,
            segments=[
                Segment("engine", "kv", s[:h], d[:h]),
                Segment("copy", copy=_GatedCopy(rows, self.gate, self.fail)),
            ],
        )

    def on_sent(self, room: int, plan: ChunkPlan, ok: bool) -> None:
        self.sent.append(ok)


def _start(p: Any, room: int, pages: int) -> tuple[Any, Any, Any]:
    s, r, src, dst = p.start(room, pages)
    s.send(src[:2])
    s.send(src[2:], last=True)
    return r, s, dst


def test_request_completes_only_when_every_segment_has() -> None:
    gate = threading.Event()
    with pair(config()) as p:
        strategy = _HalfCopied(gate)
        p.prefill.ctx.staging = strategy  # before the handshake: links take it from the context
        r, s, dst = _start(p, 5, pages=4)
        # The engine halves land (and the aux row is held back behind the copies).
        wait_for(lambda: p.prefill.room_tables()["writes_inflight"] > 0)
        for _ in range(50):
            assert r.poll() < KVPoll.Success
            time.sleep(0.005)
        assert strategy.sent == []  # on_sent only after every segment of a chunk is terminal
        gate.set()
        wait_for(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success)
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        assert strategy.sent == [True, True]  # once per chunk
        r.clear()
        s.clear()
        assert no_rooms(p.prefill) and no_rooms(p.decode)


def test_a_failing_segment_fails_the_request_on_both_sides() -> None:
    gate = threading.Event()
    with pair(config()) as p:
        strategy = _HalfCopied(gate, fail=True)
        p.prefill.ctx.staging = strategy  # before the handshake: links take it from the context
        r, s, _ = _start(p, 6, pages=4)
        gate.set()
        wait_for(lambda: r.poll() == KVPoll.Failed and s.poll() == KVPoll.Failed)
        with pytest.raises(TransferError, match="injected copy failure"):
            raise s.failure_exception()
        wait_for(lambda: False in strategy.sent)  # after the engine half ended too
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
