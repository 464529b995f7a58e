"""The core index mappers' tables and chunks through a backend (:class:`MapperConformance`)."""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
from numpy.typing import NDArray

from kvwire.backend import (
    TransferBackend,
    XferOp,
    XferState,
)
from kvwire.descriptors import ADDR, LEN, DescTable, check_table, outside_regions
from kvwire.errors import DescriptorError
from kvwire.index import EqualTPMapper, HeadSliceMapper, IndexMapper, MLAMapper
from kvwire.layout import DTYPE_SIZES, KVLayout, MemoryRegion, ModelSpec, RankPosition
from kvwire.testing.conformance.common import (
    _addr,
    _assert_bytes_equal,
    _backend_class,
    _new_backend,
    wait_terminal,
)
from kvwire.testing.remote import (
    RemoteAgent,
    RemoteBuffer,
    fill_bytes,
)


@dataclass(frozen=True)
class MapperCase:
    """A layout pair for a mapper: model, source (TP size, rank) and destination."""

    id: str
    mapper: type[IndexMapper]
    heads: int
    src_tp: int
    src_rank: int
    dst_tp: int
    dst_rank: int
    is_mla: bool = False
    page_size: int = 2
    #: Also move a chunk through the backend (needs heads >= both TP sizes, or MLA).
    transfer: bool = False


MAPPER_CASES = [
    MapperCase("equal_tp-1to1", EqualTPMapper, 4, 1, 0, 1, 0, transfer=True),
    MapperCase("equal_tp-2to2-r1", EqualTPMapper, 4, 2, 1, 2, 1, page_size=4, transfer=True),
    MapperCase("equal_tp-gqa-4to4-r3", EqualTPMapper, 2, 4, 3, 4, 3),
    MapperCase("mla-1to1", MLAMapper, 1, 1, 0, 1, 0, is_mla=True),
    MapperCase("mla-2to1-r0", MLAMapper, 1, 2, 0, 1, 0, is_mla=True, transfer=True),
    MapperCase("mla-2to1-r1-dummy", MLAMapper, 1, 2, 1, 1, 0, is_mla=True),
    MapperCase("mla-1to2-r1", MLAMapper, 1, 1, 0, 2, 1, is_mla=True),
    MapperCase("head_slice-scatter-1to2-r1", HeadSliceMapper, 4, 1, 0, 2, 1, transfer=True),
    MapperCase("head_slice-scatter-2to4-r3", HeadSliceMapper, 4, 2, 1, 4, 3, transfer=True),
    MapperCase("head_slice-gather-2to1-r1", HeadSliceMapper, 4, 2, 1, 1, 0, transfer=True),
    MapperCase("head_slice-gather-4to2-r2", HeadSliceMapper, 8, 4, 2, 2, 1, page_size=1),
    MapperCase("head_slice-gqa-scatter-1to4-r3", HeadSliceMapper, 2, 1, 0, 4, 3),
    MapperCase("head_slice-gqa-gather-4to2-r1", HeadSliceMapper, 2, 4, 1, 2, 0),
    MapperCase("head_slice-gqa-gather-4to2-r2", HeadSliceMapper, 2, 4, 2, 2, 1),
]
TRANSFER_CASES = [c for c in MAPPER_CASES if c.transfer]
NUM_LAYERS, HEAD_DIM, DTYPE, NUM_SLOTS = 2, 8, "bfloat16", 16


def _model(case: MapperCase) -> ModelSpec:
    return ModelSpec(
        num_layers=NUM_LAYERS,
        total_kv_heads=case.heads,
        head_dim=HEAD_DIM,
        dtype=DTYPE,
        page_size=case.page_size,
        is_mla=case.is_mla,
    )


