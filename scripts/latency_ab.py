"""``kvwire bench --latency`` of two source trees, interleaved in one run, side by side.

On a loaded machine two runs of the same code differ by more than most changes, so "before"
and "after" alternate (before, after, before, after, ...) and every round's p50s print side by
side with the ratio after / before; the last table gives the median of the rounds.

    uv run --frozen --no-sync python scripts/latency_ab.py --before /tmp/base/core/src \\
        --rounds 4 -- --transfer-backend tcp --requests 300 --staging bulk \\
        --staging-option equal_tp=always

``--before`` (and ``--after``, default: this tree's ``core/src``) is a directory put first on
``PYTHONPATH`` of the bench's processes (its rank processes inherit it); everything after
``--`` goes to ``kvwire bench --latency``. ``--before-extra`` / ``--after-extra`` add
arguments to one side only (one tree, an option off and on:
``--before HERE/core/src --before-extra "--control-option timer_slack_us=null"``).
``--json PATH`` keeps every round's report.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
ROWS = (
    "ask",
    "reach",
    "see",
    "queue",
    "post",
    "plan",
    "land",
    "finish",
    "report",
    "send->decode",
    "init->decode",
    "send->prefill",
)


def run_one(src: str, bench_args: list[str]) -> dict[str, Any]:
    """One ``kvwire bench --latency`` with ``src`` first on PYTHONPATH; its JSON report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lat.json"
        env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
        code = "import sys; from kvwire.cli import main; sys.exit(main(sys.argv[1:]))"
        cmd = [sys.executable, "-c", code, "bench", "--latency", "--json", str(out), *bench_args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not out.exists():
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"bench failed with {src} (exit {proc.returncode})")
        report: dict[str, Any] = json.loads(out.read_text())
        return report


def load() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="source dir of the old tree (core/src)")
    ap.add_argument("--after", default=str(HERE / "core" / "src"))
    ap.add_argument("--before-extra", default="", help="bench arguments of the before side only")
    ap.add_argument("--after-extra", default="", help="bench arguments of the after side only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write every round's reports here")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then kvwire bench --latency args")
    a = ap.parse_args()
    bench_args = [x for x in a.bench if x != "--"]
    rounds: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for r in range(a.rounds):
        before = run_one(a.before, bench_args + shlex.split(a.before_extra))
        after = run_one(a.after, bench_args + shlex.split(a.after_extra))
        rounds.append((before, after))
        print(f"round {r + 1}: load {load()}", flush=True)
        print(f"  {'stage':<14} {'before p50':>10} {'after p50':>10} {'ratio':>6}")
        for row in ROWS:
            b = before["summary"].get(row, {}).get("p50")
            n = after["summary"].get(row, {}).get("p50")
            if b is None or n is None:
                continue
            ratio = n / b if b else float("nan")
            print(f"  {row:<14} {b:>10.3f} {n:>10.3f} {ratio:>6.2f}")
        for side, rep in (("before", before), ("after", after)):
            print(f"  {side}: {rep['verified']}/{rep['requests']} verified, ok={rep['ok']}")
    print(f"median of {a.rounds} rounds (p50 ms per round):")
    print(f"  {'stage':<14} {'before':>8} {'after':>8} {'ratio':>6}")
    for row in ROWS:
        bs = [b["summary"][row]["p50"] for b, _ in rounds if row in b["summary"]]
        ns = [n["summary"][row]["p50"] for _, n in rounds if row in n["summary"]]
        if not bs or not ns:
            continue
        b, n = statistics.median(bs), statistics.median(ns)
        print(f"  {row:<14} {b:>8.3f} {n:>8.3f} {n / b if b else float('nan'):>6.2f}")
    cpu_keys = sorted({k for b, n in rounds for k in (*b["cpu_ms"], *n["cpu_ms"])})
    print("CPU ms per request (median of rounds), before / after:")
    for k in cpu_keys:
        bs = [b["cpu_ms"].get(k, 0.0) for b, _ in rounds]
        ns = [n["cpu_ms"].get(k, 0.0) for _, n in rounds]
        print(f"  {k:<20} {statistics.median(bs):>7.3f} {statistics.median(ns):>7.3f}")
    ok = all(b["ok"] and n["ok"] for b, n in rounds)
    if a.json:
        Path(a.json).write_text(
            json.dumps({"args": bench_args, "rounds": [list(x) for x in rounds]}, indent=1)
        )
    print("every request verified" if ok else "FAILED: some request did not verify")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
