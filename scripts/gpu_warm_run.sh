#!/usr/bin/env bash
# The page mover's warm-up at a link's handshake, one device call (nvidia-h200-x2 or
# nvidia-h100-x2):
#  check: scripts/gpu_warm_check.py (each link shape's first writes, cold and warmed, in
#         fresh processes with empty Triton caches; every element checked);
#  e2e:   cudaipc end to end, base tree against this one, ROUNDS rounds alternating, each run
#         with an empty Triton cache (a fresh host), the C=8 cell first (SIZES, default 2,16;
#         REQUESTS, default 400): a first cell that pays the batch kernel's compile.
# On the development machine: bash scripts/gpu_wheels.sh, and
#   rm -rf ab_base && mkdir ab_base && git archive BASE core/src plugins/cudaipc/src | tar -x -C ab_base
# Device call, carry [".whl", "ab_base"]. Results: $OUT/warm.tgz; summary lines printed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/warm}
source scripts/gpu_env.sh
PARTS=${PARTS:-check e2e}
NEW=$PYTHONPATH
BASE=$PWD/ab_base/core/src:$PWD/ab_base/plugins/cudaipc/src:${PYTHONPATH#*:}
if has check; then
  t0=$SECONDS
  timeout 400 python3 scripts/gpu_warm_check.py --json "$OUT/warm_check.json" > "$OUT/warm_check.log" 2>&1
  echo "check rc=$? $((SECONDS - t0)) s"; tail -9 "$OUT/warm_check.log"
fi
if has e2e; then
  [ -d ab_base/core/src ] || { echo "no ab_base/core/src"; exit 1; }
  for r in $(seq "${ROUNDS:-2}"); do
    case $((r % 2)) in 1) order="base new" ;; *) order="new base" ;; esac
    for t in $order; do
      pp=$NEW; [ $t = base ] && pp=$BASE
      cache=$(mktemp -d)
      TRITON_CACHE_DIR=$cache PYTHONPATH=$pp run_case "e2e_${t}_r$r" python3 scripts/gpu_staging_ab.py \
        --backend cudaipc --staging auto --sizes "${SIZES:-2,16}" --concurrency 8,1 \
        --requests "${REQUESTS:-400}" --verify-requests 2 --gil-switch never
      rm -rf "$cache"
    done
  done
fi
(cd "$OUT" && tar czf warm.tgz ./*.json ./*.log && rm -f ./*.json ./*.log)
