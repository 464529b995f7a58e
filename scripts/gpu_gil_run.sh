#!/usr/bin/env bash
# The GIL switch-interval policy on a GPU host (kvwire.gil; docs/control-plane.md, "The GIL and
# an engine thread that runs Python"): cudaipc between two GPUs, C=1 and 8, 2 and 16 MiB,
# behind a sleeping engine loop and a busy one, control.gil_switch auto against never and
# always, and TP 1 -> 2; and (stage "notes") cudaipc's notes over ZeroMQ against the local
# datagram socket (tcp option local_notes). Every request's elements are checked first. Each
# run settles 12 s after its warm-up, so a watch that lowered the interval for the start's
# burst of Python has probed it back; each cell records every rank's interval and lowerings.
#
# On the development machine:  bash scripts/gpu_wheels.sh   (fills .whl/, ~34 MiB)
# Device call (nvidia-h100-x2), carry [".whl"], at most 600 s a call, so by stage:
#   STAGES="sleep busy" bash scripts/gpu_gil_run.sh      then   STAGES="tp notes" bash ...
# SLEEP_MODES, BUSY_MODES and NOTES narrow a stage (sleep_auto is notes_true: both defaults).
# Results: $OUT/<stage>_<mode>_<round>.json and .log; the last lines printed are the table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gilout}
source scripts/gpu_env.sh
nvidia-smi topo -m > "$OUT/env.txt" 2>&1
ROUNDS=${ROUNDS:-2}
B="python3 scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api --backend cudaipc
   --requests 48 --verify-requests 4 --settle-s 12 --timeout 120"
run() {  # name, then the bench's options
  local name=$1; shift
  timeout 150 $B "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
}
for r in $(seq "$ROUNDS"); do
  for s in ${STAGES:-sleep busy tp}; do
    case $s in
      sleep) for g in ${SLEEP_MODES:-auto never always}; do run "sleep_${g}_$r" --sizes 2,16 --concurrency 1,8 --gil-switch $g; done ;;
      busy) for g in ${BUSY_MODES:-auto always}; do run "busy_${g}_$r" --sizes 2,16 --concurrency 1,8 --engine-busy --gil-switch $g; done ;;
      tp) for g in auto never; do run "tp12_${g}_$r" --sizes 16 --concurrency 1,8 --decode-tp 2 --gil-switch $g; done ;;
      notes) for n in ${NOTES:-false true}; do run "notes_${n}_$r" --sizes 2,16 --concurrency 1,8 --backend-options "{\"local_notes\": $n}"; done ;;
    esac
  done
done
python3 - "$OUT" <<'EOF'
import glob, json, os, sys
print(f"{'run':<18} {'MiB':>4} {'C':>2} {'p50 ms':>8} {'p90 ms':>8} {'GB/s':>6} {'fail':>4} {'land':>5}  interval_us / lowerings")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*_*_*.json"))):
    try:
        cells = json.load(open(path))["engine"]["cells"]
    except Exception as exc:  # a run that failed: its log says why
        print(f"{os.path.basename(path)[:-5]:<18} no cells ({exc})")
        continue
    for c in cells:
        g = c.get("gil", {})
        print(f"{os.path.basename(path)[:-5]:<18} {c['mib']:>4} {c['concurrency']:>2} "
              f"{c['p50_ms']:>8.2f} {c['p90_ms']:>8.2f} {c['gbps']:>6.1f} {c['failed']:>4} "
              f"{c.get('stages_ms', {}).get('land', float('nan')):>5.2f}  "
              f"{g.get('interval_us')} / {g.get('lowerings')}")
EOF
