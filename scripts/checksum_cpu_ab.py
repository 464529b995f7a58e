"""What ``kv_checksum`` adds to a request on CPU, measured interleaved (issue 26 item 1).

Runs ``kvwire bench`` with ``kv_checksum`` off and on, alternating, for every backend and every
tree given (``--tree NAME=PATH``: ``PATH/core/src`` first on ``PYTHONPATH``; the default is the
installed tree), round after round, so that a loaded machine's drift falls on both sides
alike. Prints per cell and tree the unchecked and checked GB/s (median of the rounds), the time
the checks add as a share of the unchecked time (``off / on - 1`` in throughput, per round and
median) and, at C=1, the decode p50 added per request::

    uv run --frozen --no-sync python scripts/checksum_cpu_ab.py --backends tcp,nixl \\
        --mib 16,128 --concurrency 1,8 --rounds 3 --tree before=/tmp/base --tree after=.

``--only NAME=nixl`` runs a tree on some backends only (a variant that changes one backend).
``--latency`` runs ``kvwire bench --latency`` instead (one request at a time, 2 MiB pages,
``--requests`` timed ones per call): per stage, decode's p50 unchecked -> checked (``post``:
prefill took the chunk -> its last write posted, its sums included; ``finish``: decode's last
note -> ``Success``, its check's tail) and each side's CPU per request.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from typing import Any


def run_bench(
    tree: str | None, backend: str, on: bool, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One ``kvwire bench`` call; its ``kvwire`` cells."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = (
            os.path.join(tree, "core", "src") + os.pathsep + env.get("PYTHONPATH", "")
        )
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            sys.executable, "-m", "kvwire.cli", "bench",
            "--transfer-backend", backend,
            "--mib", args.mib, "--concurrency", args.concurrency,
            "--requests", str(args.requests), "--repeat", "1",
            "--control-option", f"kv_checksum={'true' if on else 'false'}",
            "--json", out.name,
        ]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out.name) as f:
            data = json.load(f)
    if not data.get("ok"):
        raise SystemExit(f"bench failed: {data.get('failures')}")
    return [c for c in data["cells"] if c["mode"] == "kvwire"]


def run_latency(
    tree: str | None, backend: str, on: bool, pages: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One ``kvwire bench --latency`` call (C=1, ``pages`` pages of 2 MiB); its report."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = (
            os.path.join(tree, "core", "src") + os.pathsep + env.get("PYTHONPATH", "")
        )
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            sys.executable, "-m", "kvwire.cli", "bench", "--latency",
            "--transfer-backend", backend, "--page-kib", "2048", "--sizes", str(pages),
            "--requests", str(args.requests), "--warmup", "4",
            "--control-option", f"kv_checksum={'true' if on else 'false'}",
            "--json", out.name,
        ]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out.name) as f:
            data: dict[str, Any] = json.load(f)
    if not data.get("ok"):
        raise SystemExit(f"latency bench failed: {data.get('failures')}")
    return data


#: The ``--latency`` table's columns: stage p50s (ms) and CPU per request (ms).
LAT_STAGES = ("post", "land", "finish", "send->decode")
LAT_CPU = ("prefill.process", "decode.process")


def latency_table(raw: list[dict[str, Any]]) -> str:
    """The markdown table of ``--latency`` records: per cell and tree, each stage's p50 and
    each side's CPU per request, unchecked -> checked (medians of the rounds)."""
    rows: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for rec in raw:
        rows[(rec["backend"], rec["tree"], rec["mib"])].append(rec)
    head = [f"{s} p50 ms" for s in LAT_STAGES] + [f"{c} CPU ms" for c in LAT_CPU]
    lines = [
        "| backend | tree | MiB | " + " | ".join(head) + " |",
        "| --- | --- | ---: | " + " | ".join("---" for _ in head) + " |",
    ]
    for (backend, name, mib), recs in sorted(rows.items()):

        def cell(side: str, key: str, stage: bool, recs: list[dict[str, Any]] = recs) -> float:
            vals = [
                r[side]["summary"][key]["p50"] if stage else r[side]["cpu_ms"].get(key, 0.0)
                for r in recs
            ]
            return float(statistics.median(vals))

        cols = [f"{cell('off', s, True):.1f} -> {cell('on', s, True):.1f}" for s in LAT_STAGES]
        cols += [f"{cell('off', c, False):.0f} -> {cell('on', c, False):.0f}" for c in LAT_CPU]
        lines.append(f"| {backend} | {name} | {mib} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def table(raw: list[dict[str, Any]]) -> str:
    """The markdown table of what ``raw`` (the per-call records) holds."""
    # (backend, tree, mib, C) -> list of (gbps_off, gbps_on, p50_off, p50_on)
    rows: dict[tuple[str, str, float, int], list[tuple[float, float, float, float]]]
    rows = defaultdict(list)
    for rec in raw:
        for a, b in zip(rec["off"], rec["on"], strict=True):
            key = (rec["backend"], rec["tree"], a["request_bytes"] / 2**20, a["concurrency"])
            rows[key].append((a["gbps"], b["gbps"], a["decode_p50_ms"], b["decode_p50_ms"]))
    lines = [
        "| backend | tree | MiB | C | unchecked GB/s | checked GB/s | added per round "
        "| added (median) | p50 added ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for (backend, name, mib, c), vals in sorted(rows.items()):
        added = [off / on - 1 for off, on, _, _ in vals]
        p50 = statistics.median(b - a for _, _, a, b in vals)
        lines.append(
            f"| {backend} | {name} | {mib:g} | {c} "
            f"| {statistics.median(v[0] for v in vals):.2f} "
            f"| {statistics.median(v[1] for v in vals):.2f} "
            f"| {', '.join(f'{x:+.0%}' for x in added)} | {statistics.median(added):+.1%} "
            f"| {p50:+.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backends", default="tcp,nixl")
    p.add_argument("--mib", default="16,128")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH (repeatable)")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        help="NAME=BACKEND,..: run tree NAME on these backends only (repeatable)",
    )
    p.add_argument("--json", default=None, help="the raw records, rewritten after every call")
    p.add_argument("--report", default=None, help="only print the table of this --json file")
    p.add_argument(
        "--latency",
        action="store_true",
        help="instead: kvwire bench --latency (C=1, stage by stage) per --mib, --requests each",
    )
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            raw_in = json.load(f)
        print(latency_table(raw_in) if raw_in and "mib" in raw_in[0] else table(raw_in))
        return
    trees: list[tuple[str, str | None]] = [
        (t.split("=", 1)[0], os.path.abspath(t.split("=", 1)[1])) for t in args.tree
    ] or [("tree", None)]
    only = {o.split("=", 1)[0]: o.split("=", 1)[1].split(",") for o in args.only}
    raw: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for backend in args.backends.split(","):
            for name, path in trees:
                if name in only and backend not in only[name]:
                    continue
                if args.latency:
                    for mib in (int(m) for m in args.mib.split(",")):
                        res = {}
                        for checked in (True, False) if r % 2 else (False, True):
                            res["on" if checked else "off"] = run_latency(
                                path, backend, checked, mib // 2, args
                            )
                        raw.append(
                            {"round": r, "backend": backend, "tree": name, "mib": mib, **res}
                        )
                elif r % 2:  # every other round checked first: drift falls on both
                    on = run_bench(path, backend, True, args)
                    off = run_bench(path, backend, False, args)
                    raw.append({"round": r, "backend": backend, "tree": name, "off": off, "on": on})
                else:
                    off = run_bench(path, backend, False, args)
                    on = run_bench(path, backend, True, args)
                    raw.append({"round": r, "backend": backend, "tree": name, "off": off, "on": on})
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(raw, f, indent=1)
                print(f"round {r + 1}/{args.rounds} {backend} {name} done", file=sys.stderr)
    print(latency_table(raw) if args.latency else table(raw))


if __name__ == "__main__":
    main()
