"""How many transfer workers a prefill rank runs: the operator's ``num_workers``, else the
backend's own number (``TransferBackend.workers_wanted``: ``cudaipc`` asks for one), else
four. A backend list asks for a number only when every member wants the same."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvwire import plugins
from kvwire.backends.tcp import TcpBackend
from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec, RankPosition
from kvwire.session import KVManager, Role
from kvwire.session.context import DEFAULT_WORKERS
from kvwire.session.prefill.workers import ONE_WORKER, shard_for
from kvwire.testing import flaky
from kvwire.testing.kvfill import make_pool
from kvwire.testing.pair import Pair

MODEL = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype="int32", page_size=4)


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process registry with the ``flaky`` test backend (a second tcp) added."""
    monkeypatch.setattr(plugins, "_registry", plugins.PluginRegistry(extra=[("flaky", flaky)]))
    yield


def worker_threads(backend: str, num_workers: int | None) -> tuple[int, int]:
    """A prefill manager's resolved worker count and its worker threads."""
    layout, _ = make_pool(MODEL, RankPosition(), 4)
    cfg = KVWireConfig(transfer_backend=backend, control=ControlOptions(num_workers=num_workers))
    mgr = KVManager(cfg, Role.PREFILL, layout)
    try:
        side = mgr.side
        return mgr.ctx.num_workers, len(side.workers._threads)  # type: ignore[union-attr]
    finally:
        mgr.close()


def test_without_a_number_the_rank_runs_the_default_over_a_backend_that_wants_none() -> None:
    assert TcpBackend.suggested_workers is None
    assert worker_threads("tcp", None) == (DEFAULT_WORKERS, DEFAULT_WORKERS)


def test_a_backend_that_wants_one_worker_gets_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TcpBackend, "suggested_workers", 1)
    assert worker_threads("tcp", None) == (1, 1)


def test_the_operators_number_wins_over_the_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TcpBackend, "suggested_workers", 1)
    assert worker_threads("tcp", 3) == (3, 3)


@pytest.mark.parametrize(("tcp_wants", "flaky_wants", "got"), [(1, 1, 1), (1, None, 4), (2, 1, 4)])
def test_a_backend_list_asks_only_when_its_members_agree(
    monkeypatch: pytest.MonkeyPatch, tcp_wants: int | None, flaky_wants: int | None, got: int
) -> None:
    monkeypatch.setattr(TcpBackend, "suggested_workers", tcp_wants)
    monkeypatch.setattr(flaky.FlakyTcpBackend, "suggested_workers", flaky_wants)
    assert worker_threads("flaky,tcp", None) == (got, got)


def test_num_workers_is_still_checked() -> None:
    for bad in (0, 257):
        with pytest.raises(ValueError, match="num_workers"):
            ControlOptions(num_workers=bad)


def shard_keys(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The queue key of every job prefill's workers are handed (recorded, then queued)."""
    from kvwire.session.prefill.workers import TransferWorkers

    keys: list[str] = []
    submit = TransferWorkers.submit

    def record(self: Any, shard_key: str, job: Any, *, sticky: bool = False) -> None:
        keys.append(shard_key)
        submit(self, shard_key, job, sticky=sticky)

    monkeypatch.setattr(TransferWorkers, "submit", record)
    return keys


@pytest.mark.parametrize("num_workers", [None, 4])
def test_a_link_whose_backend_wants_one_worker_keeps_every_chunk_on_one_queue(
    monkeypatch: pytest.MonkeyPatch, num_workers: int | None
) -> None:
    """``flaky,tcp`` on prefill (members disagree: four workers), ``tcp`` on decode, so the
    link runs over tcp; tcp wants one worker here. Every chunk of every request then goes to
    one queue, unless the operator set ``num_workers`` (then per request, as before); every
    request lands whole either way."""
    monkeypatch.setattr(TcpBackend, "suggested_workers", 1)
    monkeypatch.setattr(flaky.FlakyTcpBackend, "suggested_workers", None)
    keys = shard_keys(monkeypatch)
    control = {"heartbeat_interval_s": 0.5, "num_workers": num_workers}
    p = Pair(
        KVWireConfig(transfer_backend="flaky,tcp", control=ControlOptions(**control)),
        KVWireConfig(transfer_backend="tcp", control=ControlOptions(heartbeat_interval_s=0.5)),
    )
    try:
        assert p.prefill.ctx.num_workers == 4  # the members disagree: the rank's default
        for room in range(1, 5):
            p.transfer(room)  # two chunks each, every element checked
    finally:
        p.close()
    assert len(keys) == 8
    if num_workers is None:
        assert set(keys) == {ONE_WORKER}
    else:
        assert len(set(keys)) == 4 and ONE_WORKER not in keys  # one queue per request


def test_shard_for_keeps_staged_links_per_destination_and_others_per_request() -> None:
    assert shard_for("d1", 7, staged=True, one_worker=True) == "d1"
    assert shard_for("d1", 7, staged=False, one_worker=False) == "d1/7"
    assert shard_for("d1", 7, staged=False, one_worker=True) == ONE_WORKER


def test_the_startup_log_names_the_worker_count_and_where_it_came_from(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TcpBackend, "suggested_workers", 1)
    with caplog.at_level("INFO", logger="kvwire.session.manager"):
        worker_threads("tcp", None)
        worker_threads("tcp", 3)
    ups = [r.getMessage() for r in caplog.records if "manager up" in r.getMessage()]
    assert "1 transfer workers (the backend's number, else 4)" in ups[0]
    assert "3 transfer workers (num_workers)" in ups[1]
