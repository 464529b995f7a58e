"""Page writes (:meth:`~kvwire.backend.TransferBackend.submit_pages`): a chunk in page form
lands exactly as its rows would, its notification after its data; bad pages are refused;
a backend without the capability refuses page submits. Writes submitted inside
:meth:`~kvwire.backend.TransferBackend.post_batch` (a prefill worker's turn) all land with
their notifications once the block ends."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from kvwire.backend import XferOp, XferState
from kvwire.errors import CapabilityError, DescriptorError
from kvwire.page_form import PageChunk, PageGeometry
from kvwire.testing.conformance.common import (
    SuiteBase,
    _addr,
    _apply_rows,
    _assert_bytes_equal,
    _Env,
    _randomize,
    _table,
    wait_terminal,
)
from kvwire.testing.remote import digest

#: A pool of PAIRS buffer pairs x SLOTS pages x TOKENS token rows: source rows of ROW bytes
#: (two slices of PIECE bytes each: a head-slice layout's groups), destination rows of PIECE.
PAIRS, SLOTS, TOKENS, PIECE = 3, 6, 4, 64
ROW = 2 * PIECE


def _geometry(group: int) -> tuple[PageGeometry, np.ndarray, np.ndarray]:
    """A head-slice-like geometry over tables of one row per (pair, slot, token[, group]),
    and the two tables' row offsets (bytes) into their buffers."""
    s_rows = np.arange(PAIRS * SLOTS * TOKENS * 2, dtype=np.int64)
    d_rows = np.arange(PAIRS * SLOTS * TOKENS, dtype=np.int64)
    geometry = PageGeometry(
        src_rows=np.arange(PAIRS, dtype=np.int64) * SLOTS * TOKENS * 2 + group,
        dst_rows=np.arange(PAIRS, dtype=np.int64) * SLOTS * TOKENS,
        src_page_rows=TOKENS * 2, dst_page_rows=TOKENS, src_token_rows=2, dst_token_rows=1,
        src_slot=TOKENS * ROW, dst_slot=TOKENS * PIECE, src_row=ROW, dst_row=PIECE,
        n=PIECE, tokens=TOKENS, src_slots=SLOTS, dst_slots=SLOTS,
    )  # fmt: skip
    return geometry, s_rows * PIECE, d_rows * PIECE


class PageConformance(SuiteBase):
    """Page writes, for a backend that declares ``page_writes`` (else: refused). Part of
    :class:`~kvwire.testing.conformance.BackendConformance`."""

    def test_page_writes(self, env: _Env) -> None:
        src, note_buf = env.lbuf["src"], env.rbuf["notify"]
        geometry, s_off, d_off = _geometry(1)
        with env.prepared(
            _table(_addr(src), s_off, PIECE), _table(note_buf.addr, d_off, PIECE)
        ) as pair:
            chunk = PageChunk(geometry, np.array([4, 0, 3]), np.array([1, 5, 2]))
            if not env.caps.page_writes:
                with pytest.raises(CapabilityError):
                    env.local.submit_pages(XferOp.WRITE, pair, chunk)
                return
            for bad in (PageChunk(geometry, np.array([0, SLOTS]), np.array([1, 2])),
                        PageChunk(geometry, np.array([0, 1]), np.array([-1, 2]))):  # fmt: skip
                with pytest.raises(DescriptorError, match="page indices out of range"):
                    env.local.submit_pages(XferOp.WRITE, pair, bad)
            env.remote.notifications(timeout=0)
            model = env.remote.read_array("notify")
            for rnd in range(3):
                _randomize(src, env.rng)
                sp = env.rng.permutation(SLOTS)[: 1 + rnd * 2]
                dp = env.rng.permutation(SLOTS)[: sp.size]
                chunk = PageChunk(geometry, sp.astype(np.int64), dp.astype(np.int64))
                li, ri = chunk.rows()
                _apply_rows(model, d_off[ri], src, s_off[li], np.full(li.size, PIECE))
                payload = f"pages-{rnd}-{uuid.uuid4().hex}".encode()
                h = env.local.submit_pages(XferOp.WRITE, pair, chunk, payload)
                assert h.num_descs == li.size and h.num_bytes == li.size * PIECE
                state = wait_terminal(env.local, h, env.timeout)
                assert state is XferState.DONE, f"page write ended {state.name}: {h.error}"
                env.local.release(h)
                notes = env.remote.notifications(
                    timeout=env.timeout, expect=1, progress=env.local.progress
                )
                assert [n.payload for n in notes] == [payload]
                assert notes[0].digests["notify"] == digest(model), (
                    f"round {rnd}: the page write's notification came before its data"
                )
        _assert_bytes_equal(env.remote.read_array("notify"), model, "notify buffer")

    def test_writes_of_one_turn(self, env: _Env) -> None:
        """Three writes submitted inside ``post_batch`` (as a prefill worker's turn does: in
        page form where the backend takes pages, else rows), each with its notification:
        after the block every one ends DONE, every byte landed and every notification came
        once, after its data."""
        src, note_buf = env.lbuf["src"], env.rbuf["notify"]
        geometry, s_off, d_off = _geometry(0)
        with env.prepared(
            _table(_addr(src), s_off, PIECE), _table(note_buf.addr, d_off, PIECE)
        ) as pair:
            env.remote.notifications(timeout=0)
            model = env.remote.read_array("notify")
            _randomize(src, env.rng)
            dst = env.rng.permutation(SLOTS)
            handles, payloads = [], []
            with env.local.post_batch():
                for k in range(3):
                    chunk = PageChunk(geometry, np.array([k, k + 3]), dst[2 * k : 2 * k + 2])
                    li, ri = chunk.rows()
                    _apply_rows(model, d_off[ri], src, s_off[li], np.full(li.size, PIECE))
                    payload = f"turn-{k}-{uuid.uuid4().hex}".encode()
                    payloads.append(payload)
                    if env.caps.page_writes:
                        h = env.local.submit_pages(XferOp.WRITE, pair, chunk, payload)
                    else:
                        h = env.local.submit(XferOp.WRITE, pair, li, ri, payload)
                    handles.append(h)
            for h in handles:
                state = wait_terminal(env.local, h, env.timeout)
                assert state is XferState.DONE, f"a write of the turn ended {state.name}: {h.error}"
                env.local.release(h)
            notes = env.remote.notifications(
                timeout=env.timeout, expect=3, progress=env.local.progress
            )
            assert sorted(n.payload for n in notes) == sorted(payloads)
        _assert_bytes_equal(env.remote.read_array("notify"), model, "notify buffer")
