"""A CPU-weighted stack sampler for the rank processes of a benchmark: where each thread of a
prefill or decode process spends its CPU while requests run.

Installed as ``sitecustomize`` (copied into a folder first on ``PYTHONPATH``) and switched on
with ``KVWIRE_SAMPLE_DIR``. It starts a sampling thread in every spawned multiprocessing child
(``--multiprocessing-fork`` on its command line: the GPU cluster's rank processes) and in
every child forked from a process that imported it (the CPU cluster's fork server). Every
``KVWIRE_SAMPLE_US`` microseconds (default 1000) while the file ``on`` exists in that folder
(``gpu_engine``'s ``sample_dir`` creates it around the timed requests; with
``KVWIRE_SAMPLE_ALWAYS=1`` it samples from the start), it reads each thread's CPU clock
(``pthread_getcpuclockid``) and charges the CPU that thread used since the last sample to its
Python stack of that moment (``sys._current_frames``). A thread blocked in a wait uses no CPU
and so charges nothing, whatever its stack. The charge lands on the stack at the end of the
interval, so over many samples a function's share approaches its share of the thread's CPU.
Results go to ``<pid>.json`` every second, when ``on`` goes away and at exit.

With ``KVWIRE_SAMPLE_MODE=cprofile`` every thread instead runs ``cProfile`` on its CPU clock
(exact for bursty threads, slower); read its ``.prof`` files with ``pstats``. Python 3.12
allows one ``cProfile`` per process (it profiles through ``sys.monitoring``), so this mode
works on 3.11 and earlier only (the GPU hosts run 3.12: use ``scripts/phase_probe.py``).

    python3 scripts/rank_sampler.py report DIR [--per N] [--top K]
        # per process and thread: CPU ms (per N requests with --per), then the K functions
        # with the most CPU of their own (innermost frame) and the K with the most in their
        # callees too (any frame of the stack)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

DEPTH = 48


def _stack(frame: Any) -> tuple[str, ...]:
    names: list[str] = []
    while frame is not None and len(names) < DEPTH:
        code = frame.f_code
        names.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back
    names.reverse()
    return tuple(names)


def _loop(folder: Path, interval: float, always: bool) -> None:
    me = threading.get_ident()
    flag = folder / "on"
    out = folder / f"{os.getpid()}.json"
    charged: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)
    last: dict[int, float] = {}
    samples = 0

    def dump() -> None:
        rows = [[t, list(s), c] for (t, s), c in charged.items()]
        out.write_text(
            json.dumps({"pid": os.getpid(), "argv": sys.argv, "samples": samples, "charged": rows})
        )

    import atexit

    atexit.register(dump)
    checked = written = time.monotonic()
    on = always or flag.exists()
    while True:
        time.sleep(interval)
        now = time.monotonic()
        if not always and now - checked > 0.02:
            was, on, checked = on, flag.exists(), now
            if was and not on:
                dump()  # the timed part ended (a rank process may end without atexit)
        if not on:
            last.clear()
            continue
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            try:
                cpu = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except OSError:
                continue
            used = cpu - last.get(ident, cpu)
            last[ident] = cpu
            if used > 0:
                charged[(names.get(ident, str(ident)), _stack(frame))] += used
        samples += 1
        if now - written > 1.0:
            dump()
            written = now


def _start() -> None:
    folder = Path(os.environ["KVWIRE_SAMPLE_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    interval = float(os.environ.get("KVWIRE_SAMPLE_US", "1000")) / 1e6
    always = os.environ.get("KVWIRE_SAMPLE_ALWAYS") == "1"
    threading.Thread(
        target=_loop, args=(folder, interval, always), name="rank-sampler", daemon=True
    ).start()


_profiles: dict[str, Any] = {}


def _profile_thread(*_: Any) -> None:
    """First profile event of a new thread: give it a CPU-clock profiler of its own (only
    a thread whose name matches ``KVWIRE_SAMPLE_THREADS``, a regular expression, when set)."""
    import cProfile
    import re

    pattern = os.environ.get("KVWIRE_SAMPLE_THREADS")
    if pattern and not re.search(pattern, threading.current_thread().name):
        sys.setprofile(None)
        return
    prof = cProfile.Profile(time.thread_time)
    _profiles[threading.current_thread().name] = prof
    prof.enable()


def _dump_profiles(folder: Path) -> None:
    import marshal

    while True:
        time.sleep(2.0)
        for name, prof in list(_profiles.items()):
            prof.snapshot_stats()
            with open(folder / f"{os.getpid()}.{name}.prof", "wb") as f:
                marshal.dump(prof.stats, f)


def _start_profiles() -> None:
    """Deterministic mode (``KVWIRE_SAMPLE_MODE=cprofile``): every thread started from now
    on, and this one, runs ``cProfile`` on its own CPU clock; the stats of each thread are
    written to ``<pid>.<thread>.prof`` (``marshal``, as ``pstats`` reads) every 2 s.
    Slower than sampling, but exact for threads that work in bursts shorter than the
    sampling interval (a sample charges a burst to the stack it ends in)."""
    folder = Path(os.environ["KVWIRE_SAMPLE_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    threading.setprofile(_profile_thread)
    _profile_thread()
    threading.Thread(
        target=_dump_profiles, args=(folder,), name="rank-sampler", daemon=True
    ).start()


def install() -> None:
    """Start sampling in spawned children, and in children forked from this process."""
    if not os.environ.get("KVWIRE_SAMPLE_DIR"):
        return
    start = _start_profiles if os.environ.get("KVWIRE_SAMPLE_MODE") == "cprofile" else _start
    if "--multiprocessing-fork" in sys.argv:
        start()
    else:
        os.register_at_fork(after_in_child=start)


def report(folder: str, per: float = 1.0, top: int = 25) -> str:
    lines: list[str] = []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        by_thread: dict[str, float] = defaultdict(float)
        own: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        cum: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for thread, stack, cpu in data["charged"]:
            thread = thread.split("-")[0] if thread.startswith("Thread-") else thread
            by_thread[thread] += cpu
            if stack:
                own[thread][stack[-1]] += cpu
            for name in set(stack):
                cum[thread][name] += cpu
        total = sum(by_thread.values())
        if not total:
            continue
        lines.append(
            f"== pid {data['pid']} ({' '.join(data['argv'])[:60]}): CPU {1e3 * total / per:.3f} ms"
            + (" per request" if per != 1 else "")
        )
        for thread, cpu in sorted(by_thread.items(), key=lambda kv: -kv[1]):
            if cpu / total < 0.01:
                continue
            lines.append(
                f"  -- thread {thread}: {1e3 * cpu / per:.3f} ms ({100 * cpu / total:.0f}%)"
            )
            lines.append("     own:")
            for name, c in sorted(own[thread].items(), key=lambda kv: -kv[1])[:top]:
                lines.append(f"       {1e3 * c / per:8.3f}  {name}")
            lines.append("     with callees:")
            for name, c in sorted(cum[thread].items(), key=lambda kv: -kv[1])[:top]:
                lines.append(f"       {1e3 * c / per:8.3f}  {name}")
    return "\n".join(lines)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "report":
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd")
    ap.add_argument("folder")
    ap.add_argument("--per", type=float, default=1.0, help="divide by this many requests")
    ap.add_argument("--top", type=int, default=25)
    ns = ap.parse_args()
    print(report(ns.folder, ns.per, ns.top))
else:
    install()