def _item_len(case: MapperCase, tp: int) -> int:
    heads = 1 if case.is_mla else max(1, case.heads // tp)
    return case.page_size * heads * HEAD_DIM * DTYPE_SIZES[DTYPE]


def _num_buffers(case: MapperCase) -> int:
    return NUM_LAYERS if case.is_mla else 2 * NUM_LAYERS


def _layout(case: MapperCase, side: str, bases: list[int]) -> KVLayout:
    tp, rank = (case.src_tp, case.src_rank) if side == "src" else (case.dst_tp, case.dst_rank)
    item = _item_len(case, tp)
    buffers = tuple(MemoryRegion.from_pointer(a, NUM_SLOTS * item, item) for a in bases)
    return KVLayout(
        model=_model(case), rank=RankPosition(tp_size=tp, tp_rank=rank), buffers=buffers
    )


def _fake_layout(case: MapperCase, side: str) -> KVLayout:
    tp = case.src_tp if side == "src" else case.dst_tp
    stride = NUM_SLOTS * _item_len(case, tp) + 4096
    first = 0x10_0000_0000 if side == "src" else 0x20_0000_0000
    return _layout(case, side, [first + i * stride for i in range(_num_buffers(case))])


def _slot_of(
    table: DescTable, rows: NDArray[np.int64], layout: KVLayout
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(buffer index, page slot) of each row."""
    addr = table[rows, ADDR]
    buf = np.searchsorted(layout.bases, addr, side="right").astype(np.int64) - 1
    item = np.uint64(layout.buffers[0].item_len)
    slot = ((addr - layout.bases[buf]) // item).astype(np.int64)
    return buf, slot


class MapperConformance:
    """Core mappers' tables and chunks: properties, then real transfers through the backend."""

    backend_name: ClassVar[str] = ""
    backend_options: ClassVar[dict[str, Any]] = {}
    transfer_timeout_s: ClassVar[float] = 60.0

    @pytest.mark.parametrize("case", MAPPER_CASES, ids=lambda c: c.id)
    def test_tables_and_chunks(self, case: MapperCase) -> None:
        src, dst = _fake_layout(case, "src"), _fake_layout(case, "dst")
        mapper = case.mapper(src, dst)
        tables = mapper.build_tables()
        for table, layout, what in ((tables.src, src, "source"), (tables.dst, dst, "destination")):
            assert isinstance(table, np.ndarray), f"{what} table is a {type(table).__name__}"
            assert table.dtype == np.uint64 and table.ndim == 2 and table.shape[1] == 3, (
                f"{what} table has dtype {table.dtype} and shape {table.shape}; want (N, 3) uint64"
            )
            check_table(table, f"{what} table")
            assert not outside_regions(table, layout.buffers).any(), (
                f"{what} table rows lie outside the layout's buffers"
            )
        src_row, dst_row = src.token_row_bytes, dst.token_row_bytes
        rng = np.random.default_rng(zlib.crc32(case.id.encode()))
        for k in (1, 3, NUM_SLOTS):
            sp = rng.choice(NUM_SLOTS, k, replace=False)
            dp = rng.choice(NUM_SLOTS, k, replace=False)
            si, di = mapper.map_chunk(sp, dp)
            for idx, what in ((si, "source"), (di, "destination")):
                assert isinstance(idx, np.ndarray) and idx.dtype == np.int64 and idx.ndim == 1, (
                    f"{what} index array must be 1-D int64"
                )
            assert si.shape == di.shape, "index arrays differ in length"
            if mapper.is_dummy:
                assert si.size == 0, "a dummy sender must move nothing"
                continue
            assert si.size > 0
            assert si.min() >= 0 and si.max() < tables.src.shape[0], "source index out of range"
            assert di.min() >= 0 and di.max() < tables.dst.shape[0], (
                "destination index out of range"
            )
            lens_s, lens_d = tables.src[si, LEN], tables.dst[di, LEN]
            assert np.array_equal(lens_s, lens_d), "paired rows differ in length"
            d_addr = tables.dst[di, ADDR]
            order = np.argsort(d_addr, kind="stable")
            ends = d_addr[order] + lens_d[order]
            assert (ends[:-1] <= d_addr[order][1:]).all(), "destination rows of a chunk overlap"
            expected = mapper.num_pairs * k * case.page_size * min(src_row, dst_row)
            assert int(lens_d.sum()) == expected, (
                f"chunk moves {int(lens_d.sum())} B, want {expected}"
            )
            s_buf, s_slot = _slot_of(tables.src, si, src)
            d_buf, d_slot = _slot_of(tables.dst, di, dst)
            pos_s = np.searchsorted(np.sort(sp), s_slot)
            pos_d = np.searchsorted(np.sort(dp), d_slot)
            assert np.isin(s_slot, sp).all(), "a source row lies outside the chunk's pages"
            assert np.isin(d_slot, dp).all(), "a destination row lies outside the chunk's pages"
            chunk_of_s = np.argsort(sp)[pos_s]
            chunk_of_d = np.argsort(dp)[pos_d]
            assert np.array_equal(chunk_of_s, chunk_of_d), (
                "rows do not pair src_pages[i] with dst_pages[i]"
            )
            assert np.array_equal(src.buffer_keys[s_buf], dst.buffer_keys[d_buf]), (
                "paired rows belong to different layers or K/V"
            )
        sp = rng.choice(NUM_SLOTS, 3, replace=False)
        with pytest.raises(DescriptorError):
            mapper.map_chunk(sp, sp[:2])
        with pytest.raises(DescriptorError):
            mapper.map_chunk([NUM_SLOTS], [0])
        with pytest.raises(DescriptorError):
            mapper.map_chunk([0], [-1])

    @pytest.fixture(scope="class")
    @classmethod
    def mapper_env(cls) -> Iterator[dict[str, Any]]:
        cfg = cls
        name, options = cfg.backend_name, dict(cfg.backend_options)
        if not name:
            pytest.fail(f"{cfg.__name__} must set backend_name")
        backend_cls = _backend_class(name, options)
        if not (backend_cls.capabilities.dram and backend_cls.capabilities.write):
            pytest.skip(f"{name} does not declare WRITE and DRAM capability")
        remote = RemoteAgent(name, options, f"conf-mapper-target-{uuid.uuid4().hex[:8]}").start()
        local: TransferBackend | None = None
        try:
            local = _new_backend(name, options, "mapper-local")
            src_arrays: dict[str, list[NDArray[np.uint8]]] = {}
            dst_bufs: dict[str, list[RemoteBuffer]] = {}
            for ci, case in enumerate(TRANSFER_CASES):
                n_src = NUM_SLOTS * _item_len(case, case.src_tp)
                n_dst = NUM_SLOTS * _item_len(case, case.dst_tp)
                src_arrays[case.id] = [
                    fill_bytes(n_src, 1000 * ci + i) for i in range(_num_buffers(case))
                ]
                dst_bufs[case.id] = [
                    remote.allocate(f"{case.id}/{i}", n_dst, fill=2000 * ci + i, watch=False)
                    for i in range(_num_buffers(case))
                ]
            local.register(
                [MemoryRegion.from_tensor(a) for arrs in src_arrays.values() for a in arrs]
            )
            peer = local.add_peer(remote.metadata())
            yield {
                "local": local,
                "remote": remote,
                "peer": peer,
                "src": src_arrays,
                "dst": dst_bufs,
            }
        finally:
            if local is not None:
                local.close()
            remote.close()

    @pytest.mark.parametrize("case", TRANSFER_CASES, ids=lambda c: c.id)
    def test_chunk_transfer(self, mapper_env: dict[str, Any], case: MapperCase) -> None:
        local: TransferBackend = mapper_env["local"]
        remote: RemoteAgent = mapper_env["remote"]
        arrays: list[NDArray[np.uint8]] = mapper_env["src"][case.id]
        bufs: list[RemoteBuffer] = mapper_env["dst"][case.id]
        src = _layout(case, "src", [_addr(a) for a in arrays])
        dst = _layout(case, "dst", [b.addr for b in bufs])
        mapper = case.mapper(src, dst)
        assert not mapper.is_dummy
        tables = mapper.build_tables()
        rng = np.random.default_rng(zlib.crc32(case.id.encode()))
        k = 5
        sp = rng.choice(NUM_SLOTS, k, replace=False)
        dp = rng.choice(NUM_SLOTS, k, replace=False)
        before = [remote.read_array(b.name) for b in bufs]
        # The model: head ranges each side holds, independent of the mapper's tables.
        ps, hb = case.page_size, HEAD_DIM * DTYPE_SIZES[DTYPE]
        if case.is_mla:
            sh = dh = 1
            s_lo = d_lo = 0
        else:
            sh, dh = case.heads // case.src_tp, case.heads // case.dst_tp
            s_lo, d_lo = case.src_rank * sh, case.dst_rank * dh
        lo, hi = max(s_lo, d_lo), min(s_lo + sh, d_lo + dh)
        assert lo < hi, "case has no heads in common"
        expected = []
        for arr, old in zip(arrays, before, strict=True):
            s4 = arr.reshape(NUM_SLOTS, ps, sh, hb)
            d4 = old.copy().reshape(NUM_SLOTS, ps, dh, hb)
            d4[dp, :, lo - d_lo : hi - d_lo] = s4[sp, :, lo - s_lo : hi - s_lo]
            expected.append(d4.reshape(-1))
        si, di = mapper.map_chunk(sp, dp)
        pair = local.prepare(mapper_env["peer"], tables.src, tables.dst)
        try:
            handle = local.submit(XferOp.WRITE, pair, si, di)
            state = wait_terminal(local, handle, type(self).transfer_timeout_s)
            assert state is XferState.DONE, f"mapped chunk WRITE ended {state.name}: {handle.error}"
            local.release(handle)
        finally:
            local.release_prepared(pair)
        for b, want in zip(bufs, expected, strict=True):
            _assert_bytes_equal(remote.read_array(b.name), want, f"{case.id}: buffer {b.name}")
