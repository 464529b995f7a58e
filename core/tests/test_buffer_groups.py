"""Buffer groups (hybrid and speculative models): layout validation and hashing, handshake
problems that name the field, state_indices checks, and the group mapper moving bytes between
simulated prefill and decode ranks for every TP pair (heads sliced, gathered, replicated)."""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from kvwire.control.wire import Codec, Hello, TransferRequest
from kvwire.errors import ConfigError, DescriptorError, LayoutError
from kvwire.index.equal_tp import EqualTPMapper
from kvwire.index.groups import GroupMapper
from kvwire.index.topology import Topology
from kvwire.layout import (
    COMPAT_FIELDS,
    BufferGroup,
    KVLayout,
    MemoryRegion,
    ModelSpec,
    RankPosition,
)
from kvwire.session.groups import check_state_indices, from_wire, to_wire
from kvwire.session.handshake import handshake_problems

MODEL = ModelSpec(num_layers=1, total_kv_heads=4, head_dim=2, dtype="int32", page_size=2)
SLOTS = 4
KEEP: list[Any] = []  # arrays behind the layouts of this module (kept alive)


def kv_arrays(tp: int) -> list[NDArray[np.int32]]:
    heads = max(1, MODEL.total_kv_heads // tp)
    return [np.zeros((SLOTS, MODEL.page_size, heads, MODEL.head_dim), np.int32) for _ in range(2)]


def group(tp: int, **kw: Any) -> tuple[BufferGroup, list[NDArray[np.int32]]]:
    """A group of int32 elements with its zeroed arrays for a rank of a TP group of ``tp``."""
    fields: dict[str, Any] = {"name": "g", "kind": "state", "num_layers": 1, "head_elems": 3,
                              "dtype": "int32", **kw}  # fmt: skip
    per_layer = fields.get("per_layer", 1)
    heads = (
        fields.get("total_heads", 1)
        if fields.get("sharding") == "replicated"
        else max(1, fields.get("total_heads", 1) // tp)
    )
    rows = fields.get("page_size", 1)
    arrs = [
        np.zeros((SLOTS, rows, heads, fields["head_elems"]), np.int32)
        for _ in range(fields["num_layers"] * per_layer)
    ]
    return BufferGroup(**fields, buffers=tuple(MemoryRegion.from_tensor(a) for a in arrs)), arrs


def layout(tp: int, rank: int, **kw: Any) -> tuple[KVLayout, list[NDArray[np.int32]]]:
    g, arrs = group(tp, **kw)
    kv = kv_arrays(tp)
    lay = KVLayout.from_tensors(
        MODEL, kv, RankPosition(tp_size=tp, tp_rank=rank), groups=[g], group_tensors=arrs
    )
    return lay, arrs


# ------------------------------------------------------------------------------ layout
def test_layout_without_groups_hashes_and_serialises_as_before() -> None:
    lay = KVLayout.from_tensors(MODEL, kv_arrays(1))
    text = "|".join(f"{f}={getattr(MODEL, f)}" for f in COMPAT_FIELDS)
    assert lay.compatibility_hash() == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert "groups" not in lay.model_dump()
    with_groups, _ = layout(1, 0, total_heads=2)
    assert with_groups.compatibility_hash() != lay.compatibility_hash()
    assert KVLayout.model_validate(with_groups.model_dump()).groups == with_groups.groups


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"kind": "window", "page_size": 2, "per_layer": 2}, "window= is required"),
        ({"kind": "paged", "index": "state", "page_size": 2}, "addressed by the KV page"),
        ({"kind": "paged", "page_size": 4}, "must equal the model's"),
        ({"total_heads": 3}, "one must divide the other"),
    ],
)
def test_bad_groups_are_refused_naming_the_problem(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):  # pydantic wraps the LayoutError
        layout(2, 0, **kw)


