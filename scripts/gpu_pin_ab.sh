#!/usr/bin/env bash
# Does pinning each rank process to its own CPUs (--pin-cpus) steady the GPU engine benches?
# One device call: the same tree unpinned and pinned, alternating, ROUNDS rounds, BACKEND
# (default nixl, default staging) at SIZES (16,128) and C=8. Prints each run's summary.
#   bash scripts/gpu_wheels.sh; then on the device (carry .whl): bash scripts/gpu_pin_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pinout}
source scripts/gpu_env.sh
AB="scripts/gpu_staging_ab.py --requests ${REQUESTS:-64} --verify-requests 2 --timeout 120
    --backend ${BACKEND:-nixl} --staging auto --sizes ${SIZES:-16,128} --concurrency 8"
for r in $(seq "${ROUNDS:-4}"); do
  for mode in free pinned; do
    flag=""; [ $mode = pinned ] && flag="--pin-cpus"
    t0=$SECONDS
    # shellcheck disable=SC2086
    python3 $AB $flag --json "$OUT/${mode}_r$r.json" > "$OUT/${mode}_r$r.log" 2>&1
    echo "$mode r$r $((SECONDS - t0)) s: $(grep '^summary' "$OUT/${mode}_r$r.log")"
  done
done
(cd "$OUT" && tar czf pin.tgz ./*.json ./*.log && rm -f ./*.json ./*.log)
