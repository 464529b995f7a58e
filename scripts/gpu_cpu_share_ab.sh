#!/usr/bin/env bash
# Does a rank process run its request path faster on fewer CPUs? Each rank process pinned to
# K CPUs of its own (taskset over the whole bench, then --pin-cpus: an equal share per rank),
# beside the unpinned bench, rotated over ROUNDS rounds. A thread hand-off inside a process
# (the GIL passed between kvwire's threads and the engine's) is a same-CPU switch when the
# process has one CPU, a cross-CPU wake-up otherwise (docs/benchmarks.md, "What one step costs
# on the GPU hosts"). TPS ("1 1;1 2"), MODES ("free pin1 pin2"), BACKEND (cudaipc),
# SIZES (16,128), CONC (8), REQUESTS (64), AB_EXTRA (e.g. "--gil-switch never").
#   bash scripts/gpu_wheels.sh; device call (carry .whl): bash scripts/gpu_cpu_share_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cpushare}
source scripts/gpu_env.sh
AB="scripts/gpu_staging_ab.py --requests ${REQUESTS:-64} --verify-requests 1 --timeout 120
    --backend ${BACKEND:-cudaipc} --staging auto --sizes ${SIZES:-16,128}
    --concurrency ${CONC:-8} ${AB_EXTRA:-}"
IFS=';' read -r -a TPL <<< "${TPS:-1 1;1 2}"
read -r -a MODES <<< "${MODES:-free pin1 pin2}"
n=${#MODES[@]}
for r in $(seq "${ROUNDS:-2}"); do
  for tp in "${TPL[@]}"; do
    read -r ptp dtp <<< "$tp"
    for i in $(seq 0 $((n - 1))); do
      mode=${MODES[$(((i + r - 1) % n))]}
      pre=(); flag=""
      if [ "$mode" != free ]; then
        k=${mode#pin}; last=$(((ptp + dtp) * k))  # one CPU more: the driver's
        pre=(taskset -c "0-$last"); flag="--pin-cpus"
      fi
      # shellcheck disable=SC2086
      run_case "tp$ptp${dtp}_${mode}_r$r" "${pre[@]}" python3 $AB $flag \
        --prefill-tp "$ptp" --decode-tp "$dtp"
    done
  done
done
(cd "$OUT" && tar czf cpushare.tgz ./*.json ./*.log && rm -f ./*.json ./*.log)
