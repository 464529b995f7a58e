"""The staging rule per link (issue 27 items 3 and 5): which links bulk staging stages
(head slices, whole rows by the ``equal_tp`` rule, page-size conversion, MLA, dummies), the
per-link rule's staging advice applied at handshake (``"staged"``, ``"direct"``,
``"configured"``), decode's pool kinds reaching the rule, and the words the startup log and
``kvwire doctor`` print about what is applied."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from kvwire.errors import ConfigError
from kvwire.index.equal_tp import EqualTPMapper, MLAMapper
from kvwire.index.head_slice import HeadSliceMapper
from kvwire.layout import ModelSpec, RankPosition
from kvwire.link_choice import LinkFacts, applied_staging, choose_link_path
from kvwire.regions import MemKind
from kvwire.staging.bulk import BulkOptions, BulkStaging, descriptor_bytes
from kvwire.staging.bulk_wire import WIRE_VERSION
from kvwire.staging.direct import DirectStaging
from kvwire.testing.kvfill import make_pool
from kvwire.testing.pair import config, pair

MODEL = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="int32", page_size=4)
MLA = ModelSpec(num_layers=2, total_kv_heads=1, head_dim=8, dtype="int32", page_size=4,
                is_mla=True)  # fmt: skip
OPTS: dict[str, Any] = {"ring_bytes": 65536, "buffer_bytes": 8192, "block_bytes": 1024}
RING = {"strategy": "bulk", "wire": WIRE_VERSION, "ring_addr": 1 << 20, "ring_bytes": 65536,
        "block_bytes": 1024, "device_id": 0, "kind": int(MemKind.DRAM), "units": True}  # fmt: skip


def _writer(opts: dict[str, Any] | None = None) -> BulkStaging:
    from kvwire.staging.base import StagingContext

    layout, arrays = make_pool(MODEL, RankPosition(), 8)
    s = BulkStaging(BulkOptions(**OPTS, **(opts or {})))
    s.setup(StagingContext(layout, lambda r: None, lambda r: None, kv_tensors=arrays))
    return s


def _pools(model: ModelSpec, tp: tuple[int, int], pages: tuple[int, int], rank: int = 0) -> Any:
    src, _ = make_pool(model.model_copy(update={"page_size": pages[0]}),
                       RankPosition(tp_size=tp[0], tp_rank=rank), 8)  # fmt: skip
    dst, _ = make_pool(model.model_copy(update={"page_size": pages[1]}),
                       RankPosition(tp_size=tp[1], tp_rank=0), 8)  # fmt: skip
    return src, dst


def test_which_links_stage_and_why() -> None:
    s = _writer()
    conv = EqualTPMapper(*_pools(MODEL, (1, 1), (4, 2)))
    mla = MLAMapper(*_pools(MLA, (1, 2), (4, 4)))
    dummy = MLAMapper(*_pools(MLA, (2, 1), (4, 4), rank=1))
    hetero = HeadSliceMapper(*_pools(MODEL, (2, 1), (4, 8)))
    # host pools, configured: head slices (with page-size conversion) stage; whole rows not
    ok, why = s.decide(hetero, RING)
    assert ok and "head slices" in why and "pages 4 -> 8 tokens by 1-token units" in why
    for m in (conv, mla):
        ok, why = s.decide(m, RING)
        assert not ok and why.startswith("per descriptor: whole rows") and "pool kinds" in why
    ok, why = s.decide(dummy, RING)
    assert not ok and "dummy sender" in why
    # the rule's advice "staged" (GPU pools without a same-host path) stages whole rows
    for m in (conv, mla):
        ok, why = s.decide(m, RING, "staged")
        assert ok and "link rule's advice" in why
        assert "staging" in s.link_staging(m, RING, "staged").tables
    assert "pages 4 -> 2 tokens by 2-token units" in s.decide(conv, RING, "staged")[1]
    # ... but not a dummy, and not descriptors that are already large
    assert not s.decide(dummy, RING, "staged")[0]
    big = _writer({"equal_tp_below_bytes": descriptor_bytes(conv)})
    assert not big.decide(conv, RING, "staged")[0]
    # "direct" (the backend writes decode's pages itself, in page form): nothing stages,
    # whole rows and head slices alike (staged over cudaipc, head slices were 3-6x slower)
    for m in (conv, mla, hetero):
        ok, why = s.decide(m, RING, "direct")
        assert not ok and "advice" in why
        assert s.link_staging(m, RING, "direct").tables == {}
    assert s.decide(hetero, RING, "staged")[0] and s.decide(hetero, RING)[0]
    # a GPU pool and ring stage whole rows by the pool kinds alone
    s.writer.kv.on_device = True  # as a GPU pool would be (the rule reads only this)
    vram = {**RING, "kind": int(MemKind.VRAM)}
    assert s.decide(conv, vram)[0] and s.decide(mla, vram)[0]
    # explicit equal_tp options win over the advice
    never = _writer({"equal_tp": "never"})
    assert not never.decide(conv, RING, "staged")[0]
    assert "equal_tp=never" in never.decide(conv, RING, "staged")[1]
    assert _writer({"equal_tp": "always"}).decide(mla, RING)[0]
    # decode without a ring
    ok, why = s.decide(hetero, None)
    assert not ok and "no bulk staging ring" in why
    # a decode of an older kvwire (no "units" in its ring description) would refuse staged
    # page-size conversion and MLA links: they stay per descriptor, the rest still stage
    old = {k: v for k, v in vram.items() if k != "units"}
    for m in (conv, mla, hetero):
        ok, why = s.decide(m, old, "staged")
        assert not ok and "decode's kvwire predates staged page-size conversion" in why
    same = EqualTPMapper(*_pools(MODEL, (1, 1), (4, 4)))
    assert s.decide(same, old)[0]


def test_descriptor_bytes_is_the_per_descriptor_row() -> None:
    conv = EqualTPMapper(*_pools(MODEL, (1, 1), (4, 6)))  # granules of gcd(4, 6) = 2 tokens
    assert descriptor_bytes(conv) == 2 * conv.src.token_row_bytes
    same = EqualTPMapper(*_pools(MODEL, (1, 1), (4, 4)))
    assert descriptor_bytes(same) == same.src.page_bytes


def test_a_strategy_that_stages_nothing_ignores_the_advice() -> None:
    m = EqualTPMapper(*_pools(MODEL, (1, 1), (4, 4)))
    applied = DirectStaging().link_staging(m, None, "staged")
    assert not applied.staged and applied.why == "--staging direct: rows move in place"


def test_the_words_doctor_prints_for_what_is_applied() -> None:
    assert "not applied" in applied_staging("staged", "direct")
    assert "--staging bulk" in applied_staging("staged", "direct")
    assert applied_staging("staged", "bulk").startswith("bulk: head slices staged")
    assert "no staging" in applied_staging("direct", "direct")
    assert "no staging" in applied_staging("direct", "bulk")
    assert applied_staging("direct", "auto").startswith("auto -> rows written")
    assert applied_staging("staged", "auto").startswith("auto -> bulk: head slices staged")
    assert applied_staging("configured", "auto") == "auto -> --staging direct"
    assert applied_staging("configured", "direct") == "--staging direct"
    assert "only on GPU pools" in applied_staging("configured", "bulk")


def test_peer_kinds_reach_the_rule() -> None:
    """Decode's pool kinds (from its handshake layout) replace the guess."""
    cands = [("nixl", None)]
    vram = frozenset({MemKind.VRAM})
    guessed = choose_link_path(LinkFacts(cands, local_kinds=vram))
    assert guessed.staging == "staged" and "taken to be like" in guessed.why
    told = choose_link_path(LinkFacts(cands, local_kinds=vram, peer_kinds=vram))
    assert told.staging == "staged" and "taken to be like" not in told.why
    host = choose_link_path(
        LinkFacts(cands, local_kinds=vram, peer_kinds=frozenset({MemKind.DRAM}))
    )
    assert host.staging == "configured" and "a host pool on one side" in host.why


