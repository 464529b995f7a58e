"""The connector's worker half on a load that fails part-way (issue 26 item 2), with real kvwire
managers (an in-process tcp pair, :mod:`kvwire.testing.pair`) under a prefill and a decode
:class:`~kvwire_vllm.worker.WorkerHalf`.

Prefill pushes 4 blocks in chunks of 2 (``push_chunk_blocks``); the second chunk has a byte
flipped on landing, before decode's check (checksums on), so the check fails it and the
first chunk stays verified. With vLLM's ``kv_load_failure_policy="recompute"`` the worker
reports the request as finished (not failed: vLLM would recompute it whole) and only the
second chunk's blocks as load errors (vLLM recomputes from the first of them); with
``"fail"`` the request is failed with all its blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvwire.layout import RankPosition
from kvwire.session import Role
from kvwire.session.checksums import LandedSums
from kvwire.testing.faults import landed_flipper
from kvwire.testing.kvfill import count_mismatches, fill_pages
from kvwire.testing.pair import config, pair, wait_for
from kvwire_vllm.config import ConnectorOptions
from kvwire_vllm.metadata import KVWireMetadata, RecvSpec, SendSpec
from kvwire_vllm.worker import TransferReport, WorkerHalf

BLOCKS = [10, 11, 12, 13]  # decode's blocks for the request
SRC = [0, 1, 2, 3]  # prefill's


def _flip_second_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode's check of the second chunk (request pages 2 and 3) starts by flipping one bit
    of its first landed row of layer 1: a byte corrupted in flight (``flip_on_landing``)."""
    flip = landed_flipper(layer=1, offset=3, spans=lambda span: span[0] == SRC[2])
    monkeypatch.setattr(LandedSums, "chunk", flip)


def _halves(p: Any, recompute: bool) -> tuple[WorkerHalf, WorkerHalf]:
    pre = WorkerHalf(
        ConnectorOptions(push_chunk_blocks=2), p.prefill.config, Role.PREFILL, RankPosition(), 32
    )
    dec = WorkerHalf(
        ConnectorOptions(), p.decode.config, Role.DECODE, RankPosition(), 32, recompute=recompute
    )
    pre.mgr, dec.mgr = p.prefill, p.decode  # the pools are the pair's (no vLLM tensors here)
    return pre, dec


def _run(p: Any, pre: WorkerHalf, dec: WorkerHalf) -> tuple[TransferReport, set[int]]:
    """Decode asks, prefill pushes; step both until decode reports the request."""
    fill_pages(p.play, p.parr, np.asarray(SRC), 0)
    dec.start_load_kv(KVWireMetadata(recvs=[RecvSpec("r1", 77, p.addr, BLOCKS, 0)]))
    pre.start_load_kv(KVWireMetadata(sends=[SendSpec("r1", 77, SRC)]))
    seen = TransferReport()
    errors: set[int] = set()

    def step() -> bool:
        pre.get_transfer_results()
        got = dec.get_transfer_results()
        errors.update(dec.take_load_errors())
        seen.finished_recving |= got.finished_recving
        seen.failed_recving |= got.failed_recving
        return "r1" in seen.finished_recving

    wait_for(step, 20.0)
    wait_for(lambda: not pre.get_transfer_results().finished_sending and not pre.sends, 20.0)
    return seen, errors


def test_recompute_policy_reports_only_the_blocks_that_did_not_land(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pair(config(), config(kv_checksum=True)) as p:
        _flip_second_chunk(monkeypatch)
        pre, dec = _halves(p, recompute=True)
        seen, errors = _run(p, pre, dec)
        assert seen.failed_recving == set(), "a failed_recving request is recomputed whole"
        assert errors == {12, 13}
        # what the report kept holds prefill's KV: vLLM reuses it as is
        ps = p.dlay.model.page_size
        assert count_mismatches(p.dlay, p.darr, np.asarray(BLOCKS[:2]), 0) == 0
        assert count_mismatches(p.dlay, p.darr, np.asarray(BLOCKS[2:3]), 2 * ps) > 0
        assert dec.recovered["r1"] == (2, 2)
        assert "checksum" in dec.errors["r1"]


def test_fail_policy_fails_the_request_with_all_its_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pair(config(), config(kv_checksum=True)) as p:
        _flip_second_chunk(monkeypatch)
        pre, dec = _halves(p, recompute=False)
        seen, errors = _run(p, pre, dec)
        assert seen.failed_recving == {"r1"}
        assert errors == set(BLOCKS)
        assert dec.recovered == {}


def test_chunked_push_succeeds_whole() -> None:
    """Without a fault the chunked push lands whole: no error, every block verified."""
    with pair(config(), config(kv_checksum=True)) as p:
        pre, dec = _halves(p, recompute=True)
        seen, errors = _run(p, pre, dec)
        assert seen.finished_recving == {"r1"} and not seen.failed_recving and not errors
        assert count_mismatches(p.dlay, p.darr, np.asarray(BLOCKS), 0) == 0