def test_group_item_len_mismatch_names_heads_and_sizes() -> None:
    g, arrs = group(1, total_heads=2)  # sized for TP 1 (2 heads) ...
    with pytest.raises(ValueError, match=r"buffer group 'g' buffer 0: item_len 24 != .*1 heads"):
        KVLayout.from_tensors(  # ... registered on a rank of TP 2 (1 head)
            MODEL, kv_arrays(2), RankPosition(tp_size=2), groups=[g], group_tensors=arrs
        )


def test_handshake_names_every_mismatching_group_field() -> None:
    pre, _ = layout(1, 0, total_heads=2, head_elems=3)
    dec, _ = layout(1, 0, total_heads=2, head_elems=5)
    problems = handshake_problems(pre, dec, "tcp", "tcp")
    assert problems == ["group 'g' head_elems: prefill=3 decode=5"]
    plain = KVLayout.from_tensors(MODEL, kv_arrays(1))
    assert handshake_problems(pre, plain, "tcp", "tcp") == [
        "group 'g': prefill=present decode=absent (both sides must register the same groups)"
    ]
    with pytest.raises(LayoutError, match="head_elems: source=3 destination=5"):
        GroupMapper(pre, dec)


def test_groups_travel_in_hello_and_requests() -> None:
    lay, _ = layout(2, 1, kind="window", window=4, page_size=2, per_layer=2, total_heads=2)
    codec = Codec()
    lh = lay.compatibility_hash()
    hello = Hello(session="s", agent="a", endpoint="e", rank=lay.rank, layout=lay,
                  layout_hash=lh, backend="tcp", backend_metadata=b"")  # fmt: skip
    back = codec.decode(codec.encode(hello))
    assert isinstance(back, Hello) and back.layout.groups == lay.groups
    idx = {"window": np.array([3, 0])}
    req = TransferRequest(room=1, session="s", dst_pages=b"", group_indices=to_wire(idx))
    got = codec.decode(codec.encode(req))
    assert isinstance(got, TransferRequest)
    assert check_state_indices(lay, from_wire(got.group_indices), "decode")["window"].tolist() == [
        3,
        0,
    ]


# ---------------------------------------------------------------------- state_indices
def test_state_indices_are_checked_like_pages() -> None:
    lay, _ = layout(1, 0, total_heads=2)
    assert check_state_indices(lay, 2, "x")["state"].tolist() == [2]  # bare: one index set
    assert check_state_indices(lay, {"state": [3]}, "x")["state"].tolist() == [3]
    with pytest.raises(ConfigError, match=r"pass state_indices=\{'state': ...\}"):
        check_state_indices(lay, None, "send_metadata()")
    with pytest.raises(ConfigError, match=r"unknown \['swa'\], missing \['state'\]"):
        check_state_indices(lay, {"swa": [1]}, "x")
    with pytest.raises(DescriptorError, match="one slot per request"):
        check_state_indices(lay, [1, 2], "x")
    with pytest.raises(DescriptorError, match=r"state_indices\['state'\]"):
        check_state_indices(lay, [SLOTS], "x")
    with pytest.raises(DescriptorError):
        check_state_indices(lay, [-1], "x")
    win, _ = layout(1, 0, kind="window", window=4, page_size=2, per_layer=2, total_heads=2)
    with pytest.raises(DescriptorError, match="repeats a slot"):
        check_state_indices(win, [1, 1], "x")


# ---------------------------------------------------------------------- byte moves
def code(layer: Any, part: Any, head: Any, slot: Any, row: Any, elem: Any) -> Any:
    """Element value of a logical (layer, part, global head, request slot, row, elem)."""
    return (layer * 7 + part * 3 + head * 101 + slot * 1009 + row * 10007 + elem * 17 + 1) % (
        1 << 30
    )


