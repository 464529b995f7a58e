"""Notifications arrive exactly once and only after their data."""

from __future__ import annotations

import collections
import uuid

import numpy as np

from kvwire.backend import (
    XferOp,
    XferState,
)
from kvwire.testing.conformance.common import (
    GUARD,
    NOTIFY_BYTES,
    SuiteBase,
    _addr,
    _apply_rows,
    _assert_bytes_equal,
    _Env,
    _randomize,
    _table,
    wait_terminal,
)
from kvwire.testing.remote import (
    digest,
    sampled_digest,
)


class NotificationConformance(SuiteBase):
    """Notifications arrive exactly once and only after their data. Part of
    :class:`~kvwire.testing.conformance.BackendConformance`."""

    def test_notification_after_data_exactly_once(self, env: _Env) -> None:
        env.need("write")
        env.need("notifications")
        src, note_buf = env.lbuf["src"], env.rbuf["notify"]
        rows, row = NOTIFY_BYTES // 128, 128
        offs = np.arange(rows, dtype=np.int64) * row
        env.remote.notifications(timeout=0)  # drop anything unrelated
        model = env.remote.read_array("notify")
        with env.prepared(_table(_addr(src), offs, row), _table(note_buf.addr, offs, row)) as pair:
            for rnd in range(5):
                _randomize(src, env.rng)
                n = int(env.rng.integers(1, rows))
                li = env.rng.choice(rows, n, replace=False)
                ri = env.rng.choice(rows, n, replace=False)
                _apply_rows(model, offs[ri], src, offs[li], np.full(n, row))
                payload = f"conformance-{rnd}-{uuid.uuid4().hex}".encode()
                env.run(XferOp.WRITE, pair, li, ri, notification=payload)
                notes = env.remote.notifications(
                    timeout=env.timeout, expect=1, progress=env.local.progress
                )
                assert [n.payload for n in notes] == [payload], (
                    f"round {rnd}: expected exactly this notification, got {notes!r}"
                )
                assert notes[0].peer == env.local.agent_name, (
                    f"notification names peer {notes[0].peer!r}, expected the initiator "
                    f"{env.local.agent_name!r}"
                )
                assert notes[0].digests["notify"] == digest(model), (
                    f"round {rnd}: the notification was delivered before all its data landed"
                )
        extra = env.remote.notifications(timeout=0.3, progress=env.local.progress)
        assert extra == [], f"notifications delivered more than once: {extra!r}"
        _assert_bytes_equal(env.remote.read_array("notify"), model, "notify buffer")

    def test_concurrent_notifications_exactly_once(self, env: _Env) -> None:
        env.need("write")
        env.need("notifications")
        src, note_buf = env.lbuf["src"], env.rbuf["notify"]
        rows, row, count = NOTIFY_BYTES // 128, 128, 8
        offs = np.arange(rows, dtype=np.int64) * row
        env.remote.notifications(timeout=0)
        model = env.remote.read_array("notify")
        _randomize(src, env.rng)
        targets = np.array_split(env.rng.permutation(rows), count)  # disjoint row sets
        payloads = [f"concurrent-{i}-{uuid.uuid4().hex}".encode() for i in range(count)]
        with env.prepared(_table(_addr(src), offs, row), _table(note_buf.addr, offs, row)) as pair:
            handles = []
            for ri, payload in zip(targets, payloads, strict=True):
                li = env.rng.choice(rows, ri.size, replace=False)
                _apply_rows(model, offs[ri], src, offs[li], np.full(ri.size, row))
                handles.append(env.local.submit(XferOp.WRITE, pair, li, ri, payload))
            for h in handles:
                state = wait_terminal(env.local, h, env.timeout)
                assert state is XferState.DONE, f"ended {state.name}: {h.error}"
                env.local.release(h)
        notes = env.remote.notifications(
            timeout=env.timeout, expect=count, progress=env.local.progress
        )
        notes += env.remote.notifications(timeout=0.3, progress=env.local.progress)
        counts = collections.Counter(n.payload for n in notes)
        assert counts == collections.Counter(payloads), (
            f"each notification must arrive exactly once; got {dict(counts)}"
        )
        assert notes[-1].digests["notify"] == digest(model), (
            "the last notification was delivered before all data landed"
        )

    def test_notification_after_large_transfer(self, env: _Env) -> None:
        env.need("write")
        env.need("notifications")
        n = type(self).large_transfer_bytes
        src, big = env.lbuf["big_src"], env.rbuf["big"]
        _randomize(src[GUARD : GUARD + n], env.rng)
        env.remote.notifications(timeout=0)
        stride = 4096  # sample every page: a copy that takes microseconds, not a full hash
        env.remote.watch("big", True, GUARD, n, stride=stride)
        payload = f"large-{uuid.uuid4().hex}".encode()
        try:
            with env.prepared(_table(_addr(src), [GUARD], n), _table(big.addr, [GUARD], n)) as p:
                env.run(XferOp.WRITE, p, [0], [0], notification=payload)
            notes = env.remote.notifications(
                timeout=env.timeout, expect=1, progress=env.local.progress
            )
        finally:
            env.remote.watch("big", False)
        assert [n.payload for n in notes] == [payload]
        assert notes[0].digests["big"] == sampled_digest(src[GUARD : GUARD + n], stride), (
            f"the notification of a {n} B WRITE was delivered before all of its data landed"
        )
