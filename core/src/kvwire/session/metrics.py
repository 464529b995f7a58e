"""Transfer metrics: per request (returned to the engine) and per process (Prometheus).

Process metrics use ``prometheus-client`` (the de-facto standard exposition library, with
thread-safe counters and histograms) in its default registry, labelled by role and agent so that
several managers in one process stay apart. :func:`serve_metrics` exposes them over HTTP.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

_LABELS = ("role", "agent")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)

BYTES = Counter("kvwire_transfer_bytes", "KV and aux bytes moved by this rank", _LABELS)
DESCRIPTORS = Counter("kvwire_transfer_descriptors", "Descriptors submitted", _LABELS)
CHUNKS = Counter("kvwire_chunks", "Chunk transfers by result", (*_LABELS, "result"))
REQUESTS = Counter("kvwire_requests", "Requests by terminal status", (*_LABELS, "result"))
DROPPED = Counter("kvwire_control_dropped", "Control frames dropped", (*_LABELS, "reason"))
EVICTIONS = Counter("kvwire_peer_evictions", "Peers evicted (dead or gone)", _LABELS)
FAILED_PAGES = Counter(
    "kvwire_failed_request_pages",
    "Decode pages of failed receives, by their failure report: 'kept' (landed whole from every "
    "source) or 'missing' (to recompute)",
    (*_LABELS, "result"),
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
ACTIVE_ROOMS = Gauge("kvwire_active_rooms", "Rooms currently tracked", _LABELS)
QUEUED_CHUNKS = Gauge(
    "kvwire_queued_chunks", "Chunks queued for or in the transfer workers (prefill)", _LABELS
)
QUEUE_SECONDS = Histogram(
    "kvwire_chunk_queue_seconds", "Chunk wait in a worker queue", _LABELS, buckets=_LATENCY_BUCKETS
)
POST_SECONDS = Histogram(
    "kvwire_chunk_post_seconds", "Mapping plus submit of a chunk", _LABELS, buckets=_LATENCY_BUCKETS
)
TRANSFER_SECONDS = Histogram(
    "kvwire_chunk_transfer_seconds",
    "Submit to completion of a chunk",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
)
REQUEST_SECONDS = Histogram(
    "kvwire_request_seconds",
    "Request start to terminal status on this rank",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
)

_served: dict[int, bool] = {}
_served_lock = threading.Lock()


@dataclass(frozen=True)
class ChunkMetrics:
    """One rank's labelled children of the per-chunk metrics, looked up once (a ``labels()``
    call costs a few microseconds, six per chunk on the transfer path)."""

    bytes: Any
    descriptors: Any
    chunks_ok: Any
    queue_s: Any
    post_s: Any
    transfer_s: Any

    @classmethod
    def for_labels(cls, labels: dict[str, str]) -> ChunkMetrics:
        return cls(
            BYTES.labels(**labels),
            DESCRIPTORS.labels(**labels),
            CHUNKS.labels(**labels, result="ok"),
            QUEUE_SECONDS.labels(**labels),
            POST_SECONDS.labels(**labels),
            TRANSFER_SECONDS.labels(**labels),
        )

    def observe(self, done: ChunkDone) -> None:
        """Transfer worker: one completed chunk transfer (no lock: the children are
        thread-safe)."""
        self.bytes.inc(done.num_bytes)
        self.descriptors.inc(done.num_descs)
        self.chunks_ok.inc()
        if done.queue_s is not None:
            self.queue_s.observe(done.queue_s)
        self.post_s.observe(done.post_s)
        self.transfer_s.observe(done.transfer_s)


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
        if done.queue_s is not None:
            self.queue_s += done.queue_s
        self.post_s += done.post_s
        self.transfer_s += done.transfer_s
