"""The interpreter's GIL switch interval, which kvwire may lower for the process it runs in.

kvwire's threads (control, progress, transfer workers, a backend's I/O thread) live in the
engine's process and share its GIL. A thread that waited outside the GIL (a socket, a lock, a
CUDA call) and wants it back while the engine's thread runs Python waits until the interpreter
asks that thread to let go, which it does every *switch interval* (``sys.setswitchinterval``,
5 ms by default). A request's path crosses several such waits on each side, so behind an engine
loop that never sleeps a 2 MiB request took over 100 ms at 0.5 ms and its handshake did not
complete at all at 5 ms (docs/benchmarks.md, "A busy engine thread"). Behind an engine that
sleeps or waits on the GPU, a short interval only makes kvwire's own threads preempt each
other (C=8 and TP 1 -> 2 were up to 30% slower at 0.1 ms).

So the default (``control.gil_switch="auto"``) lowers the interval only while kvwire's threads
are seen waiting for the GIL. :class:`GilWatch` is fed, by the liveness thread, how late each of
its timed waits that nothing ended returned; when the median of the last :data:`WINDOW` is
:data:`STARVED_S` or more (a thread of the process holding the GIL for milliseconds at a time)
it lowers the interval to ``control.gil_switch_interval_us``. A lowered interval hides the
evidence, so every :data:`PROBE_S` (doubling up to :data:`PROBE_MAX_S` while the starvation is
still found) it puts the interval back for one window and looks again: a burst of Python at
startup (imports, compiling kernels, capturing graphs) costs a lowered interval for a while,
not for good. The look is a probe thread's, not the liveness thread's: behind an engine thread
that runs Python, the engine's 5 ms stalls every kvwire thread for seconds (two H200s: liveness
stalls of 6-10 s and an evicted peer while the liveness thread waited out a window of eight
waits at 5 ms). The probe thread does nothing but short sleeps, each one GIL acquisition, for
:data:`PROBE_WINDOW_S`; the first that comes back :data:`STARVED_S` late lowers the interval
again, so a probe behind a busy engine costs a few switch intervals, not a window. Before
that, at the lowered interval and at a quarter of it, it times short sleeps: behind a thread
that runs Python without pause their lateness falls with the interval (about 250 against 170
µs at 100 and 25 µs on the development VM, with or without other processes loading it; no
change when nothing holds the GIL), and then the probe is skipped. On two H200s the look at
the engine's 5 ms alone still stalled a liveness thread once for 1.3 s in four probes; with
the check first, two runs behind a busy engine had no stall, and behind a sleeping one the
probe still put the engine's interval back.
Lateness is taken for starvation only where threads that are not kvwire's ran at least
:data:`ENGINE_SHARE` of the process's Python threads' CPU over the span looked at (a window of
waits, the busy check, a probe's window; :func:`python_cpu`). Behind kvwire's own busy threads
(a transfer worker at full load, the engine asleep between steps) a lowered interval only
makes them preempt each other: on two H200s the GPU bench's prefill rank lowered it at C=8
and moved 16 MiB requests at 19.8 GB/s and 128 MiB at 152 GB/s, against 30.2 and 206 where it
stayed at 5 ms (docs/benchmarks.md, session 36).

``"always"`` lowers it when the manager starts, ``"never"`` leaves the interpreter alone.

The interval is process-wide and an engine may run several managers in one process, so one
owner here keeps it: the process runs at the shortest interval any manager's watch holds, and
at the interval found before the first hold once the last lets go (at a probe, or when its
manager closes). A probe therefore looks at the engine's own interval only when no other
manager holds it lowered. Lowerings, and the return once no manager holds it, are logged.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

logger = logging.getLogger(__name__)

__all__ = [
    "BUSY_FALL",
    "ENGINE_SHARE",
    "PROBE_MAX_S",
    "PROBE_S",
    "PROBE_TICK_S",
    "PROBE_WINDOW_S",
    "STARVED_S",
    "WINDOW",
    "GilMode",
    "GilWatch",
    "holders",
    "lower_switch_interval",
    "python_cpu",
    "release_switch_interval",
]

GilMode = Literal["auto", "always", "never"]
#: Idle waits of the liveness thread whose lateness is looked at together.
WINDOW = 8
#: Median lateness of those waits at which kvwire's threads count as starved of the GIL.
STARVED_S = 0.001
#: How long a lowered interval stays before the watch looks again (doubled, up to
#: :data:`PROBE_MAX_S`, each time the starvation is still there).
PROBE_S = 10.0
PROBE_MAX_S = 300.0
#: How long a probe looks at the engine's interval, and the probe thread's sleep between looks.
PROBE_WINDOW_S = 0.2
PROBE_TICK_S = 0.002
#: Before a probe puts the engine's interval back: sleeps of :data:`BUSY_SLEEP_S` timed at
#: the held interval and at a quarter of it (:data:`BUSY_SAMPLES` each). Their median
#: lateness falling by :data:`BUSY_FALL` of the held interval or more says a thread runs
#: Python without pause (a waiting thread is late by about the interval), and the probe is
#: skipped: behind such a thread the engine's interval stalls every kvwire thread.
BUSY_SAMPLES = 16
BUSY_SLEEP_S = 0.001
BUSY_FALL = 0.3
#: The share of the process's Python threads' CPU that threads not kvwire's must have had over
#: a span for its lateness to count as starvation (see the module docstring).
ENGINE_SHARE = 0.5

#: (kvwire's threads' CPU seconds, every other Python thread's), as :func:`python_cpu` reads.
CpuSplit = tuple[float, float]


def _task_cpu_s(native_id: int) -> float | None:
    """A thread's CPU seconds from ``/proc/self/task/<id>/schedstat`` (Linux), or None (no
    such file: another platform, or the thread ended). Read by its kernel id, never through
    its pthread handle, which a thread that ends meanwhile leaves dangling."""
    try:
        fd = os.open(f"/proc/self/task/{native_id}/schedstat", os.O_RDONLY)
    except OSError:
        return None
    try:
        return int(os.read(fd, 64).split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)


def python_cpu() -> CpuSplit:
    """CPU seconds so far of this process's live Python threads: (kvwire's, every other's).
    A thread is kvwire's when its target was defined in a ``kvwire`` module (the plugins'
    ``kvwire_*`` too) or its name starts with ``kvwire`` (executor threads, whose target is
    the executor's). Threads that are not Python's (a driver's, ZeroMQ's I/O) never hold the
    GIL and are not counted. Where a thread's CPU cannot be read (another platform than
    Linux, a thread that just ended) it is left out: with nothing read, a span tells nothing
    and the watch judges as before this rule. Any thread; ~7 us a thread (development VM)."""
    mine = others = 0.0
    for t in threading.enumerate():
        tid = t.native_id
        cpu = _task_cpu_s(tid) if tid is not None else None
        if cpu is None:
            continue
        module = getattr(getattr(t, "_target", None), "__module__", None) or ""
        if module.startswith("kvwire") or t.name.startswith("kvwire"):
            mine += cpu
        else:
            others += cpu
    return mine, others


class _Interval:
    """The process's switch interval as kvwire sets it: its one owner, shared by every manager
    of the process (an engine may run several, e.g. one per pool or per hosted model).

    Each holder (a :class:`GilWatch` that wants the interval lowered) is recorded with the
    interval it asked for; the interpreter runs at the shortest one asked while any holder is
    left, and at the interval found before the first hold once the last one lets go. An
    interval the engine set shorter is never raised, and one the engine changed while kvwire
    held it is left as the engine set it.

    Lock contract: one lock, held for every read-modify-write of the interval and the holds;
    callers hold no kvwire lock (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: dict[int, float] = {}
        #: The interval found before the first hold (put back when the last one lets go).
        self._found: float | None = None
        #: The interval kvwire set last (None: it set none since the first hold).
        self._set: float | None = None

    def hold(self, key: int, interval_s: float) -> tuple[float, float | None]:
        """Record holder ``key`` asking for ``interval_s`` (a holder may ask again, for a
        longer one too: an interval kvwire set follows its holders' shortest); returns the
        interval in force and, when this call changed it, the interval before (else None)."""
        with self._lock:
            current = sys.getswitchinterval()
            if not self._holds:
                self._found, self._set = current, None
            self._holds[key] = interval_s
            want = min(self._holds.values())
            # shorter than asked: the engine's own choice is kept, kvwire's own is raised
            if current == want or (current < want and current != self._set):
                return current, None
            sys.setswitchinterval(want)
            self._set = sys.getswitchinterval()
            return self._set, current

    def release(self, key: int) -> tuple[float, bool]:
        """Drop holder ``key`` (nothing if it holds nothing); returns the interval in force and
        whether this call put the found interval back."""
        with self._lock:
            current = sys.getswitchinterval()
            if self._holds.pop(key, None) is None or self._holds:
                return current, False
            found, ours = self._found, self._set
            self._found = self._set = None
            if found is None or ours is None or current != ours:
                return current, False  # never set by kvwire, or the engine set it since
            sys.setswitchinterval(found)
            return sys.getswitchinterval(), True

    def holders(self) -> int:
        """How many holders the interval has now."""
        with self._lock:
            return len(self._holds)


_INTERVAL = _Interval()


def holders() -> int:
    """How many of the process's GIL watches hold the switch interval lowered now (their
    managers' ``gil_switch`` said so). Any thread."""
    return _INTERVAL.holders()


def lower_switch_interval(
    holder: object, interval_us: float, agent_name: str, why: str | None
) -> float:
    """``holder`` asks for the interpreter's switch interval to be at most ``interval_us``
    microseconds until it calls :func:`release_switch_interval`; the process runs at the
    shortest interval its holders ask (an engine that chose a shorter one keeps it). A change
    is logged with ``why`` (None: quietly). Returns the interval in force, in seconds. Any
    thread."""
    interval, before = _INTERVAL.hold(id(holder), interval_us / 1e6)
    if before is not None and why is not None:
        logger.info(
            "%s: GIL switch interval %.3f ms -> %.3f ms (%s; control.gil_switch='never' leaves "
            "the interpreter's setting alone)",
            agent_name,
            before * 1e3,
            interval * 1e3,
            why,
        )
    return interval


def release_switch_interval(holder: object, agent_name: str, why: str | None) -> float:
    """``holder`` no longer needs the interval lowered: the last holder of the process puts
    back the interval found before the first (unless the engine changed it meanwhile), saying
    ``why`` in the log (None: quietly). Returns the interval in force, in seconds. Any
    thread."""
    interval, restored = _INTERVAL.release(id(holder))
    if restored and why is not None:
        logger.info("%s: GIL switch interval back at %.3f ms (%s)", agent_name, interval * 1e3, why)
    return interval


class GilWatch:
    """One manager's switch-interval policy (built by the manager on the engine thread; fed
    by its liveness thread; a probe runs on a short-lived thread of its own; closed by the
    manager after the liveness thread ended). It sets the interval through the process's one
    owner of it (:func:`lower_switch_interval`, :func:`release_switch_interval`), so several
    managers of one process share it: lowered while any of them holds it, put back when none
    does.

    Lock contract: ``_lock`` guards the watch's state and is held across the calls that set
    the interval (it is taken before the process owner's lock, never inside it) and across
    ``on_change``; no other lock is held with it."""

    def __init__(
        self,
        mode: GilMode,
        interval_us: float,
        agent_name: str,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[float, bool], None] | None = None,
        start_probe: Callable[[GilWatch], None] | None = None,
        cpu: Callable[[], CpuSplit] = python_cpu,
    ) -> None:
        """``on_change(interval_s, lowered)`` is called with the interval in force whenever
        this watch sets it, and once at construction; the manager passes its metrics'
        update. ``start_probe(watch)`` starts a probe (default: a daemon thread running
        :meth:`run_probe`; tests pass one that only calls :meth:`begin_probe` and play the
        looks with :meth:`probe_looked`). ``cpu`` reads the Python threads' CPU split
        (:func:`python_cpu`; tests pass their own)."""
        self.mode = mode
        self._on_change = on_change or (lambda interval_s, lowered: None)
        self.interval_us = interval_us
        self.agent_name = agent_name
        self._clock = clock
        self._start_probe = start_probe or _probe_thread
        self._cpu = cpu
        self._lock = threading.Lock()
        self._late: deque[float] = deque(maxlen=WINDOW)
        #: The CPU split when the window of waits being filled began, and when the probe's
        #: window at the engine's interval began (None: not read).
        self._window_cpu: CpuSplit | None = None
        self._probe_cpu: CpuSplit | None = None
        #: When the interval is lowered: when to look again, and the wait after that.
        self._probe_at: float | None = None
        self._probe_s = PROBE_S
        #: While a probe runs: the clock when its window at the engine's interval ends (set
        #: again when that window begins, after the busy check).
        self._probe_until: float | None = None
        self._closed = False
        #: How many times this watch lowered the interval (auto mode; metrics and tests),
        #: and how many probes ended before the engine's interval came back (busy_check).
        self.lowerings = 0
        self.probes_skipped = 0
        #: Windows of idle waits looked at so far, and the last one's median lateness (s):
        #: what the watch saw, for rank stats and tests (None before the first window).
        self.windows = 0
        self.last_median_s: float | None = None
        #: Late windows and looks not taken for starvation: kvwire's own threads ran most
        #: of the process's Python meanwhile (:data:`ENGINE_SHARE`).
        self.own_late = 0
        if mode == "always":
            lower_switch_interval(self, interval_us, agent_name, "control.gil_switch='always'")
        self._on_change(sys.getswitchinterval(), False)

    @property
    def lowered(self) -> bool:
        """Whether this watch holds the interval lowered now (auto mode)."""
        return self._probe_at is not None

    @property
    def probing(self) -> bool:
        """Whether a probe is looking at the engine's interval now."""
        return self._probe_until is not None

    def waited(self, asked_s: float, took_s: float) -> None:
        """Liveness thread, after a timed wait that nothing ended (no message came): it was
        asked to last ``asked_s`` and returned after ``took_s``. In auto mode: lowers the
        interval once the median lateness of the last :data:`WINDOW` such waits reaches
        :data:`STARVED_S`; while lowered, starts a probe every probe period (the probe, not
        this thread, decides; waits during it are not looked at)."""
        if self.mode != "auto":
            return
        start = False
        with self._lock:
            now = self._clock()
            if self._closed or self._probe_until is not None:
                return
            if self._probe_at is not None:
                if now < self._probe_at:
                    return
                # a window at the engine's own interval (or another manager's, if it holds
                # one): the probe thread puts it back itself, so the liveness thread waits for
                # no thread start at that interval
                self._probe_at = None
                self._probe_until = now + PROBE_WINDOW_S
                self._late.clear()
                start = True
            else:
                if not self._late:
                    self._window_cpu = self._cpu()
                self._late.append(max(0.0, took_s - asked_s))
                if len(self._late) < WINDOW:
                    return
                late = statistics.median(self._late)
                self._late.clear()
                self.windows += 1
                self.last_median_s = late
                if late >= STARVED_S and self._engine_ran(self._window_cpu):
                    self._lower(now, late, f"median of {WINDOW}")
        if start:
            self._start_probe(self)

    def begin_probe(self) -> None:
        """Probe thread, after the busy check: put the interval back (this watch's hold
        released) for the probe's window, which starts now, unless the probe ended or the
        watch closed meanwhile."""
        with self._lock:
            if self._probe_until is not None and not self._closed:
                self._probe_until = self._clock() + PROBE_WINDOW_S
                self._probe_cpu = self._cpu()
                self._on_change(release_switch_interval(self, self.agent_name, None), False)

    def probe_looked(self, late_s: float) -> bool:
        """Probe thread, after one of its sleeps came back ``late_s`` late: lowers the
        interval again at once if that is :data:`STARVED_S` or more, and ends the probe
        either way once its window is over. Returns whether the probe goes on."""
        with self._lock:
            if self._probe_until is None or self._closed:
                return False
            now = self._clock()
            if late_s >= STARVED_S and self._engine_ran(self._probe_cpu):
                self._probe_until = None
                self._lower(now, late_s, "a probe at the engine's interval")
                return False
            if now < self._probe_until:
                return True
            self._probe_until = None
            self._probe_s = PROBE_S
            logger.info(
                "%s: kvwire's threads run on time again; this manager no longer holds the "
                "GIL switch interval lowered (now %.3f ms)",
                self.agent_name,
                sys.getswitchinterval() * 1e3,
            )
            return False

    def run_probe(self) -> None:
        """Probe thread: short sleeps until :meth:`probe_looked` says the probe is over. Each
        sleep's return needs the GIL once, so behind a thread that runs Python the first one
        is late by about the engine's switch interval. Skipped when :meth:`busy_check`
        finds a thread running Python without pause."""
        since = self._cpu()
        if self.busy_check(self.measure_fall(), since):
            return
        self.begin_probe()
        go = True
        while go:
            t = time.monotonic()
            time.sleep(PROBE_TICK_S)
            go = self.probe_looked(max(0.0, time.monotonic() - t - PROBE_TICK_S))

    def measure_fall(self) -> float:
        """Probe thread, the interval still lowered: how much the median lateness of short
        sleeps falls (s) from this watch's interval to a quarter of it (asked of the
        process's owner, then asked back)."""
        if not self._hold_if_open(None):
            return 0.0
        held = _median_late()
        # a close meanwhile let go of the interval: nothing is asked for after it
        if not self._hold_if_open(self.interval_us / 4):
            return 0.0
        try:
            quarter = _median_late()
        finally:
            self._hold_if_open(self.interval_us)
        return held - quarter

    def _hold_if_open(self, interval_us: float | None) -> bool:
        """Probe thread: unless the watch closed (or, with ``interval_us`` None, its probe
        ended), ask for ``interval_us`` (None: nothing); returns whether it was open."""
        with self._lock:
            if self._closed or (interval_us is None and self._probe_until is None):
                return False
            if interval_us is not None:
                lower_switch_interval(self, interval_us, self.agent_name, None)
            return True

    def busy_check(self, fall_s: float, since: CpuSplit | None = None) -> bool:
        """Probe thread, before the engine's interval comes back: with a lateness fall of
        :data:`BUSY_FALL` of the interval or more (:meth:`measure_fall`) a thread runs
        Python without pause; unless that thread was kvwire's own (the CPU split read
        ``since`` the fall's measure began), the probe ends here, the interval held as if a
        look had come back late. Returns whether it did."""
        with self._lock:
            if self._probe_until is None or self._closed:
                return True
            if fall_s < BUSY_FALL * self.interval_us / 1e6 or not self._engine_ran(since):
                return False
            self._probe_until = None
            self.probes_skipped += 1
            self._lower(self._clock(), fall_s, "a thread runs Python without pause")
            return True

    def _engine_ran(self, since: CpuSplit | None) -> bool:
        """Under ``_lock``: whether threads not kvwire's had :data:`ENGINE_SHARE` or more of
        the Python threads' CPU from ``since`` to now (True where nothing tells: no split
        read, or no CPU counted); counts it in :attr:`own_late` when not."""
        if since is None:
            return True
        mine, others = self._cpu()
        # a thread that ended meanwhile took its CPU out of its side's sum: never below 0
        d_mine, d_others = max(0.0, mine - since[0]), max(0.0, others - since[1])
        total = d_mine + d_others
        if total <= 0 or d_others >= ENGINE_SHARE * total:
            return True
        self.own_late += 1
        logger.debug(
            "%s: kvwire's threads waited, but they ran %.0f%% of the process's Python meanwhile: "
            "the switch interval stays",
            self.agent_name,
            100 * d_mine / total,
        )
        return False

    def _lower(self, now: float, late: float, seen: str) -> None:
        """Under ``_lock``: starved (``late`` s, as ``seen``): hold the interval lowered until
        the next probe, which comes twice as late as the last one did."""
        first = self._probe_s == PROBE_S
        self.lowerings += 1
        self._probe_at = now + self._probe_s
        self._probe_s = min(2 * self._probe_s, PROBE_MAX_S)
        why = (
            f"kvwire's threads waited {late * 1e3:.1f} ms ({seen}) to run again: "
            "a thread of this process holds the GIL for milliseconds at a time"
        )
        # still starved at a probe: lowered again, quietly
        interval = lower_switch_interval(
            self, self.interval_us, self.agent_name, why if first else None
        )
        self._on_change(interval, True)

    def close(self) -> None:
        """Manager close (engine thread, after the liveness thread ended): let go of the
        interval (a probe still running ends at its next look); the process's last holder
        puts back the one it found. Idempotent."""
        with self._lock:
            self._closed = True
            self._probe_at = self._probe_until = None
            release_switch_interval(self, self.agent_name, "its manager closed")


def _median_late() -> float:
    """Median lateness (s) of :data:`BUSY_SAMPLES` sleeps of :data:`BUSY_SLEEP_S`."""
    out = []
    for _ in range(BUSY_SAMPLES):
        t = time.monotonic()
        time.sleep(BUSY_SLEEP_S)
        out.append(time.monotonic() - t - BUSY_SLEEP_S)
    return statistics.median(out)


def _probe_thread(watch: GilWatch) -> None:
    """The default probe: a daemon thread (a probe comes every :data:`PROBE_S` or more and
    lasts :data:`PROBE_WINDOW_S`), so nothing waits on it."""
    name = f"{watch.agent_name}-gil-probe"
    threading.Thread(target=watch.run_probe, name=name, daemon=True).start()
