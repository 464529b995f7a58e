"""Buffer groups with sections (a gated-delta-net conv state: q, k and v channel blocks, each
split across TP on its own): validation, wire and hash, and the group mapper's row arithmetic
checked element by element against a plain reference, for random sections and TP pairs with
replication both ways."""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from kvwire.buffer_groups import GROUP_COMPAT_FIELDS, BufferGroup, GroupSection
from kvwire.control.wire import Codec, Hello
from kvwire.index.groups import GroupMapper
from kvwire.index.topology import Topology
from kvwire.layout import (
    KVLayout,
    MemoryRegion,
    ModelSpec,
    RankPosition,
)
from kvwire.session.handshake import handshake_problems

MODEL = ModelSpec(num_layers=1, total_kv_heads=8, head_dim=2, dtype="int32", page_size=2)
SLOTS = 4
NP_DTYPE: dict[str, type[np.integer[Any]]] = {
    "int32": np.int32,
    "float16": np.int16,
    "uint8": np.uint8,
}


def owned(total: int, tp: int, rank: int) -> list[int]:
    """Global heads a rank holds (replicated when total < tp): the reference, written plainly."""
    local = max(1, total // tp)
    group = rank // max(1, tp // total)
    return list(range(group * local, group * local + local))


def section_sizes(secs: list[tuple[int, int]], tp: int) -> int:
    return sum(len(owned(h, tp, 0)) * e for h, e in secs)


def make(
    secs: list[tuple[int, int]], tp: int, rank: int, *, kind: str = "state", rows: int = 1,
    dtype: str = "int32", per_layer: int = 1,
) -> tuple[KVLayout, list[NDArray[Any]]]:  # fmt: skip
    """A rank's layout with one sectioned group and the group's zeroed arrays."""
    row = section_sizes(secs, tp)
    arrs = [np.zeros((SLOTS, rows * row), NP_DTYPE[dtype]) for _ in range(per_layer)]
    extra: dict[str, Any] = {"window": 4, "per_layer": 2} if kind == "window" else {}
    g = BufferGroup(
        name="conv", kind=kind, num_layers=1, dtype=dtype, page_size=rows,  # type: ignore[arg-type]
        sections=tuple(GroupSection(total_heads=h, head_elems=e) for h, e in secs),
        buffers=tuple(MemoryRegion.from_tensor(a) for a in arrs), **extra,
    )  # fmt: skip
    heads = max(1, MODEL.total_kv_heads // tp)
    kv = [np.zeros((SLOTS, MODEL.page_size, heads, MODEL.head_dim), np.int32) for _ in range(2)]
    lay = KVLayout.from_tensors(
        MODEL, kv, RankPosition(tp_size=tp, tp_rank=rank), groups=[g], group_tensors=arrs
    )
    return lay, arrs


def value(buf: int, slot: int, row: int, sec: int, head: int, elem: int, mod: int) -> int:
    """Code of one logical element (never 0, so an unwritten element shows)."""
    return (buf * 7 + slot * 31 + row * 131 + sec * 1009 + head * 4001 + elem * 3 + 1) % mod or 1


def reference(
    secs: list[tuple[int, int]], tp: int, rank: int, rows: int, nbuf: int, slots: list[int],
    dtype: str,
) -> list[NDArray[Any]]:  # fmt: skip
    """What a rank's arrays hold when logical slot ``i`` sits in physical slot ``slots[i]``:
    element by element, row outermost, then each section's local heads (plain loops)."""
    mod = int(np.iinfo(NP_DTYPE[dtype]).max)
    row_len = section_sizes(secs, tp)
    out = [np.zeros((SLOTS, rows * row_len), NP_DTYPE[dtype]) for _ in range(nbuf)]
    for b in range(nbuf):
        for i, phys in enumerate(slots):
            at = 0
            for t in range(rows):
                for s, (h, e) in enumerate(secs):
                    for head in owned(h, tp, rank):
                        for x in range(e):
                            out[b][phys, at] = value(b, i, t, s, head, x, mod)
                            at += 1
    return out


def move(src: list[tuple[KVLayout, Any]], dst: list[tuple[KVLayout, Any]], name: str,
         ss: list[int], ds: list[int]) -> list[int]:  # fmt: skip
    """Run every (source, destination) group transfer with memmove; bytes written per
    destination rank."""
    tp_s, tp_d = src[0][0].rank.tp_size, dst[0][0].rank.tp_size
    written = []
    for d, (dlay, _) in enumerate(dst):
        n = 0
        for s, _ in Topology(tp_s, 1, tp_d).sources(d):
            gm = GroupMapper(src[s][0], dlay)
            tables = gm.build_tables()
            si, di = gm.map_request({name: np.array(ss)}, {name: np.array(ds)})
            assert np.array_equal(tables.src[si, 1], tables.dst[di, 1])
            for a, b, ln in zip(si.tolist(), di.tolist(), tables.src[si, 1].tolist(), strict=True):
                ctypes.memmove(int(tables.dst[b, 0]), int(tables.src[a, 0]), ln)
                n += ln
        written.append(n)
    return written


TPS = [1, 2, 4, 8]
SECTIONS = st.lists(
    st.tuples(st.sampled_from([1, 2, 4, 8]), st.integers(1, 4)), min_size=2, max_size=3
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    secs=SECTIONS,
    tp_s=st.sampled_from(TPS),
    tp_d=st.sampled_from(TPS),
    rows=st.integers(1, 3),
    kind=st.sampled_from(["state", "window"]),
    dtype=st.sampled_from(["int32", "float16", "uint8"]),
)
def test_sections_move_every_element_once(
    secs: list[tuple[int, int]], tp_s: int, tp_d: int, rows: int, kind: str, dtype: str
) -> None:
    nbuf = 2 if kind == "window" else 1
    ss, ds = ([2], [1]) if kind == "state" else ([3, 0], [1, 2])
    src = [make(secs, tp_s, r, kind=kind, rows=rows, dtype=dtype, per_layer=nbuf)
           for r in range(tp_s)]  # fmt: skip
    dst = [make(secs, tp_d, r, kind=kind, rows=rows, dtype=dtype, per_layer=nbuf)
           for r in range(tp_d)]  # fmt: skip
    for r, (_, arrs) in enumerate(src):
        for a, fill in zip(arrs, reference(secs, tp_s, r, rows, nbuf, ss, dtype), strict=True):
            a[...] = fill
    written = move(src, dst, kind, ss, ds)
    for r, (_, arrs) in enumerate(dst):
        want = reference(secs, tp_d, r, rows, nbuf, ds, dtype)
        for got, exp in zip(arrs, want, strict=True):
            np.testing.assert_array_equal(got, exp)  # every element where it belongs
        moved = sum(a[ds].nbytes for a in arrs)
        assert written[r] == moved  # ... written once: replicated heads are not sent twice


def test_qwen3_next_like_conv_state_tp2_to_1_and_1_to_2() -> None:
    """A concrete case (2 k heads, 4 v heads, conv kernel 4, channel-major): each prefill rank
    of TP 2 writes 3 runs per slot (its q, k and v heads) into the decode row of TP 1."""
    k1 = 3
    secs = [(2, 2 * k1), (2, 2 * k1), (4, 3 * k1)]
    src = [make(secs, 2, r) for r in range(2)]
    dst = [make(secs, 1, 0)]
    for r, (_, arrs) in enumerate(src):
        arrs[0][...] = reference(secs, 2, r, 1, 1, [2], "int32")[0]
    assert move(src, dst, "state", [2], [1]) == [(2 * 6 + 2 * 6 + 4 * 9) * 4]
    np.testing.assert_array_equal(dst[0][1][0], reference(secs, 1, 0, 1, 1, [1], "int32")[0])
    gm = GroupMapper(src[1][0], dst[0][0])
    si, di = gm.map_request({"state": np.array([2])}, {"state": np.array([1])})
    assert si.size == 3  # one run per section
    offsets = gm.build_tables().dst[di, 0] - dst[0][0].groups[0].bases[0]
    # rank 1's q head 1, k head 1, v heads 2-3 in the decode slot 1 (60 elements of 4 B)
    assert (offsets - 60 * 4).tolist() == [6 * 4, (12 + 6) * 4, (24 + 18) * 4]


# ------------------------------------------------------------------------------ validation
def test_sections_fill_total_heads_and_head_elems_and_size_the_slot() -> None:
    lay, _ = make([(2, 4), (4, 3)], 2, 0)
    g = lay.groups[0]
    assert (g.total_heads, g.head_elems) == (1, 2 * 4 + 4 * 3)  # the unsharded row, one head
    assert g.section_heads(2) == (1, 2) and g.row_elems(2) == 4 + 6
    assert g.item_len(2) == 10 * 4 and g.item_len(8) == (4 + 3) * 4  # replicated at TP 8


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"sections": ((2, 3),)}, "one section is a plain head-sharded group"),
        ({"sharding": "replicated"}, "sections are sharded by heads"),
        ({"total_heads": 2}, "leave total_heads and head_elems out"),
        ({"head_elems": 5}, "filled as 1 and 14"),
        ({"sections": ()}, "head_elems is required"),
    ],
)
def test_bad_sections_are_refused(kw: dict[str, Any], match: str) -> None:
    fields: dict[str, Any] = {
        "name": "conv", "kind": "state", "num_layers": 1, "dtype": "int32",
        "sections": ((2, 4), (2, 3)), "buffers": (MemoryRegion(addr=64, length=64, item_len=16),),
        **kw,
    }  # fmt: skip
    fields["sections"] = tuple(GroupSection(total_heads=h, head_elems=e)
                               for h, e in fields["sections"])  # fmt: skip
    with pytest.raises(ValueError, match=match):
        BufferGroup(**fields)


