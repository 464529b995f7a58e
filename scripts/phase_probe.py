"""Wall and CPU time of named methods, per thread, in the rank processes of a benchmark: where a
request's time goes between the stage marks, and how much of a call's wall time is its own CPU
(the rest is waiting: for the GIL, a lock, a syscall, a sleep).

Installed as ``sitecustomize`` (copied into a folder first on ``PYTHONPATH``) and switched on
with ``KVWIRE_PHASE_DIR``. In every process it wraps the methods of :data:`TARGETS` that its
modules define (imported lazily: a target whose module the process never imports costs
nothing); each call adds its ``perf_counter`` and ``thread_time`` spans to
(thread name, target), nested calls included in their callers'. Counting stays off until the
file ``on`` exists in the folder (``gpu_engine``'s ``sample_dir`` makes it around the timed
requests, as for ``scripts/rank_sampler.py``), which a thread of each process checks every
20 ms. Results go to ``<pid>.json`` every 0.5 s while ``on`` exists, when it goes away and
at exit.

    python3 scripts/phase_probe.py report DIR [--per 1]
        # per process and thread: calls, wall ms and CPU ms of each target, and wall - CPU
        # (with --per: per request, counted by the process's KVSender.send or
        # KVReceiver.send_metadata calls; otherwise totals)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

#: module -> "Class.method" names to wrap there.
TARGETS: dict[str, tuple[str, ...]] = {
    "kvwire.session.prefill.pipeline": (
        "Pipeline.accept",
        "Pipeline.progress",
        "Pipeline.idle",
        "Pipeline.plan",
        "Pipeline.post_segments",
        "Pipeline._post_whole",
        "Pipeline._post",
        "Pipeline._complete",
        "Pipeline._finish_tail",
    ),
    "kvwire.session.prefill.side": (
        "PrefillSide._on_request",
        "PrefillSide.check_deadlines",
    ),
    "kvwire.session.prefill.lane": ("Lane.take", "Lane.launch", "Lane.progress", "Lane._end"),
    "kvwire_cudaipc.lane": ("CudaIpcLane.launch", "CudaIpcLane._ended", "CudaIpcLane._poll"),
    "kvwire.session.prefill.writes": (
        "WriteBook.dest_done",
        "WriteBook.start_turn",
        "WriteBook.end_turn",
    ),
    "kvwire.session.decode.side": ("DecodeSide.on_notification", "DecodeSide.check_deadlines"),
    "kvwire.owner_loop": ("OwnerLoop.run_commands",),
    "kvwire.staging.bulk": ("BulkStaging.tick", "BulkStaging.plan"),
    "kvwire.staging.direct": ("DirectStaging.plan",),
    "kvwire.session.sender": ("KVSender.send",),
    "kvwire.session.common": ("RequestHandle.poll",),
    "kvwire.session.receiver": ("KVReceiver.poll", "KVReceiver.send_metadata"),
    "kvwire.session.manager": ("KVManager._dispatch", "KVManager._progress_step"),
    "kvwire_cudaipc.backend": (
        "CudaIpcBackend._flush_held",
        "CudaIpcBackend._kernel_done",
        "CudaIpcBackend._poll",
        "CudaIpcBackend._submit_pages",
    ),
    "kvwire.control.wire": ("Codec.encode", "Codec.frame", "Codec.decode"),
    "kvwire.backends.tcp.backend": (
        "TcpBackend._queue_note",
        "TcpBackend._on_local_note",
        "TcpBackend.get_notifications",
    ),
    "kvwire.backends.tcp.local_notes": ("LocalNotes.send",),
    "kvwire.movers.triton_pool_pages": ("PoolPageCopier.copy_batch",),
}

_DIR = os.environ.get("KVWIRE_PHASE_DIR")
_acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
_state: dict[str, Any] = {"on": False, "pid": 0}


def _task_cpu() -> dict[str, float]:
    """CPU seconds of every thread of this process so far (``/proc/self/task/TID/schedstat``:
    nanoseconds on a CPU, that thread alone), by name: a Python thread's name, else the
    kernel's (``comm``: ZeroMQ's I/O threads, the CUDA driver's) with its id."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            name = names.get(int(tid))
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f"{f.read().strip()}#{tid}"
        except (OSError, ValueError, IndexError):
            continue  # the thread ended
        out[name] = out.get(name, 0.0) + ns / 1e9
    return out


