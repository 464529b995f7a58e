"""A stack sampler for the rank processes of a GPU benchmark (where the time goes, per thread).

Installed as ``sitecustomize`` on the GPU machine (copied into a folder on ``PYTHONPATH``) and
switched on with ``KVWIRE_SAMPLE_DIR``: every process started with ``--multiprocessing-fork``
(the cluster's rank processes) runs a daemon thread that, while the file ``on`` exists in that
folder (the benchmark creates it around its timed requests:
:func:`kvwire.bench.gpu_engine.engine`'s ``sample_dir``), takes every other thread's Python
stack every ``KVWIRE_SAMPLE_S`` seconds (default 0.5 ms) and counts, per thread name (digits
dropped), each function's samples on the stack (inclusive) and at its top (self). It writes
``<pid>.json`` there every 2 s and at exit. A sample costs the sampled process the GIL for a
moment: figures are shares of samples, not exact times.

    python3 scripts/gpu_stack_sampler.py report DIR    # the top functions per thread
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

_DEPTH = 40


def _where(f: FrameType) -> str:
    code = f.f_code
    parts = Path(code.co_filename).parts
    short = "/".join(parts[-2:])
    return f"{short}:{code.co_name}"


def _run(folder: Path, period: float) -> None:
    """The sampler thread: samples while ``folder/on`` exists, dumps every 2 s."""
    me = threading.get_ident()
    incl: dict[str, Counter[str]] = {}
    self_: dict[str, Counter[str]] = {}
    totals: Counter[str] = Counter()
    out = folder / f"{os.getpid()}.json"
    last_dump = time.monotonic()
    on_flag = folder / "on"
    on = False
    last_check = 0.0

    def dump() -> None:
        data = {
            "pid": os.getpid(),
            "argv": sys.argv[:3],
            "samples": dict(totals),
            "inclusive": {k: dict(v.most_common(60)) for k, v in incl.items()},
            "self": {k: dict(v.most_common(40)) for k, v in self_.items()},
        }
        out.write_text(json.dumps(data))

    import atexit

    atexit.register(dump)
    while True:
        now = time.monotonic()
        if now - last_check > 0.05:
            on = on_flag.exists()
            last_check = now
        if on:
            names = {t.ident: re.sub(r"\d+", "", t.name) for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, "?")
                totals[name] += 1
                seen: set[str] = set()
                f: FrameType | None = frame
                top = True
                depth = 0
                while f is not None and depth < _DEPTH:
                    w = _where(f)
                    if top:
                        self_.setdefault(name, Counter())[w] += 1
                        top = False
                    if w not in seen:
                        incl.setdefault(name, Counter())[w] += 1
                        seen.add(w)
                    f = f.f_back
                    depth += 1
        if now - last_dump > 2.0:
            dump()
            last_dump = now
        time.sleep(period if on else 0.02)


def install() -> None:
    """Start the sampler in this process when ``KVWIRE_SAMPLE_DIR`` is set and this is a
    spawned child process."""
    folder = os.environ.get("KVWIRE_SAMPLE_DIR")
    if not folder or "--multiprocessing-fork" not in sys.argv:
        return
    period = float(os.environ.get("KVWIRE_SAMPLE_S", "0.0005"))
    Path(folder).mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_run, args=(Path(folder), period), daemon=True).start()


def report(folder: str, top: int = 25) -> str:
    """Top functions per (process, thread) of the dumps in ``folder``."""
    lines: list[str] = []
    for path in sorted(Path(folder).glob("*.json")):
        data: dict[str, Any] = json.loads(path.read_text())
        for name, n in sorted(data["samples"].items(), key=lambda kv: -kv[1]):
            if not n:
                continue
            lines.append(f"== pid {data['pid']} thread {name}: {n} samples")
            lines.append("  self:")
            for w, c in list(data["self"].get(name, {}).items())[:top]:
                lines.append(f"    {100 * c / n:5.1f}%  {w}")
            lines.append("  inclusive:")
            for w, c in list(data["inclusive"].get(name, {}).items())[:top]:
                lines.append(f"    {100 * c / n:5.1f}%  {w}")
    return "\n".join(lines)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "report":
    print(report(sys.argv[2]))
else:
    install()
