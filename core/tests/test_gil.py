"""kvwire's GIL switch interval policy (``control.gil_switch``, ``kvwire.gil``): ``auto``
lowers the interval only once the liveness thread's idle waits come back late (an engine
thread holding the GIL), ``always`` at start, ``never`` not at all; an interval the engine
chose shorter is kept.

Why it matters (a busy engine thread holds kvwire's threads up to a switch interval at every
step) is measured on a GPU host: docs/benchmarks.md, "A busy engine thread". A rank process
behind a busy engine loop lowering it by itself: test_cluster_tcp.py."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.gil import (
    BUSY_FALL,
    PROBE_MAX_S,
    PROBE_S,
    PROBE_TICK_S,
    PROBE_WINDOW_S,
    STARVED_S,
    WINDOW,
    GilWatch,
    holders,
    lower_switch_interval,
    release_switch_interval,
)
from kvwire.layout import RankPosition
from kvwire.session import KVManager, Role
from kvwire.testing.kvfill import make_pool
from kvwire.testing.pair import MODEL, config


@pytest.fixture(autouse=True)
def interval() -> Iterator[list[GilWatch]]:
    """Every test starts at the interpreter's default, closes the watches it lists here, and
    leaves the process as it was (no hold left over)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    watches: list[GilWatch] = []
    yield watches
    for w in watches:
        w.close()
    assert holders() == 0, "a test left the switch interval held"
    sys.setswitchinterval(before)


def test_lowering_says_why_and_the_last_holder_puts_it_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = object(), object()
    with caplog.at_level(logging.INFO, logger="kvwire.gil"):
        got = lower_switch_interval(a, 100.0, "rank-a", "a test")
    assert got == pytest.approx(100e-6)
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    assert "rank-a" in caplog.text and "5.000 ms -> 0.100 ms (a test" in caplog.text
    assert lower_switch_interval(b, 250.0, "rank-b", "b") == pytest.approx(100e-6)  # shortest
    assert release_switch_interval(a, "rank-a", "done") == pytest.approx(100e-6)  # b holds
    assert holders() == 1
    with caplog.at_level(logging.INFO, logger="kvwire.gil"):
        assert release_switch_interval(b, "rank-b", "done") == pytest.approx(0.005)
    assert "rank-b: GIL switch interval back at 5.000 ms (done)" in caplog.text
    assert release_switch_interval(b, "rank-b", "again") == pytest.approx(0.005)  # idempotent


def test_a_shorter_interval_the_engine_chose_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    sys.setswitchinterval(50e-6)
    holder = object()
    with caplog.at_level(logging.INFO, logger="kvwire.gil"):
        assert lower_switch_interval(holder, 100.0, "rank-a", "a test") == pytest.approx(50e-6)
        assert release_switch_interval(holder, "rank-a", "done") == pytest.approx(50e-6)
    assert sys.getswitchinterval() == pytest.approx(50e-6)
    assert not caplog.text


def test_an_interval_the_engine_changed_while_held_is_left_alone() -> None:
    holder = object()
    lower_switch_interval(holder, 100.0, "rank-a", None)
    sys.setswitchinterval(0.002)  # the engine's own choice, made while kvwire held it
    assert release_switch_interval(holder, "rank-a", "done") == pytest.approx(0.002)


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def no_probe_thread(watch: GilWatch) -> None:
    """``start_probe`` for tests that play the probe thread's looks
    (:meth:`GilWatch.probe_looked`): only its first step, the interval put back."""
    watch.begin_probe()


def probe_window(watch: GilWatch, clock: Clock, late_s: float) -> None:
    """Play a probe thread whose every look comes back ``late_s`` late, until it ends."""
    while watch.probe_looked(late_s):
        clock.now += PROBE_TICK_S


def due_probe(watches: list[GilWatch]) -> tuple[GilWatch, Clock]:
    """An auto watch (kept in ``watches`` for the fixture to close) that lowered the interval
    and whose probe is due, its thread not begun (the test plays it)."""
    clock = Clock()
    watch = GilWatch("auto", 100.0, "rank-a", clock=clock, start_probe=lambda w: None)
    watches.append(watch)
    late_window(watch, 0.004)
    clock.now += PROBE_S
    watch.waited(0.02, 0.02)
    return watch, clock


