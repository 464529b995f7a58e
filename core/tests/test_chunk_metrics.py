"""The per-chunk Prometheus series (``kvwire.session.metrics``): kept as plain numbers per
worker thread and summed at scrape time, they must read exactly as ``prometheus-client``'s own
counters and histograms fed the same chunks would (names, labels, bucket bounds, cumulative
counts, sums), from every thread that added to them, and apart per label set."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from kvwire.session import metrics as m


def _done(i: int) -> m.ChunkDone:
    # times spread over every bucket, the first and last beyond the bounds' ends
    t0 = 100.0 + i
    queue = None if i % 5 == 0 else 0.0001 * (3**i % 200_000)
    post = [0.0002, 0.0005, 0.003, 0.07, 0.9, 20.0][i % 6]
    transfer = 0.00007 * (i + 1) ** 2
    return m.ChunkDone(
        num_bytes=1000 + i,
        num_descs=3 + i % 4,
        t_start=t0,
        t_posted=t0 + post,
        t_done=t0 + post + transfer,
        t_enqueued=None if queue is None else t0 - queue,
    )


def _samples(registry: object, prefix: str, agent: str) -> dict[tuple[str, ...], float]:
    """Every sample of ``agent`` whose name starts with ``prefix`` (not the creation stamps
    ``prometheus-client`` adds), by (name, bucket bound, result)."""
    out = {}
    for fam in registry.collect():  # type: ignore[attr-defined]
        for s in fam.samples:
            mine = s.name.startswith(prefix) and s.labels.get("agent") == agent
            if mine and not s.name.endswith("_created"):
                out[(s.name, s.labels.get("le", ""), s.labels.get("result", ""))] = s.value
    return out


def test_chunk_series_read_as_prometheus_own_would() -> None:
    agent = "metrics-test-a"
    cm = m.ChunkMetrics({"role": "prefill", "agent": agent})
    other = m.ChunkMetrics({"role": "prefill", "agent": "metrics-test-b"})
    chunks = [_done(i) for i in range(60)]
    # three worker threads, each adding a third (each gets an accumulator of its own)
    threads = [
        threading.Thread(target=lambda k=k: [cm.observe(d) for d in chunks[k::3]]) for k in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    other.observe(_done(7))  # another label set stays apart
    m.chunk_failed({"role": "prefill", "agent": agent})
    m.chunk_failed({"role": "prefill", "agent": agent})
    # the same chunks through prometheus-client's own metrics, in a registry of their own
    reg = CollectorRegistry()
    labels = ("role", "agent")
    nbytes = Counter("kvwire_transfer_bytes", "b", labels, registry=reg)
    result = Counter("kvwire_chunks", "c", (*labels, "result"), registry=reg)
    result.labels("prefill", agent, "failed").inc(2)
    descs = Counter("kvwire_transfer_descriptors", "d", labels, registry=reg)
    hists = [
        Histogram(n, "h", labels, registry=reg, buckets=m._LATENCY_BUCKETS)
        for n in ("kvwire_chunk_queue_seconds", "kvwire_chunk_post_seconds",
                  "kvwire_chunk_transfer_seconds")
    ]  # fmt: skip
    for d in chunks:
        nbytes.labels("prefill", agent).inc(d.num_bytes)
        result.labels("prefill", agent, "ok").inc()
        descs.labels("prefill", agent).inc(d.num_descs)
        if d.queue_s is not None:
            hists[0].labels("prefill", agent).observe(d.queue_s)
        hists[1].labels("prefill", agent).observe(d.post_s)
        hists[2].labels("prefill", agent).observe(d.transfer_s)
    for prefix in ("kvwire_transfer_", "kvwire_chunk"):
        got = _samples(REGISTRY, prefix, agent)
        want = _samples(reg, prefix, agent)
        assert set(got) == set(want), set(got) ^ set(want)
        for k, v in want.items():
            assert got[k] == pytest.approx(v), k
    assert REGISTRY.get_sample_value(
        "kvwire_transfer_bytes_total", {"role": "prefill", "agent": agent}
    ) == sum(d.num_bytes for d in chunks)
    for res, n in (("ok", len(chunks)), ("failed", 2)):
        want_n = REGISTRY.get_sample_value(
            "kvwire_chunks_total", {"role": "prefill", "agent": agent, "result": res}
        )
        assert want_n == n, (res, want_n)
    b = _samples(REGISTRY, "kvwire_chunk_post_seconds_count", "metrics-test-b")
    assert b == {("kvwire_chunk_post_seconds_count", "", ""): 1.0}


def test_observe_takes_no_lock_and_few_calls() -> None:
    """A chunk costs the worker the observe call and a few additions into its thread's
    accumulator, not a call chain per series (before: about 38 Python calls per chunk)."""
    import sys

    cm = m.ChunkMetrics({"role": "prefill", "agent": "metrics-test-calls"})
    cm.observe(_done(1))  # the thread's accumulator is made on its first chunk
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    d = _done(2)
    sys.setprofile(count)
    try:
        cm.observe(d)
    finally:
        sys.setprofile(None)
    assert calls <= 2, calls


def test_request_series_read_as_prometheus_own_would() -> None:
    """``kvwire_requests_total{result}``, ``kvwire_request_seconds`` and
    ``kvwire_active_rooms`` of a room table (its own numbers, written under its lock) read as
    ``prometheus-client``'s own counter, histogram and gauge given the same requests; two
    tables of one label set add up, and the gauge is the newest table's."""
    agent = "metrics-test-rooms"
    labels = {"role": "decode", "agent": agent}
    first, second = m.RoomCounts(labels), m.RoomCounts(labels)
    times = [0.0001 * 3**i for i in range(14)]  # across every bucket, past the last bound
    reg = CollectorRegistry()
    req = Counter("kvwire_requests", "r", ("role", "agent", "result"), registry=reg)
    sec = Histogram(
        "kvwire_request_seconds", "s", ("role", "agent"), registry=reg, buckets=m._LATENCY_BUCKETS
    )
    for i, t in enumerate(times):
        result = "Success" if i % 4 else "Failed"
        (first if i % 2 else second).finished(result, t)
        req.labels("decode", agent, result).inc()
        sec.labels("decode", agent).observe(t)
    first.active, second.active = 7, 3
    for prefix in ("kvwire_requests", "kvwire_request_seconds"):
        got, want = _samples(REGISTRY, prefix, agent), _samples(reg, prefix, agent)
        assert set(got) == set(want), set(got) ^ set(want)
        for k, v in want.items():
            assert got[k] == pytest.approx(v), k
    assert REGISTRY.get_sample_value("kvwire_active_rooms", labels) == 3


def test_a_room_tables_requests_are_counted() -> None:
    """A room table counts its requests' ends and rooms tracked into its series."""
    from kvwire.session.rooms import RoomTable

    labels = {"role": "prefill", "agent": "metrics-test-table"}

    class Room:
        def __init__(self, rid: int) -> None:
            self.room, self.error, self.failed_at = rid, None, 0.0
            self.t0 = 0.0
            self.metrics = m.RequestMetrics()

    table: RoomTable[Room] = RoomTable(labels)  # type: ignore[type-var]
    with table.lock:
        rooms = [table.create(Room(i)) for i in range(3)]
        table.succeed(rooms[0])
        table.fail(rooms[1], RuntimeError("x"))
        table.forget(rooms[0])
    get = REGISTRY.get_sample_value
    assert get("kvwire_requests_total", {**labels, "result": "Success"}) == 1
    assert get("kvwire_requests_total", {**labels, "result": "Failed"}) == 1
    assert get("kvwire_request_seconds_count", labels) == 2
    assert get("kvwire_active_rooms", labels) == 2
