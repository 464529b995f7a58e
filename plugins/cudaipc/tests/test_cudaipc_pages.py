"""cudaipc's page writes without a GPU: the backend's own VRAM path with its CUDA calls
(export, UUIDs, events, the kernel) replaced by host stand-ins, regions flagged VRAM over
host memory, two agents in one process (as test_cudaipc_backend.py does). A TP 2 -> 1
head-slice chunk planned by the real mapper goes through the prefill worker's seam as
pages: one page-mover call whose per-pair addresses are the geometry's rows, the bytes
those of the chunk's rows, the notification after them; a geometry that is not the pair's
tables is refused. The kernel itself is checked in core/tests/test_pool_page_mover.py and
on two GPUs by scripts/gpu_pool_page_check.py. A few seconds (importing torch)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvwire.backend import XferOp, XferState
from kvwire.config import KVWireConfig
from kvwire.descriptors import ADDR
from kvwire.errors import DescriptorError
from kvwire.index import HeadSliceMapper
from kvwire.layout import ModelSpec, RankPosition
from kvwire.movers.pool_pages import pool_page_runs
from kvwire.page_form import PageChunk
from kvwire.selection import create_backend
from kvwire.session.prefill.posting import submit_rows
from kvwire.staging import ChunkPlan
from kvwire.testing.kvfill import make_pool
from kvwire_cudaipc import host_stand_ins

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=4)


class _Pages:
    """Stands in for the pool page mover: the NumPy reference's runs, copied with memmove."""

    device = "stand-in"

    def __init__(self) -> None:
        self.calls: list[tuple[PageChunk, np.ndarray, np.ndarray]] = []
        #: Chunks per copy_batch call (the held writes of one turn).
        self.batches: list[int] = []
        #: The sums each copy_pages call was given (None: none).
        self.sums: list[Any] = []

    @staticmethod
    def sums_fit(chunk: PageChunk, sums: Any) -> bool:
        return bool(sums.pages == chunk.src_pages.size)

    def copy_pages(
        self, chunk: PageChunk, src: Any, dst: Any, *, stream: object = None, sums: Any = None
    ) -> None:
        self.sums.append(sums)
        self.calls.append((chunk, src.copy(), dst.copy()))
        for s, d, n in zip(*(x.tolist() for x in pool_page_runs(chunk, src, dst)), strict=True):
            ctypes.memmove(d, s, n)

    def copy_batch(self, items: Any, *, stream: object = None) -> int:
        self.batches.append(len(items))
        for chunk, src, dst in items:
            self.copy_pages(chunk, src, dst, stream=stream)
        return 1


def _wait(pred: Any) -> bool:
    for _ in range(3000):
        if pred():
            return True
        time.sleep(0.005)
    return False


def _stand_ins(monkeypatch: pytest.MonkeyPatch) -> _Pages:
    """cudaipc's CUDA calls replaced by host stand-ins; the page mover's stand-in returned."""
    pytest.importorskip("torch")
    pages = _Pages()
    host_stand_ins.install(monkeypatch.setattr, pages)
    return pages


_vram = host_stand_ins.vram_regions


