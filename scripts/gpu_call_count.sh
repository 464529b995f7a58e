#!/usr/bin/env bash
# Python calls per request and thread in every rank process of GPU engine runs: each CASE runs
# twice (REQS_A and REQS_B timed requests) with scripts/call_counter.py as sitecustomize;
# scripts/call_counter_diff.py then divides the difference of the two runs' counts by
# REQS_B - REQS_A (start-up and warm-up cancel). A case is BACKEND:MIB:PREFILL_TP:DECODE_TP.
#   CC_CASES="cudaipc:16:1:1 cudaipc:16:1:2" bash scripts/gpu_call_count.sh   (device, carry .whl)
# Results: $OUT/cc.tgz (one folder of per-process counts per run) and the diffs printed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ccout}
source scripts/gpu_env.sh
mkdir -p /tmp/ccsite && cp scripts/call_counter.py /tmp/ccsite/sitecustomize.py
A=${REQS_A:-100}; B=${REQS_B:-300}
for case in ${CC_CASES:-cudaipc:16:1:1 cudaipc:16:1:2}; do
  IFS=: read -r backend mib ptp dtp <<< "$case"
  for n in $A $B; do
    d="$OUT/cc_${backend}_${mib}_tp$ptp${dtp}_$n"; mkdir -p "$d"
    CC_DIR=$d PYTHONPATH=/tmp/ccsite:$PYTHONPATH timeout 200 python3 scripts/gpu_staging_ab.py \
      --backend "$backend" --staging auto --sizes "$mib" --concurrency ${CC_CONC:-8} \
      --requests "$n" --verify-requests 1 --timeout 120 --prefill-tp "$ptp" --decode-tp "$dtp" \
      ${CC_EXTRA:-} --json "$d/run.json" > "$d/run.log" 2>&1
    echo "$case n=$n rc=$?: $(grep '^summary' "$d/run.log")"
  done
  python3 scripts/call_counter_diff.py "$OUT/cc_${backend}_${mib}_tp$ptp${dtp}_$A" \
    "$OUT/cc_${backend}_${mib}_tp$ptp${dtp}_$B" $((B - A)) "${CC_THREAD:-*}" 2>&1 | head -${CC_LINES:-90}
done
(cd "$OUT" && tar czf cc.tgz cc_* && rm -rf cc_*)