def test_section_heads_must_divide_tp_and_item_len_names_the_sections() -> None:
    with pytest.raises(ValueError, match="a section's total_heads=3 and tp_size=2"):
        make([(2, 1), (3, 1)], 2, 0)
    lay, arrs = make([(2, 4), (4, 3)], 1, 0)  # sized for TP 1 ...
    kv = [np.zeros((SLOTS, 2, 4, 2), np.int32) for _ in range(2)]  # KV of a TP 2 rank
    with pytest.raises(ValueError, match=r"item_len 80 != page_size 1 x \(1x4 \+ 2x3\)"):
        KVLayout.from_tensors(  # ... registered on a rank of TP 2
            MODEL, kv, RankPosition(tp_size=2), groups=list(lay.groups), group_tensors=arrs
        )


# ------------------------------------------------------------------------- wire and hash
def test_group_without_sections_serialises_and_hashes_as_before() -> None:
    g = BufferGroup(name="s", kind="state", num_layers=1, total_heads=2, head_elems=3,
                    buffers=(MemoryRegion(addr=64, length=48, item_len=12),))  # fmt: skip
    assert "sections" not in g.model_dump()
    old_fields = [f for f in GROUP_COMPAT_FIELDS if f != "sections"]
    assert g.compat_text() == "s:" + ",".join(f"{f}={getattr(g, f)}" for f in old_fields)
    text = "s:kind=state,index=state,num_layers=1,per_layer=1,total_heads=2,sharding=heads,"
    assert g.compat_text() == text + "head_elems=3,dtype=bfloat16,page_size=1,window=None"
    assert hashlib.sha256(g.compat_text().encode()).hexdigest()  # plain text, no model repr


