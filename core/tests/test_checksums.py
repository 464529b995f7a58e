"""End-to-end KV checksums (issue 26 item 1): the sum itself, then two managers over tcp.

The corruption is injected on decode, where its check starts: one byte of the rows a chunk
wrote is flipped after they landed and before the check sums them (what a transport that
corrupts a byte looks like, whenever prefill summed the chunk: before posting it, or while
its rows fly); decode's check must catch it and both sides must fail naming the chunk, the
layer and the sender. The negative control switches the comparison off: the flipped byte
stays in decode's KV, which the element check sees. The cluster tests in
``tests/test_checksums_cluster.py`` do the same across processes on every backend.
"""

from __future__ import annotations

import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvwire import integrity
from kvwire.config import ControlOptions, KVWireConfig
from kvwire.descriptors import make_table
from kvwire.errors import DescriptorError, KVWireError
from kvwire.integrity import RowHasher, add_sums, layer_ranges, mismatched_layers
from kvwire.layout import KVLayout, RankPosition
from kvwire.session import KVPoll
from kvwire.session.checksums import LandedSums, SentSums, hasher_for
from kvwire.session.decode import rooms as decode_rooms
from kvwire.session.decode.rooms import ChunkCheck
from kvwire.session.handshake import build_mapper
from kvwire.testing.faults import landed_flipper
from kvwire.testing.interpreted import run_interpreted
from kvwire.testing.kvfill import count_mismatches, fill_pages, make_pool
from kvwire.testing.pair import MODEL, config, no_rooms, pair, wait_for


def _pool(seed: int) -> tuple[KVLayout, list[np.ndarray]]:
    """A verification pool of MODEL (K and V buffers per layer) filled with random bytes."""
    layout, arrs = make_pool(MODEL, RankPosition(), 32)  # 4 KiB buffers
    rng = np.random.default_rng(seed)
    for a in arrs:
        a.view(np.uint8)[...] = rng.integers(0, 256, a.nbytes, dtype=np.uint8).reshape(
            a.view(np.uint8).shape
        )
    return layout, [a.reshape(-1).view(np.uint8) for a in arrs]


def _rows(layout: KVLayout, picks: list[tuple[int, int, int]]) -> np.ndarray:
    """A table of rows (buffer, offset, length)."""
    base = np.array([layout.buffers[b].addr for b, _, _ in picks], dtype=np.uint64)
    return make_table(
        base + np.array([o for _, o, _ in picks], dtype=np.uint64),
        np.array([n for _, _, n in picks], dtype=np.uint64),
    )


def test_sums_add_over_any_split_and_catch_flips_and_misplaced_rows() -> None:
    layout, arrs = _pool(1)
    h = RowHasher(layout)
    n = MODEL.num_layers
    k0, v0, k1, v1 = 0, n, 1, n + 1  # buffer b: K of layer b (b < n), else V of layer b - n
    picks = [(k0, 0, 256), (v0, 512, 256), (k1, 64, 128), (v1, 8, 24), (k0, 1024, 7)]
    picks.append((k1, 1000, 256))
    table = _rows(layout, picks)
    keys = np.arange(len(picks), dtype=np.uint64) * np.uint64(4096) + np.uint64(1 << 40)
    idx = np.arange(len(picks))
    whole = h.sums(table, idx, keys)
    assert set(whole) == {0, 1}
    parts: dict[int, int] = {}
    for sel in (np.array([4, 1]), np.array([0, 2, 5]), np.array([3])):
        add_sums(parts, h.sums(table, idx[sel], keys[sel]))
    assert parts == whole, "the sum must not depend on how rows are split into parts"
    assert h.sums(table, idx, keys, layers=[1]) == {1: whole[1]}
    assert h.row_layers(table, idx).tolist() == [0, 0, 1, 1, 0, 1]
    # one flipped bit, anywhere, in aligned or unaligned rows
    for b, off, layer in ((k0, 100, 0), (v1, 20, 1), (k0, 1030, 0)):
        arrs[b][off] ^= 0x10
        assert mismatched_layers(whole, h.sums(table, idx, keys)) == [layer]
        arrs[b][off] ^= 0x10
    # the same bytes keyed to another destination (a row written to the wrong place)
    swapped = keys.copy()
    swapped[[0, 5]] = swapped[[5, 0]]
    assert mismatched_layers(whole, h.sums(table, idx, swapped)) == [0, 1]
    assert layer_ranges([3, 7, 8, 9, 1]) == "1, 3, 7-9"


