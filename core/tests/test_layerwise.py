"""Layer-wise streaming (``send(..., layerwise=True)`` + ``layer_ready``): each layer group of a
chunk moves as soon as its layers are computed, the rest waits; bad calls are refused."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvwire.errors import ConfigError, TransferError
from kvwire.index.equal_tp import EqualTPMapper
from kvwire.index.head_slice import HeadSliceMapper
from kvwire.layout import ModelSpec, RankPosition
from kvwire.session import KVPoll
from kvwire.session.layers import LayerGate, group_edges
from kvwire.testing.kvfill import make_pool, page_values
from kvwire.testing.pair import Pair, config, no_rooms, pair, wait_for

MODEL8 = ModelSpec(num_layers=8, total_kv_heads=2, head_dim=8, dtype="int32", page_size=2)


class Event:
    """A stand-in for ``torch.cuda.Event`` (no GPU here): ``query()`` is False until set."""

    def __init__(self) -> None:
        self.done = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def test_group_edges_cover_the_layers_evenly() -> None:
    assert group_edges(0, 8, 4).tolist() == [0, 2, 4, 6, 8]
    assert group_edges(4, 7, 4).tolist() == [4, 5, 6, 7]  # fewer layers than groups
    assert group_edges(0, 10, 3).tolist() == [0, 3, 7, 10]
    assert group_edges(2, 3, 16).tolist() == [2, 3]


def test_gate_marks_in_order_and_waits_for_events() -> None:
    gate = LayerGate(0, 8, 4)
    assert gate.ready_until() == 0
    gate.mark(1)
    assert gate.ready_until() == 2
    ev = Event()
    gate.mark(4, ev)
    gate.mark(5)  # behind the unfinished event: not ready either
    assert gate.ready_until() == 2 and ev.queries >= 1
    ev.done = True
    assert gate.ready_until() == 6
    with pytest.raises(ConfigError, match="already marked"):
        gate.mark(3)
    with pytest.raises(ConfigError, match=r"holds layers \[0, 8\)"):
        gate.mark(8)
    with pytest.raises(ConfigError, match="query"):
        gate.mark(7, event="not an event")
    assert not gate.fully_marked and gate.missing() == "layers [6, 8)"
    gate.mark(None)
    assert gate.fully_marked and gate.ready_until() == 8


@pytest.mark.parametrize("mapper_cls, tp", [(EqualTPMapper, (1, 1)), (HeadSliceMapper, (2, 1))])
def test_split_layers_keeps_every_row_in_its_layer_group(mapper_cls: type, tp: tuple) -> None:
    model = ModelSpec(num_layers=6, total_kv_heads=4, head_dim=4, dtype="int32", page_size=2)
    src, _ = make_pool(model, RankPosition(tp_size=tp[0], tp_rank=0), 8)
    dst, _ = make_pool(model, RankPosition(tp_size=tp[1], tp_rank=0), 8)
    mapper = mapper_cls(src, dst)
    tables = mapper.build_tables()
    s_idx, d_idx = mapper.map_chunk(np.array([3, 1, 5]), np.array([0, 7, 2]))
    edges = group_edges(0, 6, 4)  # [0, 2, 3, 5, 6]
    cut = mapper.split_layers(s_idx, d_idx, edges)
    assert cut is not None and len(cut) == 4
    # every row exactly once, pairs kept together
    s_all = np.concatenate([c[0] for c in cut])
    d_all = np.concatenate([c[1] for c in cut])
    assert sorted(zip(s_all, d_all, strict=True)) == sorted(zip(s_idx, d_idx, strict=True))
    # each group's source rows lie in buffers of that group's layers
    bases = src.bases
    item = np.uint64(src.buffers[0].length)
    for g, (s, _) in enumerate(cut):
        addr = tables.src[s, 0]
        inside = (addr[:, None] >= bases[None, :]) & (addr[:, None] < bases[None, :] + item)
        assert (inside.sum(axis=1) == 1).all()
        layers = src.buffer_keys[inside.argmax(axis=1), 0]
        assert ((layers >= edges[g]) & (layers < edges[g + 1])).all(), g


def _layer_arrived(p: Pair, layer: int, dst: np.ndarray) -> bool:
    """Decode holds layer ``layer``'s K and V of the request (written from page 0 on)."""
    n = MODEL8.num_layers
    return all(
        (p.darr[b][dst] == page_values(p.dlay, b, 0, len(dst))).all() for b in (layer, n + layer)
    )


def _start(p: Pair, room: int, pages: int, dst: np.ndarray) -> tuple:
    s, r, src, _ = p.start(room, pages, dst)
    return s, r, src


