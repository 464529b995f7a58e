"""Transfer metrics: per request (returned to the engine) and per process (Prometheus).

Process metrics use ``prometheus-client`` (the de-facto standard exposition library, with
thread-safe counters and histograms) in its default registry, labelled by role and agent so that
several managers in one process stay apart. :func:`serve_metrics` exposes them over HTTP.

The per-chunk series a transfer worker adds to for every chunk (bytes, descriptors, chunks by
result and the queue, post and transfer histograms) are kept by :class:`_ChunkFamilies`
instead: plain numbers per worker thread, summed when the registry is scraped. Through
``prometheus-client`` they cost the worker about 38 Python calls and ten locked increments per
chunk (a mutex per counter, and per histogram a bucket and a sum), an eighth of its calls per
request; a worker's own numbers need neither. The request series a room table adds to when a
request ends (and its rooms tracked) are kept the same way by :class:`RoomCounts`, written
under the table's lock.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from prometheus_client import REGISTRY, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_LABELS = ("role", "agent")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)

DROPPED = Counter("kvwire_control_dropped", "Control frames dropped", (*_LABELS, "reason"))
EVICTIONS = Counter("kvwire_peer_evictions", "Peers evicted (dead or gone)", _LABELS)
FAILED_PAGES = Counter(
    "kvwire_failed_request_pages",
    "Decode pages of failed receives, by their failure report: 'kept' (landed whole from every "
    "source) or 'missing' (to recompute)",
    (*_LABELS, "result"),
)
RECEIVE_FAILURES = Counter(
    "kvwire_receive_failures",
    "Failed receives on decode by their failure report's cause (e.g. 'checksum_mismatch': KV "
    "or buffer-group bytes that differ from what prefill summed; docs/integrity.md)",
    (*_LABELS, "cause"),
)
FAILOVERS = Counter(
    "kvwire_transport_failovers",
    "Links moved from a failed backend to a fallback (docs/failover.md)",
    (*_LABELS, "src", "dst"),
)
RECOVERIES = Counter(
    "kvwire_transport_recoveries",
    "Links moved back to a backend that reconnected after a failure",
    (*_LABELS, "backend"),
)
GIL_LOWERINGS = Counter(
    "kvwire_gil_lowerings",
    "Times this manager lowered the GIL switch interval, its threads seen starved (kvwire.gil)",
    _LABELS,
)
GIL_SWITCH_INTERVAL = Gauge(
    "kvwire_gil_switch_interval_seconds",
    "The process's GIL switch interval as this manager last set or found it",
    _LABELS,
)
QUEUED_CHUNKS = Gauge(
    "kvwire_queued_chunks", "Chunks queued for or in the transfer workers (prefill)", _LABELS
)

_served: dict[int, bool] = {}
_served_lock = threading.Lock()


class _ChunkAcc:
    """One worker thread's per-chunk numbers for one label set (written by that thread only;
    read, unlocked, when the registry is scraped: a read may miss the chunk being added)."""

    __slots__ = ("bytes", "descs", "hist", "labels", "ok", "sums")

    def __init__(self, labels: tuple[str, str]) -> None:
        self.labels = labels
        self.bytes = 0
        self.descs = 0
        self.ok = 0
        # queue, post, transfer: a count per bucket (the last: above every bound), and sums
        self.hist = [[0] * (len(_LATENCY_BUCKETS) + 1) for _ in range(3)]
        self.sums = [0.0, 0.0, 0.0]


class _Labelled(Protocol):
    labels: tuple[str, str]


A = TypeVar("A", bound=_Labelled)


class _Accumulated(Collector, Generic[A]):
    """A collector of accumulators (plain numbers each, written by one owner without a lock),
    summed at scrape time. Accumulators are added under a lock and kept for the process's
    life, as ``prometheus-client`` keeps labelled children."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accs: list[A] = []

    def add(self, acc: A) -> None:
        with self._lock:
            self._accs.append(acc)

    def _grouped(self, extra: Iterable[tuple[str, str]] = ()) -> dict[tuple[str, str], list[A]]:
        """The accumulators by label set (``extra`` label sets present even without one)."""
        with self._lock:
            accs = list(self._accs)
        by: dict[tuple[str, str], list[A]] = {k: [] for k in extra}
        for a in accs:
            by.setdefault(a.labels, []).append(a)
        return by


def _summed(hists: Iterable[list[int]]) -> list[tuple[str, float]]:
    """Histograms' bucket counts (a count per bucket, the last above every bound) added up,
    as the exposition wants them: (bound, count at or below it)."""
    counts = [sum(col) for col in zip(*hists, strict=True)] or [0] * (len(_LATENCY_BUCKETS) + 1)
    total, out = 0, []
    for bound, n in zip((*map(floatToGoString, _LATENCY_BUCKETS), "+Inf"), counts, strict=True):
        total += n
        out.append((bound, float(total)))
    return out