def test_each_hasher_refuses_the_other_memory_kind_and_gpu_needs_cuda() -> None:
    layout, _ = _pool(2)
    vram = layout.model_copy(
        update={"buffers": tuple(b.model_copy(update={"kind": 1}) for b in layout.buffers)}
    )
    with pytest.raises(DescriptorError, match=r"reads DRAM buffers.*VRAM"):
        RowHasher(vram)
    assert type(hasher_for(layout)) is RowHasher
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():  # the GPU machine: a device hasher for the GPU pool
        assert type(hasher_for(vram)).__name__ == "DeviceRowHasher"
        return
    with pytest.raises(DescriptorError, match=r"no CUDA device|need torch and triton"):
        hasher_for(vram)


def test_unaligned_rows_of_word_length_sum_like_aligned_ones() -> None:
    """Whether a row is read as words depends on its length only, so a row at an odd offset
    on one side and an aligned one on the other (head slices, other pools) agree."""
    layout, arrs = _pool(3)
    h = RowHasher(layout)
    arrs[1][8:72] = arrs[0][3:67]  # the same 64 bytes, aligned in buffer 1, odd in buffer 0
    key = np.array([1 << 41], dtype=np.uint64)
    layer0 = h.sums(_rows(layout, [(0, 3, 64)]), [0], key)
    layer1 = h.sums(_rows(layout, [(1, 8, 64)]), [0], key)
    assert list(layer0.values()) == list(layer1.values())
    # ...and the same row split into a mixed chunk adds up the same
    both = h.sums(_rows(layout, [(0, 3, 64), (0, 8, 64)]), [0, 1], np.r_[key, key + 64])
    alone = h.sums(_rows(layout, [(0, 8, 64)]), [0], key + 64)
    assert both[0] == (layer0[0] + alone[0]) % (1 << 64)


def _naive_term(row: np.ndarray, key: int) -> int:
    """One row's checksum term, word by word in Python integers (the definition in
    kvwire.integrity's docstring, written independently of its vectorised passes)."""
    from kvwire.integrity import MIX1, MIX2, ODD, weights

    cells = row.view("<u8") if row.size % 8 == 0 else row
    w = weights(cells.size)
    m = (1 << 64) - 1
    body = sum(int(c) * int(p) for c, p in zip(cells, w, strict=True)) & m
    x = key
    x = ((x ^ (x >> 30)) * int(MIX1)) & m
    x = ((x ^ (x >> 27)) * int(MIX2)) & m
    x ^= x >> 31
    return ((body ^ x) * int(ODD)) & m