def test_layer_groups_move_while_later_layers_are_computed() -> None:
    """Groups of 2 layers: a group lands once marked (and its event done), not before; the
    request completes as usual, in two chunks."""
    cfg = config(layerwise_groups=4)
    with pair(cfg, model=MODEL8) as p:
        dst = np.arange(6) + 10
        s, r, src = _start(p, 7, 6, dst)
        s.send(src[:2], layerwise=True)
        time.sleep(0.2)
        assert not any(_layer_arrived(p, layer, dst[:2]) for layer in range(8))
        s.layer_ready(0)  # half of group 0: nothing moves
        time.sleep(0.2)
        assert not _layer_arrived(p, 0, dst[:2])
        ev = Event()
        s.layer_ready(3, event=ev)  # groups 0 and 1, behind a running event
        wait_for(lambda: ev.queries > 0)  # the event was asked (by progress, not 0.2 s)
        assert not _layer_arrived(p, 0, dst[:2])
        ev.done = True
        wait_for(lambda: all(_layer_arrived(p, layer, dst[:2]) for layer in range(4)))
        assert not any(_layer_arrived(p, layer, dst[:2]) for layer in range(4, 8))
        assert r.poll() == KVPoll.Transferring
        with pytest.raises(ConfigError, match=r"misses layers \[4, 8\)"):
            s.send(src[2:], last=True)
        wait_for(lambda: s.poll() == KVPoll.Failed)  # the bad call failed the request...
        wait_for(lambda: r.poll() == KVPoll.Failed)  # ...on both sides
        r.clear()
        s.clear()

        s, r, src = _start(p, 8, 6, dst)
        s.send(src[:2], layerwise=True)
        for layer in range(8):
            s.layer_ready(layer)
        s.send(src[2:], last=True, layerwise=True)
        s.layer_ready(5)
        time.sleep(0.2)
        assert r.poll() == KVPoll.Transferring  # layers 6 and 7 of the last chunk missing
        s.layer_ready(None)
        wait_for(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success)
        assert all(_layer_arrived(p, layer, dst) for layer in range(8))
        # 2 chunks x 4 layer groups; the aux row rides in the last group's note (1.11)
        assert s.metrics.chunks == 2 * 4
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_synchronous_mode_sends_when_every_layer_is_marked() -> None:
    with pair(config(sync_transfers=True), model=MODEL8) as p:
        dst = np.arange(4) + 3
        s, r, src = _start(p, 9, 4, dst)
        s.send(src, last=True, layerwise=True)
        s.layer_ready(6)
        time.sleep(0.1)
        assert r.poll() < KVPoll.Success
        s.layer_ready(7)
        wait_for(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success)
        assert all(_layer_arrived(p, layer, dst) for layer in range(8))
        r.clear()
        s.clear()


def test_unmarked_layers_fail_the_request_at_the_transfer_deadline() -> None:
    with pair(config(transfer_timeout_s=0.5), model=MODEL8) as p:
        dst = np.arange(2) + 3
        s, r, src = _start(p, 11, 2, dst)
        s.send(src, last=True, layerwise=True)
        s.layer_ready(2)
        wait_for(lambda: s.poll() == KVPoll.Failed, timeout=5)
        with pytest.raises(TransferError, match=r"layers \[3, 8\) were never marked"):
            s.failure_exception()
        wait_for(lambda: r.poll() == KVPoll.Failed, timeout=5)
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_layer_ready_without_a_layerwise_chunk_is_refused() -> None:
    with pair(config(), model=MODEL8) as p:
        dst = np.arange(2) + 3
        s, r, src = _start(p, 12, 2, dst)
        with pytest.raises(ConfigError, match="without a layer-wise chunk"):
            s.layer_ready(0)
        s.send(src, last=True)
        wait_for(lambda: r.poll() == KVPoll.Success)
        r.clear()
        s.clear()


def test_mapper_without_pair_major_rows_is_never_cut() -> None:
    """A mapper that does not declare its row order keeps layer-wise chunks whole (they move
    once every layer is computed) instead of guessing which rows belong to which layer."""

    class Opaque(EqualTPMapper):
        pair_major_rows = False

    src, _ = make_pool(MODEL8, RankPosition(), 8)
    dst, _ = make_pool(MODEL8, RankPosition(), 8)
    mapper = Opaque(src, dst)
    s_idx, d_idx = mapper.map_chunk(np.array([1, 2]), np.array([3, 4]))
    assert mapper.split_layers(s_idx, d_idx, group_edges(0, 8, 4)) is None
    assert EqualTPMapper(src, dst).split_layers(s_idx, d_idx, group_edges(0, 8, 4)) is not None


