#!/usr/bin/env bash
# The control channel's local way on a GPU host (kvwire.control.local_way): `cudaipc`'s
# engine phase with `local_control` on and off, alternating (on/off in odd rounds, off/on in
# even ones), the GIL switch interval pinned (`--gil-switch never`: the watch's state moves a
# run more than this change), 2 and 16 MiB at C = 1 and 8. One GPU is enough (prefill and
# decode share it: host time, which is what the change cuts); with two, ranks take one each.
# Every run's first requests are checked element by element.
#
# On the development machine:  bash scripts/gpu_wheels.sh   (fills .whl/)
# Device call, carry [".whl"]:  bash scripts/gpu_local_control_ab.sh
# ROUNDS (3), REQUESTS (200) and SIZES (2,16) set the runs. Results in $OUT (default
# /tmp/lcout): a JSON and a log per run, and the table printed last (ab.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lcout}
source scripts/gpu_env.sh
ROUNDS=${ROUNDS:-3}
N=${REQUESTS:-200}
SIZES=${SIZES:-2,16}
nvidia-smi -L | head -4
for r in $(seq "$ROUNDS"); do
  case $((r % 2)) in 1) order="on off" ;; *) order="off on" ;; esac
  for v in $order; do
    lc=true; [ "$v" = off ] && lc=false
    run_case "r${r}_$v" python3 scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api \
      --backend cudaipc --sizes "$SIZES" --concurrency 1,8 --requests "$N" --verify-requests 2 \
      --gil-switch never --control-options "{\"local_control\": $lc}"
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/ab.txt"
import json, sys
from pathlib import Path
from statistics import median
out = Path(sys.argv[1])
cells = {}
for f in sorted(out.glob("r*_o*.json")):
    way = f.stem.split("_")[1]
    data = json.loads(f.read_text())
    for c in data.get("engine", {}).get("cells", []):
        if c["failed"]:
            print(f"{f.name}: {c['failed']} failed requests at {c['mib']} MiB C={c['concurrency']}")
        key = (c["mib"], c["concurrency"])
        st = c.get("stages_ms", {})
        cells.setdefault(key, {}).setdefault(way, []).append(
            (c["p50_ms"], c["gbps"], st.get("reach", float("nan")))
        )
print("MiB  C  | p50 ms on / off (runs)                  | GB/s on / off (medians) | reach ms on / off")
for (mib, conc), ways in sorted(cells.items()):
    on, off = ways.get("on", []), ways.get("off", [])
    fmt = lambda xs, i: ", ".join(f"{x[i]:.3f}" for x in xs)
    med = lambda xs, i: median(x[i] for x in xs) if xs else float("nan")
    print(f"{mib:>3} {conc:>2}  | {fmt(on, 0)} / {fmt(off, 0)} | {med(on, 1):.1f} / {med(off, 1):.1f} "
          f"| {med(on, 2):.3f} / {med(off, 2):.3f}")
PY