@pytest.mark.parametrize(
    "rows",
    [
        "neighbours",  # a chunk's pages side by side in each buffer: read through a view
        "gaps",  # every other row: still one view, the rows between summed and dropped
        "scattered",  # far apart: gathered
        "shuffled",  # neighbours in another order, one row twice
    ],
)
@pytest.mark.parametrize("halves", [False, True])
def test_the_vectorised_passes_equal_a_row_by_row_sum(
    rows: str, halves: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``halves``: the rows are cut in two halves, one summed on the helper thread (as a
    host sum of at least ``PARALLEL_MIN_BYTES`` is)."""
    if halves:
        monkeypatch.setattr(integrity, "PARALLEL_MIN_BYTES", 1)
    layout, arrs = _pool(7)
    h = RowHasher(layout)
    n = 128  # bytes per row (16 words); buffers of 4 KiB hold 32 such rows
    slots = {
        "neighbours": [3, 4, 5, 6],
        "gaps": [2, 4, 6, 8],
        "scattered": [0, 31, 17],
        "shuffled": [9, 7, 8, 7, 10],
    }[rows]
    picks = [(b, s * n, n) for b in (0, 1, 2) for s in slots] + [(3, 5, 13), (3, 40, 13)]
    table = _rows(layout, picks)
    keys = (np.arange(len(picks), dtype=np.uint64) * np.uint64(977)) + np.uint64(1 << 33)
    want: dict[int, int] = {}
    layers = h.row_layers(table, np.arange(len(picks)))
    for (b, off, length), key, layer in zip(picks, keys, layers, strict=True):
        term = _naive_term(arrs[b][off : off + length], int(key))
        want[int(layer)] = (want.get(int(layer), 0) + term) % (1 << 64)
    assert h.sums(table, np.arange(len(picks)), keys) == want


_DEVICE_CHECK = textwrap.dedent(
    """
    import numpy as np
    from kvwire.descriptors import make_table
    from kvwire.integrity import RowHasher, add_sums, mismatched_layers
    import kvwire.integrity_device as device_mod
    from kvwire.errors import DescriptorError
    from kvwire.integrity_device import DeviceRowHasher
    from kvwire.layout import RankPosition
    from kvwire.testing.kvfill import make_pool
    from kvwire.testing.pair import MODEL
    layout, arrs = make_pool(MODEL, RankPosition(), 32)
    rng = np.random.default_rng(5)
    for a in arrs:
        a.view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
    vram = layout.model_copy(
        update={"buffers": tuple(b.model_copy(update={"kind": 1}) for b in layout.buffers)}
    )
    host = RowHasher(layout)
    dev = DeviceRowHasher(vram, device="cpu")
    inline = DeviceRowHasher(vram, device="cpu", block=256, inline_weights=True)
    nbuf = len(layout.buffers)
    size = layout.buffers[0].length
    for trial in range(6):
        # trials 4 and 5: tables too large to describe on the device (rows sent per call)
        device_mod._MAX_TABLE_ROWS = 1 << 20 if trial < 4 else 0
        count = 24
        b = rng.integers(0, nbuf, count)
        n = rng.choice([8, 64, 256, 24, 7, 1, 130, 2048], count)
        off = np.array([rng.integers(0, size - k + 1) for k in n])
        if trial % 2:
            off -= off % 8  # aligned rows too
        base = np.array([layout.buffers[i].addr for i in b], dtype=np.uint64)
        table = make_table(base + off.astype(np.uint64), n.astype(np.uint64))
        keys = rng.integers(0, 1 << 62, count).astype(np.uint64)
        idx = np.arange(count)
        want = host.sums(table, idx, keys)
        got = dev.sums(table, idx, keys)
        assert got == want, (trial, got, want)
        assert inline.sums(table, idx, keys) == want, trial
        assert dev.sums(table, idx, keys, layers=[1]) == host.sums(table, idx, keys, layers=[1])
        # layer ranges are selected on the device, reusing the located rows of the last call
        # (the same objects), also after another call hashed other rows in between
        for lo, hi in ((0, 1), (1, 2), (0, 2), (1, 1), (2, 5)):
            want_r = host.sums(table, idx, keys, layers=range(lo, hi))
            assert dev.sums(table, idx, keys, layers=range(lo, hi)) == want_r, (lo, hi)
        parts = {}
        for g in range(nbuf // 2):
            add_sums(parts, dev.sums(table, idx, keys, layers=range(g, g + 1)))
            other = dev.sums(table, idx[::2], keys[::2])
            assert other == host.sums(table, idx[::2], keys[::2]), g
        assert parts == want, trial
        # a flipped byte in a summed row changes exactly its layer's sum
        first = int(table[0, 0] - np.uint64(layout.buffers[int(b[0])].addr))
        arrs[int(b[0])].view(np.uint8).reshape(-1)[first] ^= 0x40
        layer = int(b[0]) % (nbuf // 2)
        assert mismatched_layers(want, dev.sums(table, idx, keys)) == [layer], trial
        arrs[int(b[0])].view(np.uint8).reshape(-1)[first] ^= 0x40
        assert dev.sums(table, idx, keys) == want
    # rows outside the rank's buffers, or indices outside the table, are refused
    bad = make_table(np.array([8], dtype=np.uint64), np.array([64], dtype=np.uint64))
    for t, i in ((bad, np.array([0])), (table, np.array([count]))):
        try:
            dev.sums(t, i, keys[:1])
        except DescriptorError:
            pass
        else:
            raise AssertionError("a bad row was hashed")
    print("DEVICE-HASH-OK")
    """
)


_DEVICE_PAGES = textwrap.dedent(
    """
    import numpy as np
    from kvwire.errors import DescriptorError
    from kvwire.integrity import RowHasher, mismatched_layers
    from kvwire.integrity_device import DeviceRowHasher
    from kvwire.layout import ModelSpec, RankPosition
    from kvwire.page_form import PageSide
    from kvwire.testing.kvfill import make_pool

    model = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype="int32", page_size=2)
    layout, arrs = make_pool(model, RankPosition(), 8)  # 4 buffers of 1 KiB (pages use 512 B)
    rng = np.random.default_rng(11)
    for a in arrs:
        a.reshape(-1).view(np.uint8)[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
    vram = layout.model_copy(
        update={"buffers": tuple(b.model_copy(update={"kind": 1}) for b in layout.buffers)}
    )
    host = RowHasher(layout)
    dev = DeviceRowHasher(vram, device="cpu")
    inline = DeviceRowHasher(vram, device="cpu", block=16, inline_weights=True)
    addr = np.array([b.addr for b in layout.buffers], dtype=np.uint64)
    # (bytes a piece, pieces a page, byte offset of pair 0's piece 0, bytes a piece apart):
    # aligned words, unaligned words, bytes, whole pages, one piece a page
    cases = [(16, 2, 8, 32), (16, 2, 3, 24), (7, 2, 1, 9), (64, 1, 0, 0), (136, 1, 0, 0)]
    for n, tokens, off, row in cases:
        slot = 64 if n <= 64 else 144
        slots = 512 // slot
        read = PageSide(addr + np.uint64(off), slot, row, n, tokens, slots)
        key = PageSide(np.arange(4, dtype=np.uint64) * np.uint64(1 << 20) + np.uint64(1 << 40),
                       4096, 128, n, tokens, 64)
        rp = rng.permutation(slots)[:3].astype(np.int64)
        kp = rng.permutation(64)[:3].astype(np.int64)
        want = host.page_sums(read, rp, key, kp)
        assert set(want) == {0, 1}, want
        assert dev.page_sums(read, rp, key, kp) == want, (n, off)
        assert dev.page_sums_later(read, rp, key, kp)() == want, (n, off)
        assert dev.page_sums_later(read, rp, key, kp, [1]) is None  # a host-selected filter
        if n == 136:  # weights computed in the kernel, rows longer than a block
            assert inline.page_sums(read, rp, key, kp) == want, (n, off)
        for lo, hi in ((1, 2), (1, 1)):
            sel = range(lo, hi)
            assert dev.page_sums(read, rp, key, kp, sel) == host.page_sums(read, rp, key, kp, sel)
        assert dev.page_sums(read, rp, key, kp, [1]) == {1: want[1]}
        # a flipped byte of one page of buffer 3 (V of layer 1) changes layer 1 only
        b = off + int(rp[1]) * slot + (tokens - 1) * row + n - 1
        arrs[3].reshape(-1).view(np.uint8)[b] ^= 0x80
        assert mismatched_layers(want, dev.page_sums(read, rp, key, kp)) == [1], (n, off)
        arrs[3].reshape(-1).view(np.uint8)[b] ^= 0x80
        # the same bytes keyed to swapped destination pages
        assert mismatched_layers(want, dev.page_sums(read, rp, key, kp[[1, 0, 2]])) == [0, 1]
    key = PageSide(np.zeros(4, dtype=np.uint64), 64, 0, 64, 1, 17)
    try:  # buffers of 1 KiB: page 16 of 64 bytes lies past them
        dev.page_sums(PageSide(addr, 64, 0, 64, 1, 17), np.array([16]), key, np.array([0]))
    except DescriptorError:
        pass
    else:
        raise AssertionError("a page past the buffers was hashed")
    # the geometries real mappers give: whole pages, head slices both ways, an MLA sender
    from kvwire.config import KVWireConfig
    from kvwire.page_form import page_sides
    from kvwire.session.handshake import build_mapper

    def flagged(lay):
        kinds = tuple(b.model_copy(update={"kind": 1}) for b in lay.buffers)
        return lay.model_copy(update={"buffers": kinds})

    for heads, tp, ranks, mla in (
        (2, (1, 1), (0, 0), False),
        (4, (2, 1), (1, 0), False),
        (4, (1, 2), (0, 1), False),
        (1, (2, 1), (0, 0), True),
    ):
        sides = []
        for i in (0, 1):
            m = ModelSpec(num_layers=2, total_kv_heads=heads, head_dim=4, dtype="int32",
                          page_size=4, is_mla=mla)
            lay, mem = make_pool(m, RankPosition(tp_size=tp[i], tp_rank=ranks[i]), 6)
            for a in mem:
                a.reshape(-1).view(np.uint8)[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
            sides.append((lay, mem))
        (src, _), (dst, _) = sides
        mapper = build_mapper(KVWireConfig(), src, dst)
        tables = mapper.build_tables()
        s_side, d_side = page_sides(mapper.page_geometry, tables.src, tables.dst)
        sp, dp = rng.permutation(6)[:3], rng.permutation(6)[:3]
        si, di = mapper.map_chunk(sp, dp)
        want = RowHasher(src).sums(tables.src, si, tables.dst[di, 0])
        got = DeviceRowHasher(flagged(src), device="cpu").page_sums(s_side, sp, d_side, dp)
        assert got == want and set(got) == {0, 1}, (tp, mla)
        want = RowHasher(dst).sums(tables.dst, di, tables.dst[di, 0])
        got = DeviceRowHasher(flagged(dst), device="cpu").page_sums(d_side, dp, d_side, dp)
        assert got == want and set(got) == {0, 1}, (tp, mla)
    # calls from several threads: each on a lane of its own, every sum the host's
    import threading
    read = PageSide(addr, 64, 0, 64, 1, 8)
    key = PageSide(addr, 64, 0, 64, 1, 8)
    lanes, results = {}, {}

    def call(i):
        lanes[i] = dev._lane()
        pages = np.array([(i + j) % 8 for j in range(3)], dtype=np.int64)
        got = dev.page_sums(read, pages, key, pages)
        results[i] = (got, host.page_sums(read, pages, key, pages))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(x) for x in lanes.values()}) == 3 and dev._lane() not in lanes.values()
    assert all(got == want and want for got, want in results.values()), results
    print("DEVICE-PAGES-OK")
    """
)


def test_device_hasher_kernels_equal_the_host_hasher_in_the_interpreter() -> None:
    """The Triton checksum kernels themselves, run by Triton's CPU interpreter over host
    memory (one interpreter start, most of the test's time): aligned words, unaligned words
    and byte rows give the host hasher's sums bit for bit, listed as rows and in page form
    (one program per (pair, page); whole pages and pieces, and the geometries of real equal-TP,
    head-slice and MLA links against their row form; layer ranges on the device); calls from
    three threads, each on a lane (stream and buffers) of its own."""
    pytest.importorskip("triton")
    run_interpreted(_DEVICE_CHECK + _DEVICE_PAGES, "DEVICE-PAGES-OK")


def _checked() -> KVWireConfig:
    return config(kv_checksum=True)


@pytest.mark.parametrize(("dst_page", "chunks"), [(None, (1, 3)), (4, (3, 1)), (1, (2, 2))])
def test_checked_transfers_succeed(
    dst_page: int | None, chunks: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode asks for checksums: chunked requests, with and without page conversion, land
    verified, and every chunk was checked (each note that completed a chunk carried sums)."""
    dmodel = None if dst_page is None else MODEL.model_copy(update={"page_size": dst_page})
    with pair(config(), _checked(), dmodel=dmodel) as p:
        checked: list[Any] = []
        original = ChunkCheck.run

        def spy(check: ChunkCheck, later: Any = None) -> Any:
            checked.append((check.msg.chunk_id, dict(check.sent)))
            return original(check, later)

        monkeypatch.setattr(ChunkCheck, "run", spy)
        n = 4
        m = n * MODEL.page_size // (dst_page or MODEL.page_size)
        r = p.decode.receiver(5, p.addr)
        r.init()
        dst = np.arange(m) + 3
        r.send_metadata(dst, aux_index=1, cached_tokens=0)
        s = p.prefill.sender(5)
        src = np.arange(n) + 2
        fill_pages(p.play, p.parr, src, 0)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput)
        s.init(n, aux_index=2)
        off = 0
        for i, k in enumerate(chunks):
            s.send(src[off : off + k], last=i == len(chunks) - 1)
            off += k
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll())
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        assert sorted(c for c, _ in checked) == list(range(len(chunks)))
        layers = set(range(MODEL.num_layers))
        assert all(set(sums) == layers for _, sums in checked), "every layer summed"
        r.clear()
        s.clear()


def _flip_on_landing(monkeypatch: pytest.MonkeyPatch, **which: Any) -> None:
    """Decode's check of each landed chunk (``which``: of the chunks whose page span it
    accepts, ``spans=``) starts by flipping one bit of byte 5 of the chunk's first row of
    layer 1 (K or V): what a transport corrupting one byte in flight looks like to the check,
    whenever prefill summed the chunk (fault ``flip_on_landing``)."""
    monkeypatch.setattr(LandedSums, "chunk", landed_flipper(layer=1, offset=5, **which))


@pytest.mark.parametrize("late", [False, True])
def test_a_byte_flipped_in_flight_fails_the_request_naming_chunk_layer_sender(
    monkeypatch: pytest.MonkeyPatch, late: bool
) -> None:
    """Whether the chunk was summed before its rows were posted or while they flew (late
    sums: host chunks of ``LATE_BYTES`` and more, lowered here)."""
    if late:
        monkeypatch.setattr(RowHasher, "LATE_BYTES", 0)
    with pair(config(), _checked()) as p:
        _flip_on_landing(monkeypatch)
        s, r, src, _ = p.start(9, 4)
        t0 = time.monotonic()
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Failed)
        assert time.monotonic() - t0 < 5.0
        want = r"KV checksum mismatch in chunk 0 \(request pages \[0, 4\)\) from .* layers 1 differ"
        with pytest.raises(KVWireError, match=want):
            r.failure_exception()
        # Prefill hears it unless its side of the request had already succeeded (its writes
        # completed before decode checked them): then it has nothing left to fail.
        wait_for(lambda: s.poll() in (KVPoll.Failed, KVPoll.Success))
        if s.poll() == KVPoll.Failed:
            with pytest.raises(KVWireError, match=want):
                s.failure_exception()
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_the_flip_is_real_corruption_only_the_check_catches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control: with decode's comparison of the sums switched off (the landed rows
    are still summed, so the same flip happens), the request succeeds with wrong KV (the
    element check sees it): the flip corrupts what decode keeps, and it is the checksum
    comparison that fails the request above."""
    monkeypatch.setattr(decode_rooms, "mismatched_layers", lambda *a: [])
    with pair(config(), _checked()) as p:
        _flip_on_landing(monkeypatch)
        s, r, src, dst = p.start(10, 4)
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll())
        assert count_mismatches(p.dlay, p.darr, dst, 0) > 0
        r.clear()
        s.clear()


def _gate_first_check(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """A fake for timing only: decode's first chunk check (``LandedSums.chunk``, the summing
    of the landed rows) blocks until the returned ``gate`` is set, standing in for a slow
    hasher; ``entered`` is set once it blocks. Later checks run unchanged. The sums it
    returns are the real ones."""
    original = LandedSums.chunk
    entered, gate = threading.Event(), threading.Event()
    calls = {"n": 0}
    lock = threading.Lock()

    def chunk(self: LandedSums, *args: Any) -> Any:
        with lock:
            calls["n"] += 1
            first = calls["n"] == 1
        if first:
            entered.set()
            assert gate.wait(120), "the test never released the first check"
        return original(self, *args)

    monkeypatch.setattr(LandedSums, "chunk", chunk)
    return entered, gate


def test_a_slow_check_blocks_neither_other_requests_nor_its_own_success_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check runs off the progress thread and the room lock: while request A's only
    chunk is being checked (held by a gated hasher, a fake for timing only), request B on the
    same decode rank lands, is checked and succeeds; A stays Transferring until its check
    returns, then succeeds with correct KV."""
    entered, gate = _gate_first_check(monkeypatch)
    with pair(config(), _checked()) as p:
        sa, ra, src_a, dst_a = p.start(21, 4)
        sa.send(src_a, last=True)
        wait_for(entered.is_set, timeout=60)
        # B: its own aux rows and pages, on the same pair (A's aux row 1, B's 3).
        rb = p.decode.receiver(22, p.addr)
        rb.init()
        dst_b = np.arange(4) + 20
        rb.send_metadata(dst_b, aux_index=3)
        sb = p.prefill.sender(22)
        src_b = np.arange(4) + 4
        fill_pages(p.play, p.parr, src_b, 100)
        wait_for(lambda: sb.poll() >= KVPoll.WaitingForInput)
        sb.init(4, aux_index=4)
        sb.send(src_b, last=True)
        wait_for(lambda: rb.poll() == KVPoll.Success, timeout=60)
        assert count_mismatches(p.dlay, p.darr, dst_b, 100) == 0
        # A's data and aux landed long ago; only its check is outstanding.
        assert not gate.is_set()
        assert ra.poll() == KVPoll.Transferring
        assert p.decode.room_tables()["checks_in_flight"] == 1
        gate.set()
        wait_for(lambda: ra.poll() == KVPoll.Success, timeout=60)
        assert count_mismatches(p.dlay, p.darr, dst_a, 0) == 0
        for x in (ra, rb, sa, sb):
            x.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode), timeout=60)


