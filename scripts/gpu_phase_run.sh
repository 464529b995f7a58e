#!/usr/bin/env bash
# Where a `cudaipc` request's time goes, per thread and method (scripts/phase_probe.py as
# sitecustomize in the rank processes), beside the same bench without the probe (its cost).
#
# On the development machine:  bash scripts/gpu_wheels.sh   (fills .whl/)
# Device call (one or two GPUs), carry [".whl"]:  bash scripts/gpu_phase_run.sh [bench options]
# Results in $OUT: plain.json/.log, probed.json/.log, phases.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/phaseout}
source scripts/gpu_env.sh
BENCH=(python3 scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api --backend cudaipc
  --sizes "${SIZES:-2,16}" --concurrency "${CONC:-1,8}" --requests "${REQUESTS:-300}"
  --verify-requests 2 "$@")
run_case plain "${BENCH[@]}"
mkdir -p /tmp/phasesc && rm -rf /tmp/phases && cp scripts/phase_probe.py /tmp/phasesc/sitecustomize.py
KVWIRE_PHASE_DIR=/tmp/phases PYTHONPATH=/tmp/phasesc:$PYTHONPATH \
  run_case probed "${BENCH[@]}" --sample-dir /tmp/phases
python3 scripts/phase_probe.py report /tmp/phases --per 1 > "$OUT/phases.txt" 2>&1
for f in plain probed; do grep "^engine" "$OUT/$f.log" | cut -c1-330; done
cat "$OUT/phases.txt"