def test_page_write_is_one_page_mover_call(monkeypatch: pytest.MonkeyPatch) -> None:
    pages = _stand_ins(monkeypatch)
    src, s_arrays = make_pool(MODEL, RankPosition(tp_size=2, tp_rank=1), 6)
    dst, d_arrays = make_pool(MODEL, RankPosition(), 6)
    rng = np.random.default_rng(4)
    for a in s_arrays:
        a[...] = rng.integers(0, 1 << 30, a.shape, dtype=np.int32)
    vram = _vram

    cfg = KVWireConfig(transfer_backend="cudaipc")
    a = create_backend(cfg, "prefill", need=())
    b = create_backend(cfg, "decode", need=())
    try:
        a.register(vram(s_arrays))
        b.register(vram(d_arrays))
        mapper = HeadSliceMapper(src, dst)
        tables = mapper.build_tables()
        pair = a.prepare(a.add_peer(b.local_metadata()), tables.src, tables.dst)
        assert pair.state.all_vram
        plan = ChunkPlan.direct(mapper, [5, 1, 3], [0, 4, 2])
        assert plan.pages is not None
        # what the chunk's rows write, into decode's pool; kept, and the pool cleared again
        si, di = mapper.map_chunk([5, 1, 3], [0, 4, 2])
        for s_addr, d_addr in zip(tables.src[si, ADDR].tolist(), tables.dst[di, ADDR].tolist(),
                                  strict=True):  # fmt: skip
            ctypes.memmove(int(d_addr), int(s_addr), mapper.slice_bytes)
        want = [d.copy() for d in d_arrays]
        for d in d_arrays:
            d[...] = 0
        assert any(w.any() for w in want)
        h = submit_rows(a, pair, plan.segment("kv"), b"paged", lambda: None)
        assert _wait(lambda: a.poll(h) is not XferState.PENDING)
        assert a.poll(h) is XferState.DONE, h.error
        a.release(h)
        assert len(pages.calls) == 1  # one launch for the chunk, no rows
        chunk, s_addrs, d_addrs = pages.calls[0]
        g = chunk.geometry
        assert np.array_equal(s_addrs, tables.src[g.src_rows, ADDR].astype(np.int64))
        assert np.array_equal(d_addrs, tables.dst[g.dst_rows, ADDR].astype(np.int64))
        for d, w in zip(d_arrays, want, strict=True):
            assert np.array_equal(d, w)
        notes: list = []
        assert _wait(lambda: bool(notes.extend(b.get_notifications()) or notes))
        assert [n.payload for n in notes] == [b"paged"]
        # a geometry whose strides are not this pair's tables never reaches the mover
        wrong = dataclasses.replace(g, dst_row=g.dst_row + 4)
        with pytest.raises(DescriptorError, match="not this pair's tables"):
            a.submit_pages(XferOp.WRITE, pair, PageChunk(wrong, chunk.src_pages, chunk.dst_pages))
        assert len(pages.calls) == 1
        assert a.live_handles == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "per-chunk"])
def test_a_turns_page_writes_go_out_together(monkeypatch: pytest.MonkeyPatch, batch: bool) -> None:
    """TP 1 -> 2: one prefill rank writes a chunk to each of two decode ranks inside one
    worker turn (``post_batch``). Held, both poll PENDING and nothing is launched until the
    turn ends, then one batched mover call carries both and each lands whole with its note;
    a write to a peer removed before the turn ended fails, naming why, and never reaches the
    mover. With ``batch_max_bytes`` 0 each chunk launches at its submit; a batch that reaches
    it goes out at once (:func:`test_a_full_batch_goes_out_at_once`)."""
    with _tp12(monkeypatch, (32 << 20) if batch else 0) as (pages, a, links):
        _want_pools(links)
        handles = []
        with a.post_batch():
            for i, (_b, pair, plan, *_rest) in enumerate(links):
                handles.append(submit_rows(a, pair, plan.segment("kv"), f"n{i}".encode(), _noop))
            if batch:
                assert pages.calls == []  # held: nothing launched yet
                assert all(a.poll(h) is XferState.PENDING for h in handles)
                a.remove_peer(handles[2].peer)  # the third peer goes before the turn ends
            else:
                assert len(pages.calls) == 3  # launched at each submit
        for h in handles[:2]:
            assert _wait(lambda h=h: a.poll(h) is not XferState.PENDING)
            assert a.poll(h) is XferState.DONE, h.error
        assert pages.batches == ([2] if batch else [])
        for i, (b, _pair, _plan, d_arrays, _t, _si, _di, want, _s) in enumerate(links[:2]):
            for d, w in zip(d_arrays, want, strict=True):
                assert np.array_equal(d, w)
            notes: list = []
            assert _wait(
                lambda b=b, notes=notes: bool(notes.extend(b.get_notifications()) or notes)
            )
            assert [n.payload for n in notes] == [f"n{i}".encode()]
        if batch:
            assert a.poll(handles[2]) is XferState.FAILED
            assert "removed" in (handles[2].error or "")
            assert not any(links[2][3][k].any() for k in range(len(links[2][3])))
        for h in handles:
            a.release(h)
        assert a.live_handles == 0