class _ChunkFamilies(_Accumulated[_ChunkAcc]):
    """The per-chunk series (see the module's docstring): one accumulator per worker thread
    and label set."""

    _HISTS = (
        ("kvwire_chunk_queue_seconds", "Chunk wait in a worker queue"),
        ("kvwire_chunk_post_seconds", "Mapping plus submit of a chunk"),
        ("kvwire_chunk_transfer_seconds", "Submit to completion of a chunk"),
    )

    def __init__(self) -> None:
        super().__init__()
        #: Failed chunk transfers by label set (rare: counted under the lock).
        self._failed: dict[tuple[str, str], int] = {}

    def failed(self, labels: tuple[str, str]) -> None:
        with self._lock:
            self._failed[labels] = self._failed.get(labels, 0) + 1

    def describe(self) -> Iterator[Any]:
        return self._families({}, {})

    def collect(self) -> Iterator[Any]:
        with self._lock:
            failed = dict(self._failed)
        return self._families(self._grouped(failed), failed)

    def _families(
        self, by: dict[tuple[str, str], list[_ChunkAcc]], failed: dict[tuple[str, str], int]
    ) -> Iterator[Any]:
        nbytes = CounterMetricFamily(
            "kvwire_transfer_bytes", "KV and aux bytes moved by this rank", labels=_LABELS
        )
        descs = CounterMetricFamily(
            "kvwire_transfer_descriptors", "Descriptors submitted", labels=_LABELS
        )
        chunks = CounterMetricFamily(
            "kvwire_chunks", "Chunk transfers by result", labels=(*_LABELS, "result")
        )
        hists = [HistogramMetricFamily(n, h, labels=_LABELS) for n, h in self._HISTS]
        for labels, group in by.items():
            nbytes.add_metric(list(labels), sum(a.bytes for a in group))
            descs.add_metric(list(labels), sum(a.descs for a in group))
            chunks.add_metric([*labels, "ok"], sum(a.ok for a in group))
            if labels in failed:
                chunks.add_metric([*labels, "failed"], failed[labels])
            for i, fam in enumerate(hists):
                hist = _summed(a.hist[i] for a in group)
                fam.add_metric(list(labels), hist, sum(a.sums[i] for a in group))
        yield nbytes
        yield descs
        yield chunks
        yield from hists


_CHUNK_FAMILIES = _ChunkFamilies()
REGISTRY.register(_CHUNK_FAMILIES)