def test_a_request_cleared_while_its_check_runs_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine clears a request whose chunk is being checked (gated hasher, a fake for
    timing only): the verdict that comes later is dropped, nothing crashes or leaks, and
    the next request on the rank is checked and succeeds."""
    entered, gate = _gate_first_check(monkeypatch)
    with pair(config(), _checked()) as p:
        s, r, src, _ = p.start(23, 4)
        s.send(src, last=True)
        wait_for(entered.is_set, timeout=60)
        r.clear()
        gate.set()
        wait_for(lambda: p.decode.room_tables()["checks_in_flight"] == 0, timeout=60)
        assert r.poll() != KVPoll.Success
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode), timeout=60)
        s2, r2, src2, dst2 = p.start(24, 4)
        s2.send(src2, last=True)
        wait_for(lambda: r2.poll() == KVPoll.Success == s2.poll(), timeout=60)
        assert count_mismatches(p.dlay, p.darr, dst2, 0) == 0
        r2.clear()
        s2.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode), timeout=60)


def test_a_request_failed_while_its_check_runs_stays_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode's waiting timeout (1 s here) fails a request whose only chunk is still being
    checked (gated hasher, a fake for timing only): the deadline runs while the check is
    held, the verdict that comes later (a pass) is dropped, the request stays Failed with
    the timeout as its error, and nothing is left behind."""
    entered, gate = _gate_first_check(monkeypatch)
    with pair(config(), config(kv_checksum=True, waiting_timeout_s=3.0)) as p:
        s, r, src, _ = p.start(25, 4)
        s.send(src, last=True)
        wait_for(entered.is_set, timeout=60)
        wait_for(lambda: r.poll() == KVPoll.Failed, timeout=60)
        gate.set()
        wait_for(lambda: p.decode.room_tables()["checks_in_flight"] == 0, timeout=60)
        assert r.poll() == KVPoll.Failed
        with pytest.raises(KVWireError, match="waiting timeout"):
            r.failure_exception()
        r.clear()
        wait_for(lambda: s.poll() in (KVPoll.Failed, KVPoll.Success), timeout=60)
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode), timeout=60)