def late_window(watch: GilWatch, late_s: float) -> None:
    """One window of idle waits of 20 ms, each ``late_s`` late."""
    for _ in range(WINDOW):
        watch.waited(0.02, 0.02 + late_s)


def test_auto_lowers_only_once_idle_waits_come_back_late(
    caplog: pytest.LogCaptureFixture, interval: list[GilWatch]
) -> None:
    watch = GilWatch("auto", 100.0, "rank-a", clock=Clock())
    interval.append(watch)
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
    caplog: pytest.LogCaptureFixture, interval: list[GilWatch]
) -> None:
    clock = Clock()
    watch = GilWatch("auto", 100.0, "rank-a", clock=clock, start_probe=no_probe_thread)
    interval.append(watch)
    late_window(watch, 0.004)
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    late_window(watch, 0.004)  # before the probe: nothing changes
    assert sys.getswitchinterval() == pytest.approx(100e-6) and not watch.probing
    clock.now += PROBE_S
    watch.waited(0.02, 0.02)  # the probe: the engine's interval, for the probe's window
    assert sys.getswitchinterval() == pytest.approx(0.005) and watch.probing
    late_window(watch, 0.004)  # the liveness thread's waits during a probe are not looked at
    assert sys.getswitchinterval() == pytest.approx(0.005)
    probe_window(watch, clock, 0.004)  # still starved: lowered again, the next probe twice as far
    assert sys.getswitchinterval() == pytest.approx(100e-6) and not watch.probing
    clock.now += PROBE_S
    late_window(watch, 0.0)
    assert sys.getswitchinterval() == pytest.approx(100e-6), "probed again too soon"
    clock.now += PROBE_S
    watch.waited(0.02, 0.02)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    with caplog.at_level(logging.INFO, logger="kvwire.gil"):
        probe_window(watch, clock, 0.0001)  # the engine stopped hogging: it stays back
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert not watch.lowered and not watch.probing
    assert "no longer holds the GIL switch interval lowered (now 5.000 ms)" in caplog.text
    late_window(watch, 0.0001)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_probe_ends_at_its_first_late_look(interval: list[GilWatch]) -> None:
    """At the engine's interval behind a thread that runs Python every kvwire thread stalls
    (seconds on two H200s), so the probe lowers the interval again at its first late look,
    and puts it back only after a whole window on time; outside a probe one late wait of the
    liveness thread is not starvation."""
    clock = Clock()
    watch = GilWatch("auto", 100.0, "rank-a", clock=clock, start_probe=no_probe_thread)
    interval.append(watch)
    late_window(watch, 0.004)
    assert watch.lowerings == 1
    clock.now += PROBE_S
    watch.waited(0.02, 0.02)  # the probe starts
    assert sys.getswitchinterval() == pytest.approx(0.005)
    for _ in range(int(PROBE_WINDOW_S / PROBE_TICK_S) - 2):  # on time, the window not over
        assert watch.probe_looked(0.0001)
        clock.now += PROBE_TICK_S
    assert sys.getswitchinterval() == pytest.approx(0.005) and not watch.lowered
    assert not watch.probe_looked(2 * STARVED_S)  # one late look: lowered at once
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    assert watch.lowered and watch.lowerings == 2 and not watch.probing
    clock.now += 2 * PROBE_S  # the next probe, twice as far; a whole window on time ends it
    watch.waited(0.02, 0.02)
    probe_window(watch, clock, 0.0)
    assert sys.getswitchinterval() == pytest.approx(0.005) and not watch.lowered
    watch.waited(0.02, 0.02 + 2 * STARVED_S)  # past the probe, a lone late wait is not starved
    for _ in range(WINDOW - 1):
        watch.waited(0.02, 0.02)
    assert sys.getswitchinterval() == pytest.approx(0.005) and watch.lowerings == 2


