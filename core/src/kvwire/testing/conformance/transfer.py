"""Bytes land exactly: WRITE and READ of random index sets, mixed row lengths, one large row, many
small rows."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvwire.backend import (
    XferOp,
)
from kvwire.testing.conformance.common import (
    GUARD,
    MIXED_SPAN,
    SuiteBase,
    _addr,
    _apply_rows,
    _assert_bytes_equal,
    _Env,
    _index_rounds,
    _randomize,
    _table,
)
from kvwire.testing.remote import (
    digest,
)


class TransferConformance(SuiteBase):
    """Bytes land exactly: WRITE and READ of random index sets, mixed row lengths, one large row,
    many small rows. Part of :class:`~kvwire.testing.conformance.BackendConformance`."""

    def test_write_random_index_sets(self, env: _Env) -> None:
        env.need("write")
        src, dst = env.lbuf["src"], env.rbuf["dst"]
        rows, row, stride = 512, 256, 512
        # Local rows back to back, remote rows with gaps: rows adjacent on one side only
        # must not be merged, and the gaps must stay untouched.
        loff = np.arange(rows, dtype=np.int64) * row
        roff = np.arange(rows, dtype=np.int64) * stride + 96
        model = env.remote.read_array("dst")
        with env.prepared(_table(_addr(src), loff, row), _table(dst.addr, roff, row)) as pair:
            for what, li, ri in _index_rounds(env.rng, rows):
                _randomize(src, env.rng)
                la, ra = np.asarray(li, dtype=np.int64), np.asarray(ri, dtype=np.int64)
                _apply_rows(model, roff[ra], src, loff[la], np.full(la.size, row))
                handle = env.run(XferOp.WRITE, pair, li, ri)
                assert handle.num_descs == la.size and handle.num_bytes == la.size * row
                _assert_bytes_equal(env.remote.read_array("dst"), model, f"WRITE {what}")

    def test_write_mixed_row_lengths(self, env: _Env) -> None:
        env.need("write")
        src, dst = env.lbuf["big_src"], env.rbuf["big"]
        rng = env.rng
        lens = rng.choice(np.array([1, 3, 64, 500, 4096, 40_000]), 300)

        def pack(order: NDArray[np.int64]) -> NDArray[np.int64]:
            gaps = rng.choice(np.array([0, 0, 8, 100]), lens.size)
            off = np.empty(lens.size, dtype=np.int64)
            off[order] = np.cumsum(lens[order] + gaps) - lens[order]
            return off

        loff = pack(np.arange(lens.size))
        roff = pack(rng.permutation(lens.size))
        assert max(loff.max(), roff.max()) + lens.max() <= MIXED_SPAN
        model = env.remote.read_array("big", 0, MIXED_SPAN)
        with env.prepared(_table(_addr(src), loff, lens), _table(dst.addr, roff, lens)) as pair:
            # Random matching of rows within each length class, in random order.
            li, ri = [], []
            for n in np.unique(lens):
                rows = np.flatnonzero(lens == n)
                li.append(rng.permutation(rows))
                ri.append(rng.permutation(rows))
            perm = rng.permutation(lens.size)
            la, ra = np.concatenate(li)[perm], np.concatenate(ri)[perm]
            _randomize(src[:MIXED_SPAN], rng)
            _apply_rows(model, roff[ra], src, loff[la], lens[la])
            env.run(XferOp.WRITE, pair, la, ra)
            _assert_bytes_equal(
                env.remote.read_array("big", 0, MIXED_SPAN), model, "WRITE of mixed row lengths"
            )
        # Rows contiguous on both sides (a backend may merge them): same offsets both sides.
        with env.prepared(_table(_addr(src), loff, lens), _table(dst.addr, loff, lens)) as pair:
            _randomize(src[:MIXED_SPAN], rng)
            idx = np.arange(lens.size)
            _apply_rows(model, loff, src, loff, lens)
            env.run(XferOp.WRITE, pair, idx, idx)
            _assert_bytes_equal(
                env.remote.read_array("big", 0, MIXED_SPAN), model, "WRITE of contiguous rows"
            )

    def test_read_random_index_sets(self, env: _Env) -> None:
        env.need("read")
        rdst, rsrc = env.lbuf["rdst"], env.rbuf["rsrc"]
        rows, row, stride = 512, 256, 512
        loff = np.arange(rows, dtype=np.int64) * stride + 32  # gaps locally,
        roff = np.arange(rows, dtype=np.int64) * row + 200  # back to back remotely
        source = env.remote.read_array("rsrc")
        source_digest = digest(source)
        model = rdst.copy()
        with env.prepared(_table(_addr(rdst), loff, row), _table(rsrc.addr, roff, row)) as pair:
            for what, li, ri in _index_rounds(env.rng, rows):
                la, ra = np.asarray(li, dtype=np.int64), np.asarray(ri, dtype=np.int64)
                _apply_rows(model, loff[la], source, roff[ra], np.full(la.size, row))
                env.run(XferOp.READ, pair, li, ri)
                _assert_bytes_equal(rdst, model, f"READ {what}")
        assert env.remote.digest("rsrc") == source_digest, "READ modified the remote source"

    def test_large_single_descriptor(self, env: _Env) -> None:
        env.need("write")
        n = type(self).large_transfer_bytes
        src, big = env.lbuf["big_src"], env.rbuf["big"]
        _randomize(src[GUARD : GUARD + n], env.rng)
        head, tail = env.remote.digest("big", 0, GUARD), env.remote.digest("big", GUARD + n)
        with env.prepared(_table(_addr(src), [GUARD], n), _table(big.addr, [GUARD], n)) as pair:
            handle = env.run(XferOp.WRITE, pair, [0], [0])
        assert handle.num_bytes == n
        assert env.remote.digest("big", GUARD, n) == digest(src[GUARD : GUARD + n]), (
            f"a {n} B WRITE did not arrive intact"
        )
        assert env.remote.digest("big", 0, GUARD) == head, "bytes before the row changed"
        assert env.remote.digest("big", GUARD + n) == tail, "bytes after the row changed"
        if not env.caps.read:
            return
        dst = env.lbuf["big_dst"]
        expected = env.remote.digest("big", GUARD, n)
        guards = digest(dst[:GUARD]), digest(dst[GUARD + n :])
        with env.prepared(_table(_addr(dst), [GUARD], n), _table(big.addr, [GUARD], n)) as pair:
            env.run(XferOp.READ, pair, [0], [0])
        assert digest(dst[GUARD : GUARD + n]) == expected, f"a {n} B READ did not arrive intact"
        assert (digest(dst[:GUARD]), digest(dst[GUARD + n :])) == guards, "READ touched guards"

    def test_many_descriptors(self, env: _Env) -> None:
        env.need("write")
        rows, row = type(self).many_rows, type(self).many_row_bytes
        stride, span = 2 * row, 2 * row * rows
        src, big = env.lbuf["big_src"], env.rbuf["big"]
        loff = np.arange(rows, dtype=np.int64) * stride
        roff = np.arange(rows, dtype=np.int64) * stride + row // 2
        perm = env.rng.permutation(rows)
        _randomize(src[:span], env.rng)
        model = env.remote.read_array("big", 0, span + row)
        _apply_rows(model, roff[perm], src, loff, np.full(rows, row))
        with env.prepared(_table(_addr(src), loff, row), _table(big.addr, roff, row)) as pair:
            handle = env.run(XferOp.WRITE, pair, np.arange(rows), perm)
        assert handle.num_descs == rows
        _assert_bytes_equal(
            env.remote.read_array("big", 0, span + row), model, f"WRITE of {rows} rows"
        )
        if not env.caps.read:
            return
        dst = env.lbuf["big_dst"]
        source = model
        lmodel = dst[: span + row].copy()
        perm = env.rng.permutation(rows)
        _apply_rows(lmodel, loff + row // 4, source, roff[perm], np.full(rows, row))
        with env.prepared(
            _table(_addr(dst), loff + row // 4, row), _table(big.addr, roff, row)
        ) as pair:
            env.run(XferOp.READ, pair, np.arange(rows), perm)
        _assert_bytes_equal(dst[: span + row], lmodel, f"READ of {rows} rows")