def test_sections_travel_in_hello_and_change_the_hash() -> None:
    lay, _ = make([(2, 4), (4, 3)], 2, 1, rows=2)
    codec = Codec()
    lh = lay.compatibility_hash()
    hello = Hello(session="s", agent="a", endpoint="e", rank=lay.rank, layout=lay,
                  layout_hash=lh, backend="tcp", backend_metadata=b"")  # fmt: skip
    back = codec.decode(codec.encode(hello))
    assert isinstance(back, Hello) and back.layout.groups == lay.groups
    assert back.layout.compatibility_hash() == lay.compatibility_hash()
    # the same bytes per slot described as one run of heads: accepted, but never confused
    arrs = [np.zeros((SLOTS, 2 * (4 + 6)), np.int32)]
    block = BufferGroup(name="conv", kind="state", num_layers=1, dtype="int32", page_size=2,
                        total_heads=2, head_elems=10,
                        buffers=(MemoryRegion.from_tensor(arrs[0]),))  # fmt: skip
    kv = [np.zeros((SLOTS, 2, 4, 2), np.int32) for _ in range(2)]
    plain = KVLayout.from_tensors(MODEL, kv, lay.rank, groups=[block], group_tensors=arrs)
    assert plain.compatibility_hash() != lay.compatibility_hash()
    problems = handshake_problems(lay, plain, "tcp", "tcp")
    assert "group 'conv' sections: prefill=(2x4, 4x3) decode=()" in problems