def test_bench_layerwise_runs_every_mode_with_bytes_checked(tmp_path: object) -> None:
    """``kvwire bench-layerwise`` (small): both processes, every mode, decode's bytes equal
    prefill's in every run."""
    from rich.console import Console

    from kvwire.bench.layerwise import BenchArgs, measure

    a = BenchArgs(layers=4, hidden=32, heads=2, head_dim=8, page_size=4, tokens=[64], repeat=1)
    (row,) = measure(a, Console(quiet=True))
    assert row.corrupt == 0 and row.failed == 0
    assert min(row.compute_ms, row.chunk_ms, row.layer_ms) > 0
    assert row.peer_ms is None and row.decode_gpu is None  # CPU: no GPUs, no link to time
    # the same through bulk staging (layer groups staged, scattered on decode)
    (staged,) = measure(a.model_copy(update={"staging": "bulk"}), Console(quiet=True))
    assert staged.corrupt == 0 and staged.failed == 0


def test_bench_layerwise_puts_decode_on_the_second_gpu() -> None:
    """On CUDA the move crosses the link: decode on GPU 1 when two are visible."""
    from kvwire.bench.layerwise import BenchArgs, decode_gpu

    a = BenchArgs(device="cuda")
    assert decode_gpu(a, 2) == 1 and decode_gpu(a, 8) == 1
    assert decode_gpu(a, 1) == 0  # one GPU: both sides on it (the figures say so)
    assert decode_gpu(a.model_copy(update={"decode_gpu": 0}), 2) == 0
    with pytest.raises(ValueError, match="only 2 GPUs"):
        decode_gpu(a.model_copy(update={"decode_gpu": 3}), 2)


@pytest.mark.parametrize("npages, block", [(1, 64), (3, 64), (2, 1000), (5, 4096)])
def test_staged_block_units_go_with_the_last_group_that_writes_them(
    npages: int, block: int
) -> None:
    """Bulk staging, layer-wise: a block unit shared by several layer groups' pairs is
    written once, by the last of them (checked against a byte-by-byte reference)."""
    from kvwire.staging.bulk_ring import block_bytes, unit_owners

    model = ModelSpec(num_layers=5, total_kv_heads=4, head_dim=4, dtype="int32", page_size=2)
    src, _ = make_pool(model, RankPosition(tp_size=2, tp_rank=1), 8)
    dst, _ = make_pool(model, RankPosition(tp_size=1, tp_rank=0), 8)
    mapper = HeadSliceMapper(src, dst)
    edges = group_edges(0, 5, 3)
    owner, pair_group = unit_owners(mapper, npages, block, edges)
    per = block_bytes(mapper, npages) // mapper.num_pairs
    byte_group = np.repeat(pair_group, per)  # the group of every byte of the block
    want = [byte_group[u * block : (u + 1) * block].max() for u in range(owner.size)]
    assert owner.tolist() == want
    assert owner.size * block >= byte_group.size > (owner.size - 1) * block
    layers = src.buffer_keys[mapper.src_buf, 0]
    assert (edges[pair_group] <= layers).all() and (layers < edges[pair_group + 1]).all()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_abort_while_layers_are_computed(side: str) -> None:
    """A request aborted on either side while its layer-wise chunk is half posted: both sides
    fail at once, later marks are ignored (the engine's pass goes on), decode's pages are
    released only once no write is in flight, and every table empties."""
    with pair(config(layerwise_groups=4), model=MODEL8) as p:
        dst = np.arange(4) + 10
        s, r, src = _start(p, 21, 4, dst)
        s.send(src, last=True, layerwise=True)
        s.layer_ready(3)  # groups 0 and 1 posted
        wait_for(lambda: _layer_arrived(p, 3, dst))
        (s if side == "prefill" else r).abort()
        wait_for(lambda: s.poll() == KVPoll.Failed and r.poll() == KVPoll.Failed, timeout=5)
        s.layer_ready(5)  # the engine finishes its pass: ignored, nothing moves
        s.layer_ready(None)
        time.sleep(0.2)
        assert not any(_layer_arrived(p, layer, dst) for layer in range(4, 8))
        wait_for(r.writes_quiesced, timeout=5)
        r.clear()
        s.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))


def test_cleared_before_its_layers_are_marked() -> None:
    """The engine gives up on a request (fails, aborts, clears) while a layer-wise chunk
    waits for its layers: the worker drops the waiting job; the next request is served."""
    with pair(config(), model=MODEL8) as p:
        dst = np.arange(2) + 3
        s, r, src = _start(p, 22, 2, dst)
        s.send(src, last=True, layerwise=True)
        s.abort()
        s.clear()
        wait_for(lambda: r.poll() == KVPoll.Failed, timeout=5)
        r.clear()
        wait_for(lambda: no_rooms(p.prefill) and no_rooms(p.decode))
        p.transfer(23, pages=2, chunks=(2,))  # the worker is free for the next request