@contextlib.contextmanager
def _tp12(monkeypatch: pytest.MonkeyPatch, limit: int) -> Iterator[tuple[_Pages, Any, list[Any]]]:
    """A prefill cudaipc backend (TP 1, random KV, ``batch_max_bytes`` ``limit``) linked to
    three decode backends (:func:`_tp12_links`), the page mover played by :class:`_Pages`;
    every backend closed after."""
    pages = _stand_ins(monkeypatch)
    src, s_arrays = make_pool(MODEL, RankPosition(), 6)
    rng = np.random.default_rng(9)
    for arr in s_arrays:
        arr[...] = rng.integers(0, 1 << 30, arr.shape, dtype=np.int32)
    cfg = KVWireConfig(
        transfer_backend="cudaipc", transfer_backend_options={"batch_max_bytes": limit}
    )
    a = create_backend(cfg, "prefill", need=())
    decodes = [create_backend(cfg, f"decode{i}", need=()) for i in range(3)]
    try:
        yield pages, a, _tp12_links(a, decodes, src, s_arrays)
    finally:
        a.close()
        for b in decodes:
            b.close()


def _tp12_links(a: Any, decodes: list[Any], src: Any, s_arrays: list[np.ndarray]) -> list[Any]:
    """``a`` (prefill, TP 1) linked to each decode backend (TP 2 ranks, alternating): per
    link the peer, its prepared pair, a chunk's plan (pages 5, 1, 3 -> 0, 4, 2), decode's
    pool, the tables, the chunk's rows, copies of the pool and the slice's bytes."""
    a.register(_vram(s_arrays))
    links = []
    for i, b in enumerate(decodes):
        dst, d_arrays = make_pool(MODEL, RankPosition(tp_size=2, tp_rank=i % 2), 6)
        b.register(_vram(d_arrays))
        mapper = HeadSliceMapper(src, dst)
        tables = mapper.build_tables()
        pair = a.prepare(a.add_peer(b.local_metadata()), tables.src, tables.dst)
        plan = ChunkPlan.direct(mapper, [5, 1, 3], [0, 4, 2])
        si, di = mapper.map_chunk([5, 1, 3], [0, 4, 2])
        want = [d.copy() for d in d_arrays]
        links.append((b, pair, plan, d_arrays, tables, si, di, want, mapper.slice_bytes))
    return links


@pytest.mark.parametrize("fits", [2, 0], ids=["two-per-batch", "too-large-to-hold"])
def test_a_full_batch_goes_out_at_once(monkeypatch: pytest.MonkeyPatch, fits: int) -> None:
    """``batch_max_bytes`` of two chunks: the second write of a turn sends the batch at
    once, the third waits for the turn's end; of one chunk: no write is held (a chunk that
    large launches alone at its submit)."""
    src, _ = make_pool(MODEL, RankPosition(), 6)
    probe = ChunkPlan.direct(HeadSliceMapper(src, make_pool(MODEL, RankPosition(tp_size=2), 6)[0]),
                             [5, 1, 3], [0, 4, 2])  # fmt: skip
    assert probe.pages is not None
    nbytes = probe.pages.nbytes
    with _tp12(monkeypatch, fits * nbytes if fits else nbytes) as (pages, a, links):
        handles = []
        with a.post_batch():
            for i, (_b, pair, plan, *_rest) in enumerate(links):
                handles.append(submit_rows(a, pair, plan.segment("kv"), b"n", _noop))
                if fits and i == 1:
                    assert pages.batches == [2]  # the limit reached: out now
            if fits:
                assert pages.batches == [2] and a.poll(handles[2]) is XferState.PENDING
            else:
                assert pages.batches == [] and len(pages.calls) == 3  # none held
        assert pages.batches == ([2, 1] if fits else [])
        for h in handles:
            assert _wait(lambda h=h: a.poll(h) is not XferState.PENDING)
            assert a.poll(h) is XferState.DONE, h.error
            a.release(h)


def _noop() -> None:
    return None