def test_a_prefill_that_sends_no_checksums_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode asks; a prefill that acknowledges without checksums (an older kvwire) is
    refused at the handshake, naming the option, and the request fails fast."""
    from kvwire.session.prefill import links as prefill_links

    monkeypatch.setattr(prefill_links, "SentSums", None)
    original = prefill_links.DecodeLinker.handshake

    def handshake(self: Any, hello: Any, *rest: Any) -> None:
        original(self, hello.model_copy(update={"checksum": False}), *rest)

    monkeypatch.setattr(prefill_links.DecodeLinker, "handshake", handshake)
    with pair(config(), _checked()) as p:
        r = p.decode.receiver(4, p.addr)
        r.init()
        wait_for(lambda: r.poll() == KVPoll.Failed)
        with pytest.raises(KVWireError, match="kv_checksum"):
            r.failure_exception()
        r.clear()


def test_the_option_is_a_control_option() -> None:
    assert ControlOptions(kv_checksum=True).kv_checksum
    assert not ControlOptions().kv_checksum


@pytest.mark.parametrize("flip", [False, True])
def test_layerwise_groups_carry_their_layers_sums(
    monkeypatch: pytest.MonkeyPatch, flip: bool
) -> None:
    """A layer-wise chunk is posted group by group (one group per layer here), each group's
    note carrying the sums of its layers only; decode adds them up and checks the chunk once
    every group landed. A byte flipped after summing fails it naming that layer."""
    dcfg = _checked()
    with pair(config(layerwise_groups=2), dcfg) as p:
        if flip:
            _flip_on_landing(monkeypatch)
        seen: list[list[int]] = []
        original = SentSums.chunk

        def spy(self: SentSums, src: Any, dst: Any, layers: Any = None) -> Any:
            sums = original(self, src, dst, layers)
            seen.append(sorted(sums))
            return sums

        monkeypatch.setattr(SentSums, "chunk", spy)
        s, r, src, dst = p.start(12, 4)
        s.send(src, last=True, layerwise=True)
        for layer in range(MODEL.num_layers):
            s.layer_ready(layer)
        if flip:
            wait_for(lambda: r.poll() == KVPoll.Failed)
            with pytest.raises(KVWireError, match=r"chunk 0 .* layers 1 differ"):
                r.failure_exception()
        else:
            wait_for(lambda: r.poll() == KVPoll.Success == s.poll())
            assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        assert seen[:2] == [[0], [1]], "each group summed only its own layers"
        r.clear()
        s.clear()


def test_sent_sums_map_a_chunk_once_for_all_its_layer_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer-wise chunk asks for its sums group by group with the same page arrays: the
    chunk is mapped once per worker thread, and the groups' sums add up to the chunk's (a
    link summed as rows). A link with a page form never maps rows, with the same sums."""
    import threading

    src_layout, _ = _pool(7)
    dst_layout, _ = _pool(8)
    mapper = build_mapper(KVWireConfig(), src_layout, dst_layout)
    sent = SentSums(mapper, src_layout)
    calls: list[int] = []
    original = mapper.map_chunk

    def counting(src: Any, dst: Any) -> Any:
        calls.append(1)
        return original(src, dst)

    monkeypatch.setattr(mapper, "map_chunk", counting)
    src, dst = np.array([3, 1, 4]), np.array([5, 9, 2])
    assert sent.sides is not None, "equal TP has a page form"
    paged = sent.chunk(src, dst)
    assert not calls and paged == sent.chunk(src, dst, (0, MODEL.num_layers))
    sent.sides = None  # the row path (links with no page form)
    whole = sent.chunk(src, dst)
    assert whole == paged
    assert len(calls) == 1 and set(whole) == set(range(MODEL.num_layers))
    groups: dict[int, int] = {}
    for layer in range(MODEL.num_layers):
        add_sums(groups, sent.chunk(src, dst, (layer, layer + 1)))
    assert len(calls) == 1, "the groups of one chunk reuse its mapped rows"
    assert groups == whole
    sent.chunk(src.copy(), dst)  # other arrays: another chunk, mapped again
    assert len(calls) == 2
    other = threading.Thread(target=sent.chunk, args=(src, dst))  # another worker maps its own
    other.start()
    other.join()
    assert len(calls) == 3


