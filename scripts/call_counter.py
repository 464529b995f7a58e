"""Counts Python calls per thread (by name) and per (thread, function) in one process.

Used as ``sitecustomize`` (``scripts/gpu_call_count.sh`` copies it to a folder put first on
``PYTHONPATH``) with ``CC_DIR`` set: every process that imports it writes
``CC_DIR/cc_<pid>.json`` about every 0.2 s (checked every 500 calls) and at exit; a forked child
starts from zero. Calls into NumPy or prometheus-client are also counted by their caller. A
profiling hook slows the process: compare counts, not times. ``scripts/call_counter_diff.py``
turns two runs' counts into calls per request.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import threading
import time
from typing import Any

_DIR = os.environ.get("CC_DIR")
_EXTERNAL = ("numpy/", "prometheus_client/")
_st: dict[str, Any] = {
    "counts": collections.Counter(),
    "funcs": collections.Counter(),
    "n": 0,
    "t": time.monotonic(),
}


def _dump() -> None:
    if not _DIR:
        return
    try:
        path = os.path.join(_DIR, f"cc_{os.getpid()}.json")
        funcs = [[t, fn, n] for (t, fn), n in _st["funcs"].items()]
        with open(path + ".tmp", "w") as f:
            json.dump({"threads": _st["counts"], "funcs": funcs}, f)
        os.replace(path + ".tmp", path)
    except Exception:
        pass


def _name(code: Any) -> str:
    return code.co_filename.split("site-packages/")[-1].split("src/")[-1] + ":" + code.co_qualname


def _prof(frame: Any, event: str, arg: Any) -> None:
    if event != "call":
        return
    t = threading.current_thread().name
    _st["counts"][t] += 1
    name = _name(frame.f_code)
    _st["funcs"][(t, name)] += 1
    if name.startswith(_EXTERNAL):
        b = frame.f_back
        if b is not None and not any(x in b.f_code.co_filename for x in _EXTERNAL):
            _st["funcs"][(t, f"CALLER {_name(b.f_code)} -> {name}")] += 1
    _st["n"] += 1
    if _st["n"] % 500 == 0 and time.monotonic() - _st["t"] > 0.2:
        _st["t"] = time.monotonic()
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        try:
            _dump()
        finally:
            sys.setprofile(_prof)
            threading.setprofile(_prof)


def _child() -> None:
    _st["counts"] = collections.Counter()
    _st["funcs"] = collections.Counter()
    _st["n"] = 0


if _DIR:
    os.register_at_fork(after_in_child=_child)
    sys.setprofile(_prof)
    threading.setprofile(_prof)
    atexit.register(_dump)
