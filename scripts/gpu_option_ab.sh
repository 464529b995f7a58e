#!/usr/bin/env bash
# One control option off and on, alternating, on a GPU host: the engine phase of
# scripts/gpu_cudaipc_bench.py over BACKEND (cudaipc) with OPTION (local_control) set to ON
# (true) or OFF (false), on/off in odd rounds and off/on in even ones, the GIL switch interval
# pinned (`--gil-switch never`: the watch's state moves a run more than these changes), 2 and
# 16 MiB at C = 1 and 8. One GPU is enough for host-time changes (prefill and decode share it);
# with two, ranks take one each. Every run's first requests are checked element by element.
#
# On the development machine:  bash scripts/gpu_wheels.sh   (fills .whl/)
# Device call, carry [".whl"]:  bash scripts/gpu_option_ab.sh
#   (session 32, the control channel's local way: the defaults)
#   OPTION=timer_slack_us ON=1.0 OFF=null BACKEND=nixl bash scripts/gpu_option_ab.sh
#   (session 33: timer slack on staged NIXL)
# ROUNDS (3), REQUESTS (200), SIZES (2,16) and CONC (1,8) set the runs; GIL (never) the switch policy
# (always with EXTRA=--engine-busy: a busy engine at 5 ms starves the handshake, with or
# without this change); VARIANTS ("on off") the order of odd rounds. Results in $OUT (default
# /tmp/lcout): runs.tgz (a JSON and a log per run) and the table printed last (ab.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lcout}
source scripts/gpu_env.sh
ROUNDS=${ROUNDS:-3}
N=${REQUESTS:-200}
SIZES=${SIZES:-2,16}
nvidia-smi -L | head -4
for r in $(seq "$ROUNDS"); do
  case $((r % 2)) in 1) order="${VARIANTS:-on off}" ;; *) order=$(echo ${VARIANTS:-on off} | tr ' ' '\n' | tac | tr '\n' ' ') ;; esac
  for v in $order; do
    val=${ON:-true}; [ "$v" = off ] && val=${OFF:-false}
    run_case "r${r}_$v" python3 scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api \
      --backend "${BACKEND:-cudaipc}" --sizes "$SIZES" --concurrency "${CONC:-1,8}" --requests "$N" --verify-requests 2 \
      --gil-switch "${GIL:-never}" ${EXTRA:-} --control-options "{\"${OPTION:-local_control}\": $val}"
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/ab.txt"
import json, sys
from pathlib import Path
from statistics import median
out = Path(sys.argv[1])
cells = {}
for f in sorted(out.glob("r*_*.json")):
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
names = sorted({w for ways in cells.values() for w in ways})
print("MiB C way | p50 ms per run | median GB/s | median reach ms")
for (mib, conc), ways in sorted(cells.items()):
    for w in names:
        xs = ways.get(w, [])
        if not xs:
            continue
        runs = ", ".join(f"{x[0]:.3f}" for x in xs)
        print(f"{mib:>3} {conc:>2} {w:<6}| {runs} | {median(x[1] for x in xs):.1f} "
              f"| {median(x[2] for x in xs):.3f}")
PY
# one archive instead of a file per run (the device tool brings back a few files a call)
tar czf "$OUT/runs.tgz" -C "$OUT" $(cd "$OUT" && ls r*_*.json r*_*.log) && rm -f "$OUT"/r*_*.json "$OUT"/r*_*.log