def test_a_probe_thread_behind_a_thread_that_runs_python_ends_lowered(
    interval: list[GilWatch],
) -> None:
    """The real probe thread, behind a thread that runs Python without pause, ends with the
    interval lowered again: skipped by the busy check, or (when a loaded host's scheduling
    hid the fall) at its first late look."""
    clock = Clock()
    watch = GilWatch("auto", 100.0, "rank-a", clock=clock)
    interval.append(watch)
    late_window(watch, 0.004)
    assert watch.lowerings == 1
    with hog():
        clock.now += PROBE_S
        watch.waited(0.02, 0.02)  # the probe thread starts; the fake clock keeps it open
        deadline = time.monotonic() + 60
        while watch.probing and time.monotonic() < deadline:
            time.sleep(0.01)
    assert watch.lowerings == 2 and watch.lowered
    assert sys.getswitchinterval() == pytest.approx(100e-6)


def test_the_fall_tells_a_thread_that_runs_python(interval: list[GilWatch]) -> None:
    """What the busy check measures, for real: the sleeps' lateness falls from the lowered
    interval to a quarter of it behind a thread that runs Python without pause, and not
    without one. On a loaded host the OS's scheduling adds noise of milliseconds, so each
    side is asked to hold in one of five measurements (on the development VM beside two busy
    processes: a fall of 71-80 µs behind the thread, 0 without, threshold 30)."""
    watch, _clock = due_probe(interval)
    bar = BUSY_FALL * 100e-6
    quiet = [watch.measure_fall() for _ in range(5)]
    assert min(quiet) < bar, f"nothing runs Python, yet every fall was {quiet}"
    with hog():
        busy = [watch.measure_fall() for _ in range(5)]
    assert max(busy) >= bar, f"behind a thread that runs Python the falls were {busy}"
    assert sys.getswitchinterval() == pytest.approx(100e-6)  # asked back after each


@contextlib.contextmanager
def hog() -> Iterator[None]:
    """A thread that runs Python without pause while the block runs."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def test_the_busy_check_ends_a_probe_only_on_a_clear_fall(interval: list[GilWatch]) -> None:
    """A fall of the sleeps' lateness by BUSY_FALL of the interval or more ends the probe
    with the interval held (as a late look would); a smaller one lets it go on."""
    watch, clock = due_probe(interval)
    assert watch.probing and sys.getswitchinterval() == pytest.approx(100e-6)
    assert not watch.busy_check(0.5 * BUSY_FALL * 100e-6)  # no clear fall: the probe goes on
    assert watch.probing and watch.probes_skipped == 0
    assert watch.busy_check(2 * BUSY_FALL * 100e-6)
    assert not watch.probing and watch.lowered and watch.probes_skipped == 1
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    clock.now += PROBE_S  # the next probe comes twice as late
    watch.waited(0.02, 0.02)
    assert not watch.probing
    clock.now += PROBE_S
    watch.waited(0.02, 0.02)
    assert watch.probing


def test_a_manager_closed_during_the_busy_check_keeps_no_hold(
    interval: list[GilWatch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manager closes while the probe thread times its sleeps at a quarter interval: the
    check asks for nothing afterwards, so no hold outlives the manager (the fixture checks)
    and the engine's interval is back."""
    import kvwire.gil as gil

    watch, _clock = due_probe([])  # closed by the test itself
    at_quarter, closed = threading.Event(), threading.Event()
    calls: list[float] = []

    def median_late() -> float:
        calls.append(sys.getswitchinterval())
        if len(calls) == 2:  # the quarter interval's sleeps: the manager closes now
            at_quarter.set()
            assert closed.wait(30)
        return 0.0

    monkeypatch.setattr(gil, "_median_late", median_late)
    t = threading.Thread(target=watch.measure_fall)
    t.start()
    assert at_quarter.wait(30)
    watch.close()
    closed.set()
    t.join(30)
    assert calls == pytest.approx([100e-6, 25e-6])
    assert holders() == 0 and sys.getswitchinterval() == pytest.approx(0.005)


