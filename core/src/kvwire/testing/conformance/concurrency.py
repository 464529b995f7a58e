"""Several threads and processes at once: worker threads beside the owner loop and a handshake
thread; the other direction from a child."""

from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import Any

import numpy as np

from kvwire.backend import (
    PreparedPair,
    XferOp,
    XferState,
)
from kvwire.testing.conformance.common import (
    SMALL,
    SuiteBase,
    _addr,
    _apply_rows,
    _assert_bytes_equal,
    _check_state,
    _Env,
    _randomize,
    _table,
)
from kvwire.testing.remote import (
    digest,
)


class ConcurrencyConformance(SuiteBase):
    """Several threads and processes at once: worker threads beside the owner loop and a handshake
    thread; the other direction from a child. Part of
    :class:`~kvwire.testing.conformance.BackendConformance`."""

    def test_concurrent_submitters(self, env: _Env) -> None:
        env.need("write")
        b = env.local
        threads_n, rounds, rows, row = 4, 6, 128, 2048
        block = rows * row
        span = threads_n * rounds * block
        src, big = env.lbuf["big_src"], env.rbuf["big"]
        assert span <= big.nbytes and threads_n * block <= src.size
        base_handles, base_prepared = b.live_handles, b.live_prepared
        rng = env.rng
        # Remote rows: one block per (thread, round), rows shuffled within the block.
        order = [rng.permutation(rows) for _ in range(threads_n * rounds)]
        roff = np.concatenate([i * block + o * row for i, o in enumerate(order)])
        loff = np.arange(threads_n * rows, dtype=np.int64) * row
        local_rows = src[: threads_n * block].reshape(-1, row)  # a view: row i of the pair
        model = env.remote.read_array("big", 0, span)
        env.remote.notifications(timeout=0)
        stop = threading.Event()
        errors: list[BaseException] = []
        payloads: list[bytes] = []
        prepared_again = [0]
        lock = threading.Lock()

        def worker(k: int, pair: PreparedPair) -> None:
            wrng = np.random.default_rng(1000 + k)
            mine = src[k * block : (k + 1) * block]
            try:
                for j in range(rounds):
                    blk = k * rounds + j
                    _randomize(mine, wrng)
                    li = k * rows + wrng.permutation(rows)
                    ri = blk * rows + np.arange(rows)
                    expected = np.empty(block, dtype=np.uint8)
                    expected.reshape(rows, row)[order[blk]] = local_rows[li]
                    payload = f"mt-{k}-{j}-{uuid.uuid4().hex}".encode()
                    handle = b.submit(XferOp.WRITE, pair, li, ri, payload)
                    deadline = time.monotonic() + env.timeout
                    while (state := _check_state(b.poll(handle))) is XferState.PENDING:
                        assert time.monotonic() < deadline, f"thread {k} round {j} stuck"
                        time.sleep(0.0002)
                    assert state is XferState.DONE, f"thread {k} round {j}: {handle.error}"
                    b.release(handle)
                    with lock:
                        payloads.append(payload)
                        model[blk * block : (blk + 1) * block] = expected
                    got = env.remote.digest("big", blk * block, block)
                    assert got == digest(expected), f"thread {k} round {j}: bytes differ"
            except BaseException as exc:
                errors.append(exc)

        def owner() -> None:  # the session manager's progress thread
            try:
                while not stop.is_set():
                    b.progress()
                    b.get_notifications()
                    time.sleep(0.0005)
            except BaseException as exc:
                errors.append(exc)

        def handshake() -> None:  # another peer's handshake preparing its tables meanwhile
            other_l = _table(_addr(env.lbuf["src"]), np.arange(256) * 512, 512)
            other_r = _table(env.rbuf["dst"].addr, np.arange(256)[::-1] * 512, 512)
            try:
                while not stop.is_set():
                    pair = b.prepare(env.peer, other_l, other_r)
                    assert env.peer in b.peers()
                    b.release_prepared(pair)
                    prepared_again[0] += 1
                    time.sleep(0.002)
            except BaseException as exc:
                errors.append(exc)

        t0 = time.monotonic()
        with env.prepared(_table(_addr(src), loff, row), _table(big.addr, roff, row)) as pair:
            workers = [
                threading.Thread(target=worker, args=(k, pair), name=f"conformance-worker-{k}")
                for k in range(threads_n)
            ]
            helpers = [threading.Thread(target=owner), threading.Thread(target=handshake)]
            for t in helpers + workers:
                t.start()
            try:
                for t in workers:
                    t.join(max(0.1, t0 + env.timeout - time.monotonic()))
            finally:
                stop.set()
                for t in helpers:
                    t.join(env.timeout)
            alive = [t.name for t in workers + helpers if t.is_alive()]
            assert not alive, f"threads still running after {env.timeout:g}s: {alive}"
        if errors:
            raise errors[0]
        assert prepared_again[0] > 0, "the handshake thread never prepared a pair"
        assert len(payloads) == threads_n * rounds
        notes = env.remote.notifications(
            timeout=env.timeout, expect=len(payloads), progress=b.progress
        )
        notes += env.remote.notifications(timeout=0.3, progress=b.progress)
        counts = collections.Counter(n.payload for n in notes)
        assert counts == collections.Counter(payloads), (
            f"each notification must arrive exactly once; got {sum(counts.values())} for "
            f"{len(payloads)} transfers, duplicated: {[p for p, c in counts.items() if c > 1]}"
        )
        _assert_bytes_equal(env.remote.read_array("big", 0, span), model, "concurrent WRITEs")
        assert b.live_handles == base_handles, "concurrent submitters leaked handles"
        assert b.live_prepared == base_prepared, "concurrent prepares leaked pairs"

    def test_initiator_in_child(self, env: _Env) -> None:
        remote, local = env.remote, env.local
        inbox, src = env.lbuf["inbox"], env.lbuf["src"]
        me = remote.add_peer(local.local_metadata())
        assert me == local.agent_name
        rows, row = SMALL // 512, 256
        offs = np.arange(rows, dtype=np.int64) * 512
        local.get_notifications()  # nothing expected; start clean
        if env.caps.write:
            rsrc = env.remote.read_array("rsrc")
            model = inbox.copy()
            perm = env.rng.permutation(rows)
            _apply_rows(model, offs[perm] + 128, rsrc, offs, np.full(rows, row))
            pair = remote.prepare(
                me, _table(env.rbuf["rsrc"].addr, offs, row), _table(_addr(inbox), offs + 128, row)
            )
            payload = f"from-child-{uuid.uuid4().hex}".encode()
            notify = payload if env.caps.notifications else None
            hid = remote.submit(XferOp.WRITE, pair, np.arange(rows), perm, notify)
            state, error = remote.wait(hid, env.timeout, progress=local.progress)
            assert state is XferState.DONE, f"child-initiated WRITE ended {state!r}: {error}"
            remote.release(hid)
            if notify is not None:
                got: list[Any] = []
                deadline = time.monotonic() + env.timeout
                while not got and time.monotonic() < deadline:
                    local.progress()
                    got = local.get_notifications()
                    if got:  # snapshot the data at delivery time
                        at_delivery = inbox.copy()
                    else:
                        time.sleep(0.001)
                assert [(n.peer, n.payload) for n in got] == [(remote.agent_name, payload)]
                _assert_bytes_equal(at_delivery, model, "local buffer when the notification came")
            _assert_bytes_equal(inbox, model, "child-initiated WRITE")
            remote.release_prepared(pair)
        if env.caps.read:
            _randomize(src, env.rng)
            crdst = env.rbuf["dst"]
            model_r = env.remote.read_array("dst")
            perm = env.rng.permutation(rows)
            _apply_rows(model_r, offs[perm] + 64, src, offs, np.full(rows, row))
            pair = remote.prepare(
                me, _table(crdst.addr, offs + 64, row), _table(_addr(src), offs, row)
            )
            hid = remote.submit(XferOp.READ, pair, perm, np.arange(rows))
            state, error = remote.wait(hid, env.timeout, progress=local.progress)
            assert state is XferState.DONE, f"child-initiated READ ended {state!r}: {error}"
            remote.release(hid)
            remote.release_prepared(pair)
            _assert_bytes_equal(env.remote.read_array("dst"), model_r, "child-initiated READ")
        assert remote.attribute("live_handles") == 0
        remote.remove_peer(me)