def heads_of(g: BufferGroup, tp: int, rank: int) -> NDArray[np.int64]:
    if g.sharding == "replicated":
        return np.arange(g.total_heads)
    local = max(1, g.total_heads // tp)
    first = (rank // max(1, tp // g.total_heads)) * local
    return np.arange(first, first + local)


def fill(g: BufferGroup, arrs: list[NDArray[np.int32]], tp: int, rank: int, slots: Any) -> None:
    """Write logical slot i's values into physical slot ``slots[i]``."""
    keys = g.buffer_keys
    h = heads_of(g, tp, rank)
    for b, arr in enumerate(arrs):
        layer, part = keys[b]
        for i, s in enumerate(slots):
            rows = np.arange(g.page_size)[:, None, None]
            elems = np.arange(g.head_elems)[None, None, :]
            arr[s] = code(layer, part, h[None, :, None], i, rows, elems)


GROUPS = {
    "state-heads4": {"total_heads": 4},
    "state-heads2": {"total_heads": 2},  # replicated heads at TP 4
    "state-replicated": {"total_heads": 2, "sharding": "replicated"},
    "window": {
        "kind": "window",
        "window": 4,
        "page_size": 2,
        "per_layer": 2,
        "num_layers": 2,
        "total_heads": 2,
    },
    # a sparse-attention indexer K cache (DeepSeek V3.2 style): paged like the KV, its own item
    # size (128 bytes of keys + a 4-byte scale per token: 33 int32), the same on every rank
    "indexer": {
        "kind": "paged",
        "page_size": 2,
        "total_heads": 1,
        "sharding": "replicated",
        "head_elems": 33,
    },
}
TP_PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]


@pytest.mark.parametrize("kw", GROUPS.values(), ids=GROUPS.keys())
@pytest.mark.parametrize(("tp_s", "tp_d"), TP_PAIRS, ids=[f"{a}to{b}" for a, b in TP_PAIRS])
def test_group_mapper_moves_every_byte_once(kw: dict[str, Any], tp_s: int, tp_d: int) -> None:
    kind = kw.get("kind", "state")
    src_slots, dst_slots = ([3, 1], [0, 2]) if kind != "state" else ([2], [1])
    name = {"window": "window", "paged": "pages"}.get(kind, "state")
    src = [layout(tp_s, r, **kw) for r in range(tp_s)]
    dst = [layout(tp_d, r, **kw) for r in range(tp_d)]
    g = src[0][0].groups[0]
    for r, (_, arrs) in enumerate(src):
        fill(g, arrs, tp_s, r, src_slots)
    topo = Topology(tp_s, 1, tp_d)
    for d, (dlay, darrs) in enumerate(dst):
        written = senders = 0
        for s, _ in topo.sources(d):
            gm = GroupMapper(src[s][0], dlay)
            senders += gm.sends
            tables = gm.build_tables()
            si, di = gm.map_request({name: np.array(src_slots)}, {name: np.array(dst_slots)})
            for a, b in zip(si.tolist(), di.tolist(), strict=True):
                n = int(tables.src[a, 1])
                assert n == int(tables.dst[b, 1])
                ctypes.memmove(int(tables.dst[b, 0]), int(tables.src[a, 0]), n)
                written += n
        expect = [np.zeros_like(a) for a in darrs]
        fill(g, expect, tp_d, d, dst_slots)
        for got, want in zip(darrs, expect, strict=True):
            np.testing.assert_array_equal(got, want)  # every byte where it belongs
        moved = sum(a[dst_slots].nbytes for a in darrs)
        assert written == moved  # ... and written once: replicated bytes are not sent twice
        if kw.get("sharding") == "replicated" and tp_s > tp_d:
            assert senders == 1


def test_index_mapper_seam_builds_the_group_mapper() -> None:
    a, _ = layout(2, 1, total_heads=4)
    b, _ = layout(2, 1, total_heads=4)
    gm = EqualTPMapper(a, b).group_mapper()
    assert isinstance(gm, GroupMapper) and gm.sends and gm.index_names == {"state"}
    plain = KVLayout.from_tensors(MODEL, kv_arrays(1))
    assert EqualTPMapper(plain, plain).group_mapper() is None
    with pytest.raises(DescriptorError, match="prefill gave 2 'state' indices, decode 1"):
        gm.map_request({"state": np.array([0, 1])}, {"state": np.array([0])})
