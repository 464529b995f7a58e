#!/usr/bin/env bash
# This tree against a base tree, one device call (nvidia-h100-x2 or nvidia-h200-x2), and stack
# samples of this tree:
#  ab:     NIXL with the default staging (auto), TP 1 -> 1, 16 and 128 MiB, C = 1 and 8:
#          base and this tree alternating, ROUNDS rounds, base first in odd rounds and second
#          in even ones (the base's core and cudaipc sources first on PYTHONPATH; the other
#          plugins are this tree's);
#  sample: this tree, the same path at 16 and 128 MiB C=8, 200 requests, scripts/rank_sampler.py;
#  tp12:   cudaipc TP 1 -> 1 and TP 1 -> 2 at 16 and 128 MiB, C = 8 (issue 28; with two GPUs the
#          second decode rank shares GPU 0 with prefill);
#  bench:  `kvwire bench --device cuda` (every path, 16, 128 and 512 MiB, C = 1 and 8).
# SIZES and CONC set the ab part's cells (default 16,128 and 1,8), BACKEND its backend (nixl),
# PTP and DTP its prefill and decode TP (1 and 1), TAG a suffix of its runs' names, AB_EXTRA
# more flags for its runs (e.g. "--gil-switch never": kvwire's GIL watch lowers the switch
# interval after a run's start-up burst of Python in some runs and not in others, which moves
# a run's GB/s by up to 1.5x on the GPU hosts; fix it for both trees when comparing).
# Every run's first requests are checked element by element.
# On the development machine:
#   bash scripts/gpu_wheels.sh                       # fills .whl/
#   rm -rf ab_base && mkdir ab_base && git archive BASE core/src plugins/cudaipc/src | tar -x -C ab_base
# Device call, carry [".whl"] (ab_base/ is untracked, so it travels; never commit it).
# Results: $OUT/ab.tgz (JSON and log per run, sampler reports); summary lines are printed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/about}
source scripts/gpu_env.sh
N=${REQUESTS:-48}
ROUNDS=${ROUNDS:-2}
PARTS=${PARTS:-ab sample tp12}
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1; head -4 "$OUT/topo.txt"
AB="scripts/gpu_staging_ab.py --requests $N --verify-requests 2 --timeout 120"
NEW=$PYTHONPATH
BASE=$PWD/ab_base/core/src:$PWD/ab_base/plugins/cudaipc/src:${PYTHONPATH#*:}  # base cudaipc if exported
if has ab; then
  [ -d ab_base/core/src ] || { echo "no ab_base/core/src"; exit 1; }
  for r in $(seq "$ROUNDS"); do
    # ABBA BAAB: a drift cancels, and over four rounds each tree runs first and last once
    case $((r % 4)) in 1|0) order="base new" ;; *) order="new base" ;; esac
    for t in $order; do
      pp=$NEW; [ $t = base ] && pp=$BASE
      PYTHONPATH=$pp run_case "st_${t}_r$r${TAG:-}" python3 $AB --backend "${BACKEND:-nixl}" \
        --staging auto --sizes "${SIZES:-16,128}" --concurrency "${CONC:-1,8}" \
        --prefill-tp "${PTP:-1}" --decode-tp "${DTP:-1}" ${AB_EXTRA:-}
    done
  done
fi
if has sample; then
  mkdir -p /tmp/sc && cp scripts/rank_sampler.py /tmp/sc/sitecustomize.py
  for mib in 16 128; do
    d="$OUT/sample_st$mib"; mkdir -p "$d"
    KVWIRE_SAMPLE_DIR=$d KVWIRE_SAMPLE_US=250 PYTHONPATH=/tmp/sc:$NEW \
      run_case "smp_st$mib" python3 $AB --backend nixl --staging auto --sizes $mib --concurrency 8 \
      --requests 200 --verify-requests 1 --sample-dir "$d"
    python3 scripts/rank_sampler.py report "$d" --per 200 --top 16 > "$OUT/smp_st$mib.txt" 2>&1
    grep -E "== pid|-- thread" "$OUT/smp_st$mib.txt"
    rm -rf "$d"
  done
fi
if has tp12; then
  for tp in "1 1" "1 2"; do
    set -- $tp
    run_case "cu_tp$1$2" python3 $AB --backend cudaipc --staging auto --prefill-tp "$1" \
      --decode-tp "$2" --sizes 16,128 --concurrency 8 --requests 200
  done
fi
if has bench; then
  t0=$SECONDS
  timeout 300 python3 -m kvwire.cli bench --device cuda --mib 16,128,512 --concurrency 1,8 \
    --requests 32 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? $((SECONDS - t0)) s"; tail -22 "$OUT/bench.log"
fi
[ -n "${KEEP:-}" ] && exit 0  # a caller running more parts tars $OUT itself
(cd "$OUT" && tar czf ab.tgz ./*.json ./*.log ./*.txt && rm -f ./*.json ./*.log ./smp*.txt)