def _watch() -> None:
    """A thread of this process: follows the flag file, dumps when it goes away; reads every
    thread's CPU when the flag appears and every 0.1 s while it exists (what each used
    between the first read and the last)."""
    flag = Path(_DIR or "", "on")
    written = time.monotonic()
    while True:
        was, _state["on"] = _state["on"], flag.exists()
        now = time.monotonic()
        if _state["on"] and not was:
            _state["cpu0"], _state["t0"] = _task_cpu(), now
            _state["cpu1"], _state["t1"] = _state["cpu0"], now
        elif _state["on"] and now - _state["t1"] >= 0.1:  # the last read while on is what
            _state["cpu1"], _state["t1"] = _task_cpu(), now  # counts (threads end later)
        if (was and not _state["on"]) or (_state["on"] and now - written > 0.5):
            _dump()  # also while on: a rank process may end without running atexit
            written = now
        time.sleep(0.02)


def _enabled() -> bool:
    if _state["pid"] != os.getpid():  # first wrapped call of this process (or fork child)
        _state["pid"] = os.getpid()
        _acc.clear()
        threading.Thread(target=_watch, name="phase-probe", daemon=True).start()
    return bool(_state["on"])


def _wrap(cls: Any, name: str, label: str) -> None:
    fn = getattr(cls, name, None)
    if fn is None or getattr(fn, "_phase_probe", False):
        return

    def wrapped(*a: Any, **kw: Any) -> Any:
        if not _enabled():
            return fn(*a, **kw)
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            row = _acc[(threading.current_thread().name, label)]
            row[0] += 1
            row[1] += time.perf_counter() - w0
            row[2] += time.thread_time() - c0

    wrapped._phase_probe = True  # type: ignore[attr-defined]
    wrapped.__name__ = getattr(fn, "__name__", name)
    wrapped.__doc__ = getattr(fn, "__doc__", None)
    setattr(cls, name, wrapped)


def _patch(module: Any) -> None:
    for target in TARGETS.get(module.__name__, ()):
        cls_name, meth = target.split(".")
        cls = getattr(module, cls_name, None)
        if cls is not None:
            _wrap(cls, meth, target)


def _dump() -> None:
    if not _DIR or not _acc:
        return
    rows = [[t, k, *v] for (t, k), v in _acc.items()]
    cpu0, cpu1 = _state.get("cpu0") or {}, _state.get("cpu1") or {}
    threads = {n: c - cpu0.get(n, 0.0) for n, c in cpu1.items() if c - cpu0.get(n, 0.0) > 0}
    span = _state.get("t1", 0.0) - _state.get("t0", 0.0)
    out = Path(_DIR, f"{os.getpid()}.json")
    tmp = out.with_suffix(".tmp")
    body = {"pid": os.getpid(), "argv": sys.argv, "rows": rows, "threads": threads, "span": span}
    tmp.write_text(json.dumps(body))
    os.replace(tmp, out)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a target module right after it is first imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            orig_exec(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


#: One call of these per request and process (prefill's send, decode's send_metadata), where
#: the engine sends a request's pages in one chunk, as the GPU benches do.
PER_REQUEST = ("KVSender.send", "KVReceiver.send_metadata")


def report(folder: Path, per: int) -> None:
    for f in sorted(folder.glob("*.json")):
        d = json.loads(f.read_text())
        calls = {k: n for _, k, n, *_ in d["rows"]}
        requests = max((calls.get(k, 0) for k in PER_REQUEST), default=0)
        print(f"== pid {d['pid']}: {requests} requests ({' '.join(d['argv'])[:80]})")
        div = per or 1
        unit = f"per {per} requests" if per else "total"
        if per and requests:
            div, unit = requests, "per request"
        print(f"{'thread':<28} {'target':<40} {'calls':>8} {'wall ms':>9} {'cpu ms':>9} "
              f"{'wait ms':>9}   ({unit})")  # fmt: skip
        for t, k, n, wall, cpu in sorted(d["rows"], key=lambda r: (r[0], -r[3])):
            print(f"{t[:28]:<28} {k:<40} {n / div:>8.2f} {wall * 1e3 / div:>9.3f} "
                  f"{cpu * 1e3 / div:>9.3f} {(wall - cpu) * 1e3 / div:>9.3f}")  # fmt: skip
        threads, span = d.get("threads") or {}, d.get("span") or 0.0
        if threads and span > 0:
            total = sum(threads.values())
            print(f"CPU while 'on' ({span:.1f} s): {total / span:.2f} cores; by thread:")
            for name, c in sorted(threads.items(), key=lambda kv: -kv[1]):
                print(f"  {c / span:6.3f} cores  {name}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report")
    r.add_argument("dir", type=Path)
    r.add_argument("--per", type=int, default=0)
    args = ap.parse_args()
    report(args.dir, args.per)
elif _DIR:
    import atexit
    import importlib.util

    Path(_DIR).mkdir(parents=True, exist_ok=True)
    for _name in TARGETS:
        if _name in sys.modules:
            _patch(sys.modules[_name])
    sys.meta_path.insert(0, _Finder())
    atexit.register(_dump)
