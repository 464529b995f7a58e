"""kvwire's GIL switch interval policy (``control.gil_switch``, ``kvwire.gil``): ``auto``
lowers the interval only once the liveness thread's idle waits come back late (an engine
thread holding the GIL), ``always`` at start, ``never`` not at all; an interval the engine
chose shorter is kept.

Why it matters (a busy engine thread holds kvwire's threads up to a switch interval at every
step) is measured on a GPU host: docs/benchmarks.md, "A busy engine thread". A rank process
behind a busy engine loop lowering it by itself: test_cluster_tcp.py."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import pytest

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.gil import STARVED_S, WINDOW, GilWatch, apply_switch_interval
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


def test_apply_lowers_a_longer_interval_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvwire.gil"):
        got = apply_switch_interval(100.0, "rank-a", "a test")
    assert got == pytest.approx(100e-6)
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    assert "rank-a" in caplog.text and "5.000 ms -> 0.100 ms (a test" in caplog.text


def test_apply_keeps_a_shorter_interval_the_engine_chose(caplog: pytest.LogCaptureFixture) -> None:
    sys.setswitchinterval(50e-6)
    with caplog.at_level(logging.INFO, logger="kvwire.gil"):
        assert apply_switch_interval(100.0, "rank-a", "a test") == pytest.approx(50e-6)
    assert sys.getswitchinterval() == pytest.approx(50e-6)
    assert not caplog.text


def test_auto_lowers_only_once_idle_waits_come_back_late(caplog: pytest.LogCaptureFixture) -> None:
    watch = GilWatch("auto", 100.0, "rank-a")
    assert sys.getswitchinterval() == pytest.approx(0.005)  # nothing at start
    for _ in range(3 * WINDOW):  # punctual waits, and a few late ones: not starved
        watch.waited(0.02, 0.0202)
    for _ in range(WINDOW // 2 - 1):
        watch.waited(0.02, 0.02 + 10 * STARVED_S)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    with caplog.at_level(logging.INFO, logger="kvwire.gil"):
        for _ in range(2):  # now most of the window is late: the median is
            watch.waited(0.02, 0.02 + 3 * STARVED_S)
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    assert watch.done
    assert "waited" in caplog.text and "median of 8" in caplog.text
    sys.setswitchinterval(0.005)  # once lowered it is never touched again
    for _ in range(2 * WINDOW):
        watch.waited(0.02, 0.1)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_always_lowers_at_start_and_never_never() -> None:
    GilWatch("never", 100.0, "rank-a").waited(0.0, 1.0)
    never = GilWatch("never", 100.0, "rank-a")
    for _ in range(2 * WINDOW):
        never.waited(0.0, 1.0)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    GilWatch("always", 250.0, "rank-a")
    assert sys.getswitchinterval() == pytest.approx(250e-6)


def test_options_are_validated() -> None:
    o = ControlOptions()
    assert (o.gil_switch, o.gil_switch_interval_us) == ("auto", 100.0)
    with pytest.raises(ValueError):
        ControlOptions(gil_switch="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ControlOptions(gil_switch_interval_us=0)


@pytest.mark.parametrize(("mode", "want"), [("always", 250e-6), ("never", 0.005)])
def test_a_manager_applies_its_option(mode: str, want: float) -> None:
    cfg: KVWireConfig = config()
    cfg = cfg.model_copy(
        update={
            "control": cfg.control.model_copy(
                update={"gil_switch": mode, "gil_switch_interval_us": 250.0}
            )
        }
    )
    lay, _ = make_pool(MODEL, RankPosition(), 8)
    with KVManager(cfg, Role.DECODE, lay):
        assert sys.getswitchinterval() == pytest.approx(want)