def test_a_holder_may_ask_for_a_longer_interval_than_kvwire_set() -> None:
    """An interval kvwire set follows its holders' shortest, up as well as down (the busy
    check asks for a quarter, then back); one the engine set meanwhile is left alone."""
    a, b = object(), object()
    lower_switch_interval(a, 25.0, "rank-a", None)
    assert sys.getswitchinterval() == pytest.approx(25e-6)
    lower_switch_interval(a, 100.0, "rank-a", None)
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    lower_switch_interval(b, 50.0, "rank-b", None)
    lower_switch_interval(b, 200.0, "rank-b", None)  # a still asks for 100
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    sys.setswitchinterval(60e-6)  # the engine's own choice
    lower_switch_interval(a, 150.0, "rank-a", None)
    assert sys.getswitchinterval() == pytest.approx(60e-6)
    release_switch_interval(a, "rank-a", None)
    release_switch_interval(b, "rank-b", None)
    assert sys.getswitchinterval() == pytest.approx(60e-6)  # changed by the engine: kept


def test_the_probe_period_doubles_up_to_its_bound(interval: list[GilWatch]) -> None:
    clock = Clock()
    watch = GilWatch("auto", 100.0, "rank-a", clock=clock, start_probe=no_probe_thread)
    interval.append(watch)
    periods = []
    late_window(watch, 0.004)
    start = clock.now
    for _ in range(12):  # starved at every probe
        while not watch.probing:
            clock.now += 1.0
            watch.waited(0.02, 0.02)
        periods.append(clock.now - start)
        probe_window(watch, clock, 0.004)
        start = clock.now
    assert periods[:3] == [PROBE_S, 2 * PROBE_S, 4 * PROBE_S]
    assert max(periods) == PROBE_MAX_S


def test_always_lowers_at_start_and_never_never() -> None:
    never = GilWatch("never", 100.0, "rank-a")
    for _ in range(2 * WINDOW):
        never.waited(0.0, 1.0)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    always = GilWatch("always", 250.0, "rank-a")
    assert sys.getswitchinterval() == pytest.approx(250e-6)
    never.close()
    always.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_several_managers_watches_share_the_process_interval(interval: list[GilWatch]) -> None:
    """Two managers of one process: the second does not take the first's lowered interval for
    the engine's, a probe of one leaves the interval lowered while the other holds it, and the
    engine's interval is back once neither holds it."""
    ca, cb = Clock(), Clock()
    a = GilWatch("auto", 100.0, "rank-a", clock=ca, start_probe=no_probe_thread)
    interval.append(a)
    late_window(a, 0.004)
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    b = GilWatch("auto", 100.0, "rank-b", clock=cb, start_probe=no_probe_thread)
    interval.append(b)
    late_window(b, 0.004)
    assert a.lowered and b.lowered
    ca.now += PROBE_S
    a.waited(0.02, 0.02)  # a probes; b still holds it lowered
    assert not a.lowered
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    probe_window(a, ca, 0.0)  # what a sees under b's hold: on time, so it stays back
    cb.now += PROBE_S
    b.waited(0.02, 0.02)  # b probes too: nobody holds it, the engine's interval is back
    assert sys.getswitchinterval() == pytest.approx(0.005)
    probe_window(b, cb, 0.004)  # b still starved: lowered again
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    b.close()  # its manager closed
    assert sys.getswitchinterval() == pytest.approx(0.005)


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
    assert sys.getswitchinterval() == pytest.approx(0.005)  # put back at close


def test_changes_reach_the_callback_and_a_managers_metrics(interval: list[GilWatch]) -> None:
    """Every interval the watch sets reaches ``on_change`` (the manager exports it as
    ``kvwire_gil_switch_interval_seconds`` and counts lowerings in ``kvwire_gil_lowerings``)."""
    from prometheus_client import REGISTRY

    seen: list[tuple[float, bool]] = []
    clock = Clock()
    watch = GilWatch(
        "auto",
        100.0,
        "rank-a",
        clock=clock,
        on_change=lambda i, w: seen.append((i, w)),
        start_probe=no_probe_thread,
    )
    interval.append(watch)
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


class Split:
    """A CPU split (:func:`kvwire.gil.python_cpu`) a test moves by hand."""

    def __init__(self) -> None:
        self.mine = 0.0
        self.others = 0.0

    def __call__(self) -> tuple[float, float]:
        return self.mine, self.others


