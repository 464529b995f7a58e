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
from kvwire.gil import PROBE_MAX_S, PROBE_S, STARVED_S, WINDOW, GilWatch, apply_switch_interval
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


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def late_window(watch: GilWatch, late_s: float) -> None:
    """One window of idle waits of 20 ms, each ``late_s`` late."""
    for _ in range(WINDOW):
        watch.waited(0.02, 0.02 + late_s)


def test_auto_lowers_only_once_idle_waits_come_back_late(caplog: pytest.LogCaptureFixture) -> None:
    watch = GilWatch("auto", 100.0, "rank-a", clock=Clock())
    assert sys.getswitchinterval() == pytest.approx(0.005)  # nothing at start
    for _ in range(3):
        late_window(watch, 0.0002)  # punctual waits: not starved
    for _ in range(WINDOW // 2 - 1):  # a few late ones in a window: the median is not
        watch.waited(0.02, 0.02 + 10 * STARVED_S)
    for _ in range(WINDOW // 2 + 1):
        watch.waited(0.02, 0.02)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert [watch.lowered] == [False]
    with caplog.at_level(logging.INFO, logger="kvwire.gil"):
        late_window(watch, 3 * STARVED_S)  # a window mostly late: starved
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    assert [watch.lowered] == [True]
    assert "waited 3.0 ms (median of 8)" in caplog.text


def test_auto_looks_again_and_puts_the_interval_back_once_starvation_is_gone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    watch = GilWatch("auto", 100.0, "rank-a", clock=clock)
    late_window(watch, 0.004)
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    late_window(watch, 0.004)  # before the probe: nothing changes
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    clock.now += PROBE_S
    watch.waited(0.02, 0.02)  # the probe: the engine's interval, for one window
    assert sys.getswitchinterval() == pytest.approx(0.005)
    late_window(watch, 0.004)  # still starved: lowered again, the next probe twice as far
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    clock.now += PROBE_S
    late_window(watch, 0.0)
    assert sys.getswitchinterval() == pytest.approx(100e-6), "probed again too soon"
    clock.now += PROBE_S
    watch.waited(0.02, 0.02)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    with caplog.at_level(logging.INFO, logger="kvwire.gil"):
        late_window(watch, 0.0001)  # the engine stopped hogging: it stays back
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert not watch.lowered
    assert "back at 5.000 ms" in caplog.text
    late_window(watch, 0.0001)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_the_probe_period_doubles_up_to_its_bound() -> None:
    clock = Clock()
    watch = GilWatch("auto", 100.0, "rank-a", clock=clock)
    periods = []
    late_window(watch, 0.004)
    start = clock.now
    for _ in range(12):  # starved at every probe
        while sys.getswitchinterval() < 0.001:
            clock.now += 1.0
            watch.waited(0.02, 0.02)
        periods.append(clock.now - start)
        late_window(watch, 0.004)
        start = clock.now
    assert periods[:3] == [PROBE_S, 2 * PROBE_S, 4 * PROBE_S]
    assert max(periods) == PROBE_MAX_S


def test_always_lowers_at_start_and_never_never() -> None:
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


def test_changes_reach_the_callback_and_a_managers_metrics() -> None:
    """Every interval the watch sets reaches ``on_change`` (the manager exports it as
    ``kvwire_gil_switch_interval_seconds`` and counts lowerings in ``kvwire_gil_lowerings``)."""
    from prometheus_client import REGISTRY

    seen: list[tuple[float, bool]] = []
    clock = Clock()
    watch = GilWatch(
        "auto", 100.0, "rank-a", clock=clock, on_change=lambda i, w: seen.append((i, w))
    )
    late_window(watch, 0.004)
    clock.now += PROBE_S
    watch.waited(0.02, 0.02)
    assert [w for _, w in seen] == [False, True, False]
    assert [i for i, _ in seen] == pytest.approx([0.005, 100e-6, 0.005])
    cfg: KVWireConfig = config()
    cfg = cfg.model_copy(
        update={
            "control": cfg.control.model_copy(
                update={"gil_switch": "always", "gil_switch_interval_us": 250.0}
            )
        }
    )
    lay, _ = make_pool(MODEL, RankPosition(), 8)
    with KVManager(cfg, Role.DECODE, lay) as d:
        labels = {"role": "decode", "agent": d.agent_name}
        got = REGISTRY.get_sample_value("kvwire_gil_switch_interval_seconds", labels)
        assert got == pytest.approx(250e-6)
        d._gil_changed(100e-6, True)  # what the liveness thread's watch calls on a lowering
        assert REGISTRY.get_sample_value("kvwire_gil_lowerings_total", labels) == 1.0
