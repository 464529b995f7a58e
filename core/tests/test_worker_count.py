"""How many transfer workers a prefill rank runs: the operator's ``num_workers``, else the
backend's own number (``TransferBackend.workers_wanted``: ``cudaipc`` asks for one), else
four. A backend list asks for a number only when every member wants the same."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvwire import plugins
from kvwire.backends.tcp import TcpBackend
from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import ModelSpec, RankPosition
from kvwire.session import KVManager, Role
from kvwire.session.context import DEFAULT_WORKERS
from kvwire.testing import flaky
from kvwire.testing.kvfill import make_pool

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