def test_late_waits_behind_kvwires_own_threads_keep_the_interval(
    interval: list[GilWatch],
) -> None:
    """Lateness counts as starvation only where threads that are not kvwire's ran at least
    ENGINE_SHARE of the process's Python meanwhile: behind its own busy transfer worker a
    lowered interval only makes kvwire's threads preempt each other (session 36: -30% at C=8
    on two H200s). The window, the busy check and a probe's look are each judged so."""
    clock, split = Clock(), Split()
    watch = GilWatch("auto", 100.0, "rank-a", clock=clock, start_probe=no_probe_thread, cpu=split)
    interval.append(watch)

    def window(mine: float, others: float) -> None:
        watch.waited(0.02, 0.024)  # the window's first wait reads the split
        split.mine += mine
        split.others += others
        for _ in range(WINDOW - 1):
            watch.waited(0.02, 0.024)

    window(mine=0.08, others=0.02)  # kvwire's threads ran 80%: not the engine's doing
    assert not watch.lowered and watch.own_late == 1
    assert sys.getswitchinterval() == pytest.approx(0.005)
    window(mine=0.04, others=0.06)  # the engine ran 60%: starved by it
    assert watch.lowered and watch.lowerings == 1
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    # the busy check: a clear fall, but measured while kvwire's own threads ran: probe on
    clock.now += PROBE_S
    watch.waited(0.02, 0.02)
    since = split()
    split.mine += 0.01
    assert not watch.busy_check(2 * BUSY_FALL * 100e-6, since) and watch.probing
    watch.begin_probe()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    split.mine += 0.003  # a late look while kvwire's worker ran: not lowered again
    assert watch.probe_looked(2 * STARVED_S) and watch.probing
    split.others += 0.01  # a late look after the engine ran most: lowered again
    assert not watch.probe_looked(2 * STARVED_S)
    assert watch.lowered and watch.lowerings == 2 and watch.own_late == 3


@contextlib.contextmanager
def named_hog(name: str) -> Iterator[threading.Thread]:
    """A thread named ``name`` that runs Python without pause while the block runs."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin, name=name, daemon=True)
    t.start()
    try:
        yield t
    finally:
        stop.set()
        t.join()


def test_the_split_tells_kvwires_threads_from_the_engines() -> None:
    """python_cpu, for real: a busy thread named as kvwire's threads are adds to kvwire's
    CPU, one of the engine's to the others'; a kvwire worker thread (its target a kvwire
    method, whatever its name) counts as kvwire's."""
    from kvwire.gil import python_cpu
    from kvwire.session.prefill.workers import TransferWorkers

    for name, mine_grows in (("kvwire-hog", True), ("engine-hog", False)):
        with named_hog(name):  # read while it lives: an ended thread's CPU is not counted
            m0, o0 = python_cpu()
            time.sleep(0.2)
            m1, o1 = python_cpu()
        grew = (m1 - m0, o1 - o0)
        assert (grew[0] > grew[1]) == mine_grows, (name, grew)

    class Idle:  # a stage with nothing to do: its thread blocks on its queue
        busy = full = False

        def notify(self) -> None:
            pass

    workers: TransferWorkers[int] = TransferWorkers(1, "rank-x", lambda i: Idle())  # type: ignore[arg-type, return-value]
    try:
        (t,) = [t for t in threading.enumerate() if t.name == "rank-x-w0"]
        assert getattr(t, "_target", None).__module__.startswith("kvwire")
    finally:
        workers.stop()


def test_a_real_watch_keeps_the_interval_behind_kvwires_busy_thread(
    interval: list[GilWatch],
) -> None:
    """The watch with the real split: late windows while a kvwire thread runs Python without
    pause leave the interval alone; the same behind an engine's thread lower it."""
    watch = GilWatch("auto", 100.0, "rank-a", clock=Clock(), start_probe=lambda w: None)
    interval.append(watch)

    def window() -> None:  # the waits take time, as a liveness thread's do, while hogs run
        for _ in range(WINDOW):
            time.sleep(0.01)
            watch.waited(0.02, 0.02 + 3 * STARVED_S)

    with named_hog("kvwire-hog"):
        window()
        assert not watch.lowered and watch.own_late == 1
    with named_hog("engine-hog"):
        window()
        assert watch.lowered