class RoomCounts:
    """One room table's request series: requests by terminal status, the time from a request's
    start to it, and the rooms tracked. Written under the table's lock (so plain numbers);
    read, unlocked, when the registry is scraped."""

    __slots__ = ("active", "hist", "labels", "results", "sum")

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = (labels["role"], labels["agent"])
        self.active = 0
        self.results: dict[str, int] = {}
        self.hist = [0] * (len(_LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        _ROOM_FAMILIES.add(self)

    def finished(self, result: str, seconds: float) -> None:
        """Under the room table's lock: one request reached ``result`` after ``seconds``."""
        self.results[result] = self.results.get(result, 0) + 1
        self.hist[bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds


class _RoomFamilies(_Accumulated[RoomCounts]):
    """``kvwire_requests_total{result}``, ``kvwire_request_seconds`` and
    ``kvwire_active_rooms`` from every :class:`RoomCounts` (counts of one label set add up,
    its gauge is the newest table's)."""

    def describe(self) -> Iterator[Any]:
        return self._families({})

    def collect(self) -> Iterator[Any]:
        return self._families(self._grouped())

    def _families(self, by: dict[tuple[str, str], list[RoomCounts]]) -> Iterator[Any]:
        requests = CounterMetricFamily(
            "kvwire_requests", "Requests by terminal status", labels=(*_LABELS, "result")
        )
        seconds = HistogramMetricFamily(
            "kvwire_request_seconds",
            "Request start to terminal status on this rank",
            labels=_LABELS,
        )
        active = GaugeMetricFamily("kvwire_active_rooms", "Rooms currently tracked", labels=_LABELS)
        for labels, group in by.items():
            results: dict[str, int] = {}
            for a in group:
                for r, n in list(a.results.items()):
                    results[r] = results.get(r, 0) + n
            for r, n in sorted(results.items()):
                requests.add_metric([*labels, r], n)
            hist = _summed(a.hist for a in group)
            seconds.add_metric(list(labels), hist, sum(a.sum for a in group))
            active.add_metric(list(labels), group[-1].active)
        yield requests
        yield seconds
        yield active


_ROOM_FAMILIES = _RoomFamilies()
REGISTRY.register(_ROOM_FAMILIES)


def chunk_failed(labels: dict[str, str]) -> None:
    """Transfer worker: one chunk transfer of the rank labelled ``labels`` failed
    (``kvwire_chunks_total{result="failed"}``)."""
    _CHUNK_FAMILIES.failed((labels["role"], labels["agent"]))


class ChunkMetrics:
    """One rank's per-chunk metrics (the series of :class:`_ChunkFamilies`), in an
    accumulator per worker thread."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = (labels["role"], labels["agent"])
        self._local = threading.local()

    def observe(self, done: ChunkDone) -> None:
        """Transfer worker: one completed chunk transfer (into this thread's accumulator: no
        lock, a handful of additions)."""
        acc: _ChunkAcc | None = getattr(self._local, "acc", None)
        if acc is None:
            acc = self._local.acc = _ChunkAcc(self.labels)
            _CHUNK_FAMILIES.add(acc)
        acc.bytes += done.num_bytes
        acc.descs += done.num_descs
        acc.ok += 1
        hist, sums = acc.hist, acc.sums
        if done.t_enqueued is not None:
            v = done.t_start - done.t_enqueued
            hist[0][bisect_left(_LATENCY_BUCKETS, v)] += 1
            sums[0] += v
        v = done.t_posted - done.t_start
        hist[1][bisect_left(_LATENCY_BUCKETS, v)] += 1
        sums[1] += v
        v = done.t_done - done.t_posted
        hist[2][bisect_left(_LATENCY_BUCKETS, v)] += 1
        sums[2] += v


@dataclass(frozen=True)
class ChunkDone:
    """One completed chunk transfer, as a transfer worker accounts it: its bytes and rows, and
    when it was taken (``t_start``), posted and done (``time.perf_counter()``), and queued
    (``t_enqueued``; None for the aux row and group transfers)."""

    num_bytes: int
    num_descs: int
    t_start: float
    t_posted: float
    t_done: float
    t_enqueued: float | None

    @property
    def queue_s(self) -> float | None:
        """Waiting for a worker."""
        return None if self.t_enqueued is None else self.t_start - self.t_enqueued

    @property
    def post_s(self) -> float:
        """Mapping pages and submitting."""
        return self.t_posted - self.t_start

    @property
    def transfer_s(self) -> float:
        """Submit to completion."""
        return self.t_done - self.t_posted


def serve_metrics(port: int, addr: str = "127.0.0.1") -> None:
    """Serve the process's metrics at ``http://addr:port/metrics`` (once per port)."""
    with _served_lock:
        if port not in _served:
            start_http_server(port, addr=addr)
            _served[port] = True


@dataclass
class RequestMetrics:
    """What one request cost on this rank; read by the engine through ``metrics()``.

    Times are sums over the request's chunks, in seconds: ``queue_s`` waiting for a worker,
    ``post_s`` mapping pages and submitting, ``transfer_s`` from submit to completion.
    """

    bytes: int = 0
    descriptors: int = 0
    chunks: int = 0
    queue_s: float = 0.0
    post_s: float = 0.0
    transfer_s: float = 0.0
    #: Start (sender/receiver creation) to terminal status; 0 until terminal.
    total_s: float = 0.0
    #: When the request last reached each stage on this rank, as ``time.perf_counter()``
    #: values (CLOCK_MONOTONIC on Linux: comparable across the processes of one host).
    #: Prefill: ``asked`` (every decode rank's request is in), ``taken`` (a worker took the
    #: last chunk), ``planned`` (its plan is ready: staging space granted, block gathered),
    #: ``posted`` (last write submitted), ``done`` (last write completed),
    #: ``success``. Decode: ``requested`` (the transfer request left), ``noted`` (the last
    #: chunk or aux note was handled), ``success``. Written by whichever thread reaches the
    #: stage (one dict store each); read by the engine once the request is terminal.
    marks: dict[str, float] = field(default_factory=dict)

    def add_transfer(self, done: ChunkDone) -> None:
        """Transfer worker, under the room lock: account one completed chunk transfer."""
        self.bytes += done.num_bytes
        self.descriptors += done.num_descs
        self.chunks += 1
        if done.t_enqueued is not None:  # the properties' sums, without their calls
            self.queue_s += done.t_start - done.t_enqueued
        self.post_s += done.t_posted - done.t_start
        self.transfer_s += done.t_done - done.t_posted