def test_a_failed_batch_launch_fails_its_writes_and_nothing_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batched launch raising at the turn's end (a CUDA error): every held write ends
    FAILED naming it, the block itself does not raise, and the backend takes the next turn's
    writes again."""
    with _tp12(monkeypatch, 32 << 20) as (pages, a, links):
        real = pages.copy_batch

        def broken(items: Any, *, stream: object = None) -> int:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        pages.copy_batch = broken  # type: ignore[method-assign]
        with a.post_batch():
            handles = [
                submit_rows(a, pair, plan.segment("kv"), b"n", _noop)
                for _b, pair, plan, *_rest in links[:2]
            ]
        for h in handles:
            assert a.poll(h) is XferState.FAILED
            assert "illegal memory access" in (h.error or ""), h.error
            a.release(h)
        pages.copy_batch = real  # type: ignore[method-assign]
        with a.post_batch():
            h = submit_rows(a, links[0][1], links[0][2].segment("kv"), b"again", _noop)
        assert _wait(lambda: a.poll(h) is not XferState.PENDING)
        assert a.poll(h) is XferState.DONE, h.error
        a.release(h)
        assert a.live_handles == 0


class _Order:
    """A chunk's sums order (:class:`kvwire.transfers.WriteSums`) that records what the
    backend did with it; ``device`` says where its sums run."""

    def __init__(self, device: str, pages: int = 3) -> None:
        self.device, self.pages = device, pages
        self.log: list[Any] = []

    def take(self) -> Any:
        self.log.append("take")
        return dataclasses.make_dataclass("Args", ["pages"])(self.pages)

    def launched(self, stream: Any) -> None:
        self.log.append(("launched", stream))

    def abandon(self) -> None:
        self.log.append("abandon")

    def start(self) -> None:
        self.log.append("start")


def test_a_checked_page_write_sums_in_its_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``summed_writes``: inside a worker turn, a page write whose first note carries its
    sums' order launches at its submit (not held for the batch) with the order taken into
    the page mover's call and marked launched on the backend's stream; an order whose sums
    run on another device, or one the chunk does not fit, is started beside the write
    instead (and a taken misfit given back); a plain note is held as before. Each chunk
    lands whole and its note, made after it, reaches its decode rank."""
    from kvwire.backend import LaterNote

    with _tp12(monkeypatch, 32 << 20) as (pages, a, links):
        _want_pools(links)
        fused, elsewhere, misfit = _Order("stand-in"), _Order("cuda:7"), _Order("stand-in", 5)
        notes = [LaterNote(lambda: b"n0", fused), LaterNote(lambda: b"n1", elsewhere), b"n2"]
        handles = []
        with a.post_batch():
            for (_b, pair, plan, *_rest), note in zip(links, notes, strict=True):
                handles.append(submit_rows(a, pair, plan.segment("kv"), note, _noop))
            assert len(pages.calls) == 2 and pages.sums[0].pages == 3 and pages.sums[1] is None
        assert fused.log == ["take", ("launched", a._stream)]
        assert elsewhere.log == ["start"]
        assert pages.batches == [1]  # the plain write, held for the turn
        late = submit_rows(
            a, links[0][1], links[0][2].segment("kv"), LaterNote(lambda: b"m", misfit), _noop
        )
        assert misfit.log == ["take", "abandon", "start"] and pages.sums[-1] is None
        for h in [*handles, late]:
            assert _wait(lambda h=h: a.poll(h) is not XferState.PENDING)
            assert a.poll(h) is XferState.DONE, h.error
            a.release(h)
        for i, (b, _pair, _plan, d_arrays, _t, _si, _di, want, _s) in enumerate(links):
            for d, w in zip(d_arrays, want, strict=True):
                assert np.array_equal(d, w)
            wanted = [f"n{i}".encode()] + ([b"m"] if i == 0 else [])
            assert sorted(x.payload for x in _notes(b, len(wanted))) == sorted(wanted)
        assert a.live_handles == 0


def _notes(b: Any, n: int) -> list[Any]:
    """``b``'s notifications, waited for until ``n`` came (or the wait's bound)."""
    got: list[Any] = []

    def more() -> bool:
        got.extend(b.get_notifications())
        return len(got) >= n

    _wait(more)
    return got


def _want_pools(links: list[Any]) -> None:
    """What each link's chunk rows write, kept as its wanted pools; the pools cleared again."""
    for _, _, _, _, tables, si, di, _, n in links:
        for s_addr, d_addr in zip(
            tables.src[si, ADDR].tolist(), tables.dst[di, ADDR].tolist(), strict=True
        ):
            ctypes.memmove(int(d_addr), int(s_addr), n)
    for _, _, _, d_arrays, _, _, _, want, _ in links:
        for d, w in zip(d_arrays, want, strict=True):
            w[...] = d
            d[...] = 0
