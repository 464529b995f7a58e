"""kvwire lowers the interpreter's GIL switch interval (``control.gil_switch_interval_us``):
only ever lowers it, leaves it alone when told, and a manager applies it when built.

Why it matters (a busy engine thread holds kvwire's threads up to a switch interval at every
step) is measured on a GPU host, not here: docs/benchmarks.md, "A busy engine thread"."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import pytest

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.gil import apply_switch_interval
from kvwire.layout import RankPosition
from kvwire.session import KVManager, Role
from kvwire.testing.kvfill import make_pool
from kvwire.testing.pair import MODEL, config


@pytest.fixture(autouse=True)
def interval() -> Iterator[None]:
    """Every test starts at the interpreter's default and leaves the process as it was."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_lowers_a_longer_interval_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvwire.gil"):
        got = apply_switch_interval(100.0, "rank-a")
    assert got == pytest.approx(100e-6)
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    assert "rank-a" in caplog.text and "5.000 ms -> 0.100 ms" in caplog.text


def test_keeps_a_shorter_interval_the_engine_chose(caplog: pytest.LogCaptureFixture) -> None:
    sys.setswitchinterval(50e-6)
    with caplog.at_level(logging.INFO, logger="kvwire.gil"):
        assert apply_switch_interval(100.0, "rank-a") == pytest.approx(50e-6)
    assert sys.getswitchinterval() == pytest.approx(50e-6)
    assert not caplog.text


def test_none_leaves_it_alone() -> None:
    assert apply_switch_interval(None, "rank-a") == pytest.approx(0.005)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_option_is_validated() -> None:
    assert ControlOptions().gil_switch_interval_us == 100.0
    assert ControlOptions(gil_switch_interval_us=None).gil_switch_interval_us is None
    with pytest.raises(ValueError):
        ControlOptions(gil_switch_interval_us=0)
    with pytest.raises(ValueError):
        ControlOptions(gil_switch_interval_us=-5)


@pytest.mark.parametrize("us", [250.0, None])
def test_a_manager_applies_its_option(us: float | None) -> None:
    cfg: KVWireConfig = config()
    cfg = cfg.model_copy(
        update={"control": cfg.control.model_copy(update={"gil_switch_interval_us": us})}
    )
    lay, _ = make_pool(MODEL, RankPosition(), 8)
    with KVManager(cfg, Role.DECODE, lay):
        want = 0.005 if us is None else us / 1e6
        assert sys.getswitchinterval() == pytest.approx(want)
