"""Checksums of buffer groups (protocol 1.14): a hybrid model's state, conv sections, window
and draft pages are summed by prefill and checked by decode like KV chunks. Proof by
computation (the tiny hybrid model of ``test_hybrid_model.py``): checked requests decode the
single process's tokens; one byte flipped in a landed group row fails the request naming the
group; with the comparison off the same flip changes the tokens (the negative control)."""

from __future__ import annotations

import logging
import textwrap
from typing import Any

import numpy as np
import pytest

from kvwire.errors import KVWireError
from kvwire.integrity import RowHasher
from kvwire.session.decode import group_check
from kvwire.session.decode.group_check import GroupCheck
from kvwire.session.decode.rooms import RecvRoom
from kvwire.session.group_sums import (
    GroupBuffers,
    LandedGroupSums,
    SentGroupSums,
    describe_keys,
)
from kvwire.testing.faults import landed_group_flipper
from kvwire.testing.hybrid import RankPools, config, run_pd
from kvwire.testing.hybrid_model import HybridSpec, reference_tokens
from kvwire.testing.interpreted import run_interpreted

SPEC = HybridSpec()
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, SPEC.vocab, 14)]
N_GEN = 6
CHECKED = config(checksum=True)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return reference_tokens(SPEC, PROMPT, N_GEN)


def spy_checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, dict[int, int]]]:
    """Every group check decode runs: (sender, the sums its note carried)."""
    seen: list[tuple[int, dict[int, int]]] = []
    original = GroupCheck.run

    def run(check: GroupCheck, later: Any = None) -> Any:
        seen.append((check.msg.sender_id, dict(check.sent)))
        return original(check, later)

    monkeypatch.setattr(GroupCheck, "run", run)
    return seen