def test_handshake_logs_the_advice_and_what_is_applied(caplog: pytest.LogCaptureFixture) -> None:
    """A real handshake (tcp, in process): the startup line names the advice and what the
    KV pool's strategy applied, with decode's pool kinds known (no guess)."""
    caplog.set_level(logging.INFO, logger="kvwire.session.prefill.links")
    with pair(config()) as p:
        p.transfer(1)
    lines = [r.getMessage() for r in caplog.records if "handshake with" in r.getMessage()]
    assert lines, "no handshake line logged"
    assert "staging advice 'configured', applied: --staging direct: rows move in place" in lines[0]
    assert "taken to be like" not in lines[0]


@pytest.mark.parametrize("advice", ["staged", "configured", "direct"])
def test_the_advice_is_applied_per_link_end_to_end(
    advice: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two managers over tcp with ``--staging bulk`` on host pools, equal TP with page-size
    conversion (prefill pages of 4 tokens, decode pages of 8): the per-link rule's advice is
    forced (host pools get ``configured`` from the real rule). ``staged`` stages the
    whole-row link (blocks scattered on decode), ``configured`` keeps the host-pool rule
    (per descriptor), ``direct`` never stages; every element verified either way, and the
    handshake line says what was applied."""
    import kvwire.backend_links as backend_mod  # where the backends' link rules ask for a path
    from kvwire.link_choice import LinkPath
    from kvwire.session import KVManager, KVPoll, Role
    from kvwire.staging.bulk_ring import STAGED
    from kvwire.testing.kvfill import count_mismatches, fill_pages
    from kvwire.testing.pair import wait_for

    real = backend_mod.choose_link_path

    def forced(facts: LinkFacts) -> LinkPath:
        p = real(facts)
        return LinkPath(p.backend, p.fallbacks, advice, p.why, p.skipped)  # type: ignore[arg-type]

    monkeypatch.setattr(backend_mod, "choose_link_path", forced)
    caplog.set_level(logging.INFO, logger="kvwire.session.prefill.links")
    opts = {**OPTS, "equal_tp_min_chunk_bytes": 0}
    cfg = config().model_copy(update={"staging": "bulk", "staging_options": opts})
    play, parr = make_pool(MODEL, RankPosition(), 32)
    dlay, darr = make_pool(MODEL.model_copy(update={"page_size": 8}), RankPosition(), 32)
    pre = KVManager(cfg, Role.PREFILL, play, kv_tensors=parr)
    dec = KVManager(cfg, Role.DECODE, dlay, kv_tensors=darr)
    try:
        before = STAGED._value.get()
        assert pre.bootstrap_addr
        r = dec.receiver(5, pre.bootstrap_addr)
        r.init()
        dst = np.array([9, 3], dtype=np.int64)  # 16 tokens in decode pages of 8
        r.send_metadata(dst, aux_index=1, cached_tokens=0)
        s = pre.sender(5)
        src = np.array([7, 1, 12, 4], dtype=np.int64)
        fill_pages(play, parr, src, 0)
        wait_for(lambda: s.poll() >= KVPoll.WaitingForInput, 30)
        s.init(4, aux_index=2)
        s.send(src[:3], last=False)  # a chunk boundary inside decode page 1
        s.send(src[3:], last=True)
        wait_for(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, 60)
        assert count_mismatches(dlay, darr, dst, 0) == 0
        staged = STAGED._value.get() - before
        assert staged == (2 if advice == "staged" else 0), staged
        r.clear()
        s.clear()
    finally:
        dec.close()
        pre.close()
    line = next(r.getMessage() for r in caplog.records if "handshake with" in r.getMessage())
    assert f"staging advice '{advice}', applied: " in line
    applied = line.split("applied: ", 1)[1]
    if advice == "staged":
        assert applied.startswith("staged: whole rows (equal_tp), pages 4 -> 8 tokens")
    elif advice == "direct":
        assert applied.startswith("per descriptor: the link's backend writes")
    else:
        assert applied.startswith("per descriptor: whole rows") and "pool kinds" in applied


def test_doctor_plan_says_what_the_configured_staging_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kvwire doctor`` (no ``--peer``) with ``auto``: beside the per-link rule, what this
    rank's ``--staging`` makes of each advice."""
    import io

    from rich.console import Console

    from kvwire.cli import build_parser
    from kvwire.doctor_links import links_section

    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    for staging, words in (
        ("direct", "where advised 'staged': not applied: --staging direct has no staged path"),
        ("bulk", "where advised 'staged': bulk: head slices staged; whole rows"),
    ):
        out = io.StringIO()
        argv = ["doctor", "--transfer-backend", "auto", "--pool", "vram", "--staging", staging]
        args = build_parser().parse_args(argv)
        assert links_section(args, Console(file=out, width=400, color_system=None)) == []
        assert f"staging applied (--staging {staging}): {words}" in out.getvalue(), out.getvalue()


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"ring_bytes": 1 << 61}, "whole number of 1.."),  # a huge table must not be built
        ({"ring_bytes": 65536 + 1}, "whole number"),
        ({"ring_bytes": -1}, "greater than 0"),
        ({"ring_addr": "x"}, "ring_addr"),
        ({"device_id": None}, "device_id"),
    ],
)
def test_a_malformed_ring_is_refused_before_tables_are_built(
    change: dict[str, Any], words: str
) -> None:
    """Decode's ring description sizes prefill's staging table: a malformed one fails the
    link with a clear error instead of building a table from it."""
    s = _writer()
    hetero = HeadSliceMapper(*_pools(MODEL, (2, 1), (4, 8)))
    assert "staging" in s.link_staging(hetero, RING).tables  # the well-formed ring stages
    with pytest.raises(ConfigError, match="ring is malformed") as err:
        s.link_staging(hetero, {**RING, **change})
    assert words in str(err.value)


def test_span_rows_in_the_link_tables() -> None:
    """The link's staging tables hold a row per block and span: the destination's rows of
    one block at the ring's block positions first, then rows of 2, 4 and 8 blocks (a buffer
    of 8 blocks)."""
    s = _writer()
    hetero = HeadSliceMapper(*_pools(MODEL, (2, 1), (4, 8)))
    pair = s.link_staging(hetero, RING, session="d1").tables["staging"]
    assert s.writer is not None and "d1" in s.writer._spans
    s.writer.peer_lost("d1")  # an evicted decode rank's spans go with it
    assert "d1" not in s.writer._spans
    n = 65536 // 1024
    assert pair.dst.shape[0] == sum(n - (1 << k) + 1 for k in range(4))
    assert list(pair.dst[:n, 1]) == [1024] * n and pair.dst[n, 1] == 2048
    assert int(pair.dst[-1, 1]) == 8 * 1024
    assert int(pair.dst[-1, 0]) == (1 << 20) + (n - 8) * 1024
