#!/usr/bin/env bash
# An engine that computes first (prefill sends before decode asks, as vLLM's prefill) against
# one that waits for the asks (as SGLang's): the harness's --send-first, this tree, one device
# call. TP from TPS (default "1 2": prefill TP 1, decode TP 2), BACKEND (cudaipc), ROUNDS
# rounds alternating wait/first and first/wait, SIZES and CONC. Every run's first requests are
# checked element by element.
#   bash scripts/gpu_wheels.sh      # then a device call, carry [".whl"]
#   ROUNDS=2 bash scripts/gpu_send_first_ab.sh
# Results: $OUT/send_first.tgz (JSON and log per run); summary lines are printed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sendfirst}
source scripts/gpu_env.sh
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1; head -4 "$OUT/topo.txt"
read -r ptp dtp <<< "${TPS:-1 2}"
for r in $(seq "${ROUNDS:-2}"); do
  order="wait first"; [ $((r % 2)) = 0 ] && order="first wait"
  for m in $order; do
    flag=""; [ "$m" = first ] && flag="--send-first"
    run_case "${m}_tp$ptp${dtp}_r$r" python3 scripts/gpu_staging_ab.py --backend "${BACKEND:-cudaipc}" \
      --staging auto --prefill-tp "$ptp" --decode-tp "$dtp" --sizes "${SIZES:-16,128}" \
      --concurrency "${CONC:-1,8}" --requests "${REQUESTS:-96}" --verify-requests 2 --timeout 120 $flag
  done
done
[ -n "${KEEP:-}" ] && exit 0
(cd "$OUT" && tar czf send_first.tgz ./*.json ./*.log && rm -f ./*.json ./*.log)