def flip_first_landed_row(
    monkeypatch: pytest.MonkeyPatch, key: int | None = None, whole_row: bool = False
) -> list[int]:
    """Decode's group check first damages the first landed row (of dense key ``key``)
    (:func:`kvwire.testing.faults.landed_group_flipper`); returns the damaged rows' keys."""
    keys: list[int] = []
    monkeypatch.setattr(
        LandedGroupSums, "sums", landed_group_flipper(key=key, whole_row=whole_row, seen=keys)
    )
    return keys


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_checked_groups_decode_the_same_tokens(
    reference: list[int],
    tp_p: int,
    tp_d: int,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen = spy_checks(monkeypatch)
    with caplog.at_level(logging.INFO, logger="kvwire.session.decode.links"):
        out = run_pd(SPEC, PROMPT, N_GEN, tp_p, tp_d, cfg=CHECKED)
    links = [r.getMessage() for r in caplog.records if "link from" in r.getMessage()]
    assert len(links) == tp_p * tp_d
    assert all("checksums of its KV and buffer groups" in m for m in links), links
    assert out.tokens == reference
    assert seen, "decode checked no group transfer"
    assert len(seen) == tp_p * tp_d  # every (prefill rank, decode rank) pair moves groups
    for _, sums in seen:
        assert sums, "a state note without sums"
    layout = RankPools.build(SPEC, 1, 0, 16, 16, 4).layout
    names = {g.name for g in layout.groups}
    covered = {
        part.split("'")[1]
        for _, sums in seen
        for part in describe_keys(layout, list(sums)).split("; ")
    }
    assert covered == names, "every group's rows are summed"


def failures(cause: str) -> float:
    """Decode's ``kvwire_receive_failures_total{cause}``, summed over every rank here."""
    from prometheus_client import REGISTRY

    return sum(
        sample.value
        for family in REGISTRY.collect()
        if family.name == "kvwire_receive_failures"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("cause") == cause
    )


def first_key(group: str) -> int:
    """The dense key of ``group``'s first layer (the hybrid model's layout)."""
    layout = RankPools.build(SPEC, 1, 0, 16, 16, 4).layout
    g = next(g for g in layout.groups if g.name == group)
    return GroupBuffers(layout).offsets[group] + int(g.buffer_keys[0, 0])


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
@pytest.mark.parametrize("way", ["bulk", "layerwise"])
def test_checked_groups_beside_staged_or_layerwise_kv(
    reference: list[int], tp_p: int, tp_d: int, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KV chunks through the staging ring, or sent layer-wise before they are computed, with
    their own checks; the groups checked as well: the single process's tokens."""
    seen = spy_checks(monkeypatch)
    cfg = config(staging="bulk", checksum=True) if way == "bulk" else CHECKED
    out = run_pd(SPEC, PROMPT, N_GEN, tp_p, tp_d, cfg=cfg, layerwise=way == "layerwise")
    assert out.tokens == reference
    assert len(seen) == tp_p * tp_d and all(sums for _, sums in seen)


@pytest.mark.parametrize(
    "group", sorted(g.name for g in RankPools.build(SPEC, 1, 0, 16, 16, 4).layout.groups)
)
def test_a_flipped_group_byte_fails_the_request_naming_the_group(
    monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    flipped = flip_first_landed_row(monkeypatch, first_key(group))
    before = failures("checksum_mismatch")
    with pytest.raises(KVWireError, match=rf"buffer-group checksum mismatch .*'{group}' layers"):
        run_pd(SPEC, PROMPT, N_GEN, 2, 1, cfg=CHECKED)
    layout = RankPools.build(SPEC, 1, 0, 16, 16, 4).layout
    assert flipped and describe_keys(layout, flipped[:1]).startswith(f"'{group}'")
    assert failures("checksum_mismatch") == before + 1  # the decode rank's counter


@pytest.mark.parametrize("compare", [True, False], ids=["checked", "comparison-off"])
def test_a_damaged_state_row_is_caught_and_really_changes_the_tokens(
    reference: list[int], monkeypatch: pytest.MonkeyPatch, compare: bool
) -> None:
    """Negative control: the first SSM state row that landed, overwritten with noise, fails
    the checked request; with decode's comparison switched off the request succeeds with
    the wrong state and the tokens differ (the damage is real, only the check sees it)."""
    flip_first_landed_row(monkeypatch, first_key("ssm"), whole_row=True)
    if compare:
        with pytest.raises(KVWireError, match=r"buffer-group checksum mismatch .*'ssm' layers"):
            run_pd(SPEC, PROMPT, N_GEN, 2, 1, cfg=CHECKED)
        return
    monkeypatch.setattr(group_check, "mismatched_layers", lambda sent, landed: [])
    out = run_pd(SPEC, PROMPT, N_GEN, 2, 1, cfg=CHECKED)
    assert out.tokens != reference


@pytest.mark.parametrize("flip", [False, True], ids=["clean", "flipped"])
def test_late_group_sums_follow_the_rows_as_a_second_part(
    reference: list[int], monkeypatch: pytest.MonkeyPatch, flip: bool
) -> None:
    """Host group rows from the hasher's ``LATE_BYTES`` on (lowered to 0 here) are summed
    while they fly: the transfer's state note (part 0 of 2) carries no sums, the sums come
    as part 1 over the control channel, decode checks once both arrived; the tokens are the
    single process's, and a flipped bit is still caught."""
    monkeypatch.setattr(RowHasher, "LATE_BYTES", 0)
    seen = spy_checks(monkeypatch)
    parts: list[tuple[int, int, int]] = []
    original = RecvRoom.state_part

    def state_part(room: RecvRoom, msg: Any) -> Any:
        parts.append((msg.part, msg.parts, len(msg.sums)))
        return original(room, msg)

    monkeypatch.setattr(RecvRoom, "state_part", state_part)
    if flip:
        flip_first_landed_row(monkeypatch, first_key("ssm"))
        with pytest.raises(KVWireError, match=r"buffer-group checksum mismatch .*'ssm' layers"):
            run_pd(SPEC, PROMPT, N_GEN, 2, 1, cfg=CHECKED)
        return
    out = run_pd(SPEC, PROMPT, N_GEN, 2, 1, cfg=CHECKED)
    assert out.tokens == reference
    assert [p[:2] for p in sorted(parts)] == [(0, 2), (0, 2), (1, 2), (1, 2)]  # two senders
    assert all((n == 0) == (part == 0) for part, _, n in parts), "sums only in part 1"
    assert len(seen) == 2 and all(sums for _, sums in seen)


def test_state_parts_are_counted_once_and_out_of_range_ones_dropped() -> None:
    """Decode's assembly of a state note in parts: sums add up over the parts, a repeated
    part (a resend after failover) and a part number the note does not have are dropped,
    and a note of one part is complete at once."""
    from kvwire.control.wire import ChunkNote

    room = RecvRoom(room=1, bootstrap_addr="x")
    note: dict[str, Any] = {"room": 1, "sender_id": 3, "session": "p", "what": "state"}
    note["parts"] = 2
    assert room.state_part(ChunkNote(**note, part=0)) is None
    assert room.state_part(ChunkNote(**note, part=0)) is None  # repeated: dropped
    assert room.state_part(ChunkNote(**note, part=5)) is None  # no such part: dropped
    done = room.state_part(ChunkNote(**note, part=1, sum_layers=[2, 4], sums=[7, 9]))
    assert done == {2: 7, 4: 9}
    assert not room.state_parts
    one: dict[str, Any] = {**note, "sender_id": 4, "parts": 1, "sum_layers": [1], "sums": [5]}
    assert room.state_part(ChunkNote(**one)) == {1: 5}


def test_a_prefill_that_says_it_sums_groups_and_sends_none_fails_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(SentGroupSums, "sums", lambda self, src, dst: {})
    with pytest.raises(KVWireError, match="carries no checksums"):
        run_pd(SPEC, PROMPT, N_GEN, 1, 1, cfg=CHECKED)


def test_an_older_prefill_leaves_groups_unchecked_with_a_warning(
    reference: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A 1.13 prefill answers without ``group_checksum`` and sums nothing: decode checks its
    KV chunks, says once per link that its groups are not checked, and the request works."""
    from kvwire.session.prefill import links

    monkeypatch.setattr(links, "SentGroupSums", lambda layout, groups: None)
    seen = spy_checks(monkeypatch)
    with caplog.at_level(logging.INFO, logger="kvwire.session.decode.links"):
        out = run_pd(SPEC, PROMPT, N_GEN, 1, 1, cfg=CHECKED)
    assert out.tokens == reference
    assert not seen
    assert any("sends no checksums of its buffer groups" in r.message for r in caplog.records)
    links_seen = [r.getMessage() for r in caplog.records if "link from" in r.getMessage()]
    assert links_seen and all("checksums of its KV (not its groups)" in m for m in links_seen)


def test_keys_are_dense_per_group_and_layer_and_named_back() -> None:
    layout = RankPools.build(SPEC, 1, 0, 16, 16, 4).layout
    view = GroupBuffers(layout)
    keys = view.buffer_keys[:, 0]
    assert len(keys) == len(view.buffers) == len(layout.group_regions)
    total = sum(g.num_layers for g in layout.groups)
    assert set(keys.tolist()) <= set(range(total))
    first = sorted(layout.groups, key=lambda g: g.name)[0]
    assert describe_keys(layout, [0]) == f"{first.name!r} layers 0"


_DEVICE_GROUPS = textwrap.dedent(
    """
    import numpy as np
    from kvwire.index.groups import GroupMapper
    from kvwire.integrity import RowHasher, mismatched_layers
    from kvwire.integrity_device import DeviceRowHasher
    from kvwire.descriptors import ADDR
    from kvwire.session.group_sums import GroupBuffers
    from kvwire.testing.hybrid import RankPools
    from kvwire.testing.hybrid_model import HybridSpec
    spec = HybridSpec()
    src = RankPools.build(spec, 2, 1, 16, 16, 4).layout
    dst = RankPools.build(spec, 1, 0, 16, 16, 4).layout
    rng = np.random.default_rng(11)
    u8 = np.ctypeslib.ctypes.c_uint8
    for b in src.group_regions:
        view = np.ctypeslib.as_array((u8 * b.length).from_address(b.addr))
        view[:] = rng.integers(0, 256, b.length, dtype=np.uint8)
    vram = src.model_copy(update={"groups": tuple(
        g.model_copy(update={"buffers": tuple(x.model_copy(update={"kind": 1}) for x in g.buffers)})
        for g in src.groups)})
    host = RowHasher(GroupBuffers(src))
    dev = DeviceRowHasher(GroupBuffers(vram), device="cpu")
    gm = GroupMapper(src, dst)
    tables = gm.build_tables()
    slots = {"state": np.array([3]), "window": np.array([5, 2]), "pages": np.array([1, 4, 6])}
    s_rows, d_rows = gm.map_request(slots, slots)
    keys = tables.dst[d_rows, ADDR]
    want = host.sums(tables.src, s_rows, keys)
    got = dev.sums(tables.src, s_rows, keys)
    assert want and got == want, (got, want)
    cell = np.ctypeslib.ctypes.c_uint8.from_address(int(tables.src[s_rows[0], ADDR]))
    cell.value ^= 1
    bad = mismatched_layers(want, dev.sums(tables.src, s_rows, keys))
    assert len(bad) == 1, bad
    print("DEVICE-GROUPS-OK")
    """
)


def test_the_device_hasher_sums_groups_as_the_host_one_in_the_interpreter() -> None:
    """Group rows of GPU buffers go through the device hasher (Triton's CPU interpreter over
    host memory here): every (group, layer) key's sum equals the host hasher's, bit for bit,
    and one flipped byte changes one key."""
    pytest.importorskip("triton")
    run_interpreted(_DEVICE_GROUPS, "DEVICE-GROUPS-OK")


def test_sums_for_rows_that_land_nowhere_here_are_a_mismatch() -> None:
    """A note that carries sums for a request whose groups write no row on this rank (the
    two sides' mappings disagree) fails its check; one with neither rows nor sums passes."""
    from types import SimpleNamespace

    from kvwire.control.wire import ChunkNote

    layout = RankPools.build(SPEC, 1, 0, 16, 16, 4).layout
    sums = SimpleNamespace(
        layout=layout,
        rows=lambda group_dst, dst_pages: np.empty(0, np.int64),
        sums=lambda rows: pytest.fail("no rows to sum"),
    )
    link = SimpleNamespace(info=SimpleNamespace(agent="prefill-x"))
    note = ChunkNote(room=1, sender_id=2, session="p", what="state")
    pages = np.arange(3)
    bad = GroupCheck(1, note, {0: 5}, link, sums, {}, pages).run()  # type: ignore[arg-type]
    assert bad is not None and "buffer-group checksum mismatch from prefill-x" in str(bad[0])
    assert GroupCheck(1, note, {}, link, sums, {}, pages).run() is None  # type: ignore[arg-type]
