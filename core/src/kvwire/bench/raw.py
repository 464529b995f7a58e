"""The raw side of ``kvwire bench``: the backend alone, no kvwire control plane.

:class:`RawBench` builds the mapper's tables once against a
:class:`~kvwire.testing.remote.RemoteAgent` target in a spawned child, computes every request's
index arrays (``map_chunk`` of random pages) before timing, and keeps up to ``concurrency``
WRITEs in flight (submit, progress, poll, release): the engine calls kvwire makes for the same
pages, without the requests around them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwire.backend import XferOp, XferState
from kvwire.bench.common import MODEL, Advance, BenchError, Check, Run
from kvwire.config import KVWireConfig
from kvwire.layout import KVLayout, MemoryRegion, ModelSpec, RankPosition
from kvwire.selection import create_backend
from kvwire.session.handshake import build_mapper
from kvwire.testing.kvfill import make_pool
from kvwire.testing.remote import RemoteAgent, digest

logger = logging.getLogger(__name__)

#: Longest the raw loop sleeps between polls while WRITEs are in flight (kvwire's workers
#: back off between 20 and 200 us).
POLL_SLEEP_S = 0.0001


class RawBench:
    """The backend alone: tables prepared once against a :class:`RemoteAgent` target.

    :meth:`start` spawns the target without waiting; :meth:`open` waits for it and prepares.
    """

    def __init__(
        self, config: KVWireConfig, slots: int, model: ModelSpec = MODEL, seed: int = 12345
    ) -> None:
        self.config = config
        self.slots = slots
        self.model = model
        self.rng = np.random.default_rng(seed)
        self.layout, self.arrays = make_pool(model, RankPosition(), slots)
        self.agent = RemoteAgent(
            config.transfer_backend, config.transfer_backend_options, "bench-raw-target"
        )
        self.backend: Any = None
        self.pair: Any = None

    def start(self) -> None:
        self.agent.start()

    def open(self) -> None:
        """Fill the source, allocate the target, build and prepare the tables."""
        for arr in self.arrays:
            arr[:] = self.rng.integers(-(2**31), 2**31 - 1, size=arr.shape, dtype=np.int32)
        self.agent.wait_ready()
        self.buf_bytes = self.layout.buffers[0].length
        item = self.layout.buffers[0].item_len
        # One buffer (one registered region) per KV buffer, as a decode rank's pool has:
        # the engine then resolves descriptors against as many remote regions as kvwire's.
        remote = [
            self.agent.allocate(f"kv{i}", self.buf_bytes, None, watch=False)
            for i in range(len(self.arrays))
        ]
        dst = KVLayout(
            model=self.model,
            buffers=tuple(MemoryRegion.from_pointer(r.addr, self.buf_bytes, item) for r in remote),
        )
        self.backend = create_backend(self.config, "bench-raw-initiator")
        self.backend.register(list(self.layout.buffers))
        peer = self.backend.add_peer(self.agent.metadata())
        self.mapper = build_mapper(self.config, self.layout, dst)
        tables = self.mapper.build_tables()
        self.pair = self.backend.prepare(peer, tables.src, tables.dst)

    def warm_up(self, step: int) -> None:
        """Write every slot once, so the target's pages are touched before timing."""
        every = np.arange(self.slots, dtype=np.int64)
        for lo in range(0, self.slots, step):
            idx = self.mapper.map_chunk(every[lo : lo + step], every[lo : lo + step])
            submit_all(self.backend, self.pair, [idx], 1, 1)

    def batch(
        self, pages: int, concurrency: int, n: int, advance: Advance
    ) -> tuple[Run, Check, list[str]]:
        """``n`` requests of ``pages`` random pages with ``concurrency`` in flight, then the
        target's pages checked against the source."""
        span = pages * concurrency
        # Fresh source bytes in the window, so stale target bytes cannot pass the check.
        salt = np.int32(self.rng.integers(1, 2**31 - 1))
        for arr in self.arrays:
            arr[:span] ^= salt
        src = self.rng.permutation(span).astype(np.int64)
        dst = self.rng.permutation(span).astype(np.int64)
        blocks = [
            self.mapper.map_chunk(
                src[b * pages : (b + 1) * pages], dst[b * pages : (b + 1) * pages]
            )
            for b in range(concurrency)
        ]
        t0 = time.perf_counter()
        lat, nbytes, ndesc = submit_all(self.backend, self.pair, blocks, n, concurrency, advance)
        wall = time.perf_counter() - t0
        self.agent.notifications(timeout=0)  # drain the child's list
        item = self.layout.buffers[0].item_len
        want = []
        for arr in self.arrays:
            expected = np.empty_like(arr[:span])
            expected[dst] = arr[src]
            want.append(digest(expected))
        got = [self.agent.digest(f"kv{i}", 0, span * item) for i in range(len(self.arrays))]
        good = n if got == want else 0
        problems = [] if good else [f"raw pages={pages} C={concurrency}: target pages differ"]
        run = Run("raw", pages, concurrency, n, len(lat), nbytes, ndesc, wall, lat)
        run.request_bytes = pages * item * len(self.arrays)
        check = Check("raw", pages, concurrency, n, good, "target pages digested after the batch")
        return run, check, problems

    def close(self) -> None:
        if self.backend is not None and not self.backend.closed:
            with contextlib.suppress(Exception):
                if self.pair is not None:
                    self.backend.release_prepared(self.pair)
            self.backend.close()
        self.agent.close()


def submit_all(
    backend: Any,
    pair: Any,
    blocks: Sequence[tuple[Any, Any]],
    n: int,
    concurrency: int,
    advance: Advance | None = None,
) -> tuple[list[float], int, int]:
    """Submit ``n`` WRITEs keeping up to ``concurrency`` in flight; each uses the index arrays
    of a free block (so no two in-flight writes share a target page). Returns the latencies,
    the bytes and the descriptors of one request."""
    free = list(range(min(concurrency, len(blocks))))
    inflight: list[tuple[Any, int, float]] = []
    lat: list[float] = []
    nbytes = ndesc = submitted = 0
    while len(lat) < n:
        while free and submitted < n:
            b = free.pop()
            s_idx, d_idx = blocks[b]
            t0 = time.perf_counter()  # before submit: an engine may copy inside it (UCX cma)
            h = backend.submit(XferOp.WRITE, pair, s_idx, d_idx, b"bench-%d" % submitted)
            inflight.append((h, b, t0))
            submitted += 1
        backend.progress()
        finished = 0
        for entry in list(inflight):
            h, b, t0 = entry
            st = backend.poll(h)
            if st is XferState.PENDING:
                continue
            t1 = time.perf_counter()
            inflight.remove(entry)
            backend.release(h)
            if st is not XferState.DONE:
                raise BenchError(f"raw WRITE failed: {h.error or st.name}")
            lat.append(t1 - t0)
            nbytes += h.num_bytes
            ndesc = h.num_descs
            free.append(b)
            finished += 1
        if finished and advance is not None:
            advance(finished)
        if not finished:
            time.sleep(POLL_SLEEP_S)
    return lat, nbytes, ndesc