def test_a_mismatch_waits_for_the_requests_other_checks_so_the_report_is_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two chunks; the first one's check is held (gated hasher, a fake for timing only) while
    the second, whose byte was flipped on landing, fails its check. The request
    does not fail yet: the mismatch waits for the first check, so once that one passes the
    failure report counts the first chunk's pages as landed and only the second's as
    missing (they would all be missing if the report were taken while the first check ran)."""
    entered, gate = _gate_first_check(monkeypatch)
    _flip_on_landing(monkeypatch, spans=lambda span: span[0] == 2)  # the second chunk only
    with pair(config(), _checked()) as p:
        s, r, src, _ = p.start(26, 4)
        s.send(src[:2], last=False)
        wait_for(entered.is_set, timeout=60)
        s.send(src[2:], last=True)
        # the second chunk's check ran and failed; the first is still held
        wait_for(lambda: p.decode.room_tables()["checks_in_flight"] == 1, timeout=60)
        time.sleep(0.2)
        assert r.poll() == KVPoll.Transferring, "failed before the request's other check ended"
        gate.set()
        wait_for(lambda: r.poll() == KVPoll.Failed, timeout=60)
        with pytest.raises(KVWireError, match=r"KV checksum mismatch in chunk 1"):
            r.failure_exception()
        wait_for(r.writes_quiesced, timeout=60)
        report = r.failure_report()
        assert report is not None
        assert report.good_pages.tolist() == [0, 1]
        assert report.missing_pages.tolist() == [2, 3]
        r.clear()
        wait_for(lambda: s.poll() in (KVPoll.Failed, KVPoll.Success), timeout=60)
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode), timeout=60)


def test_inline_checks_run_on_the_noting_thread_and_still_catch_a_flip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A link whose hasher checks inline (the device hasher's ``INLINE_CHECK``; the host
    hasher is flagged so here, since no GPU runs this suite) is checked on the thread that
    handled the note, after it let go of the room lock, never on a checker thread: clean
    chunked requests land checked, and a flipped byte still fails the request naming chunk
    and layer. Nothing is left in flight."""
    monkeypatch.setattr(RowHasher, "INLINE_CHECK", True)
    ran: list[tuple[str, bool]] = []
    original = ChunkCheck.run

    def spy(check: ChunkCheck, later: Any = None) -> Any:
        rooms_lock = p.decode.rooms.lock
        held = rooms_lock._is_owned()  # type: ignore[attr-defined]
        ran.append((threading.current_thread().name, held))
        return original(check, later)

    monkeypatch.setattr(ChunkCheck, "run", spy)
    with pair(config(), _checked()) as p:
        s, r, src, dst = p.start(41, 6)
        s.send(src[:4])
        s.send(src[4:], last=True)
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll())
        assert count_mismatches(p.dlay, p.darr, dst, 0) == 0
        assert len(ran) == 2, ran  # one check per chunk
        assert all(not name.startswith("kvwire-check") for name, _ in ran), ran
        assert not any(held for _, held in ran), "checked under the room lock"
        r.clear()
        s.clear()
        _flip_on_landing(monkeypatch)
        s, r, src, _ = p.start(42, 4)
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Failed)
        want = r"KV checksum mismatch in chunk 0 \(request pages \[0, 4\)\) from .* layers 1 differ"
        with pytest.raises(KVWireError, match=want):
            r.failure_exception()
        wait_for(lambda: s.poll() in (KVPoll.Failed, KVPoll.Success))
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
        assert p.decode.side.checker.in_flight() == 0  # type: ignore[union-attr]
