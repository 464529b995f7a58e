#!/usr/bin/env bash
# cudaipc's batched page writes (a worker turn's chunks under batch_max_bytes in one launch and
# one event) on (the default, 32 MiB) against off (batch_max_bytes 0; ON='{...}' for other
# options), alternating, ROUNDS rounds, on four GPUs (every rank on
# its own GPU): TP 1 -> 1 at C=1 and 8, TP 1 -> 2 and TP 2 -> 1 at C=8, head-major decode
# pages TP 2 -> 2 at C=8, and `auto` TP 1 -> 1 at C=8 (on only); every cell's first requests checked
# element by element.
# On the development machine:  bash scripts/gpu_wheels.sh   (fills .whl/)
# Device call (nvidia-h100-x4), carry [".whl"]:  bash scripts/gpu_batch_ab.sh
# SHAPES picks shapes (default "tp11 tp12 tp21 hm22 auto11"), ROUNDS, REQUESTS.
# Results: $OUT/ab.tgz (one JSON and log per run); the last lines printed are the table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/about}
source scripts/gpu_env.sh
B="python3 scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api
   --requests ${REQUESTS:-96} --verify-requests 2 --timeout 120"
SHAPES=" ${SHAPES:-tp11 tp12 tp21 hm22 auto11} "
run() {  # name, then the command (skipped unless its shape is in SHAPES)
  local name=$1; shift
  [[ "$SHAPES" == *" ${name%%_*} "* ]] || return 0
  local t0=$SECONDS
  timeout 200 "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0)) s"
}
for r in $(seq "${ROUNDS:-2}"); do
  for on in true false; do
    if [ $on = true ]; then o=${ON:-'{}'}; else o='{"batch_max_bytes": 0}'; fi
    tag="$([ $on = true ] && echo on || echo off)_$r"
    run "tp11_$tag" $B --backend cudaipc --sizes 16,128 --concurrency 1,8 --backend-options "$o"
    run "tp12_$tag" $B --backend cudaipc --sizes 16,128 --concurrency 8 --decode-tp 2 \
      --backend-options "$o"
    run "tp21_$tag" $B --backend cudaipc --sizes 16,128 --concurrency 8 --prefill-tp 2 \
      --backend-options "$o"
    run "hm22_$tag" $B --backend cudaipc --sizes 16,128 --concurrency 8 --prefill-tp 2 \
      --decode-tp 2 --head-major decode --backend-options "$o"
    if [ $on = true ]; then  # `auto` (batching on by default): it works through the list
      run "auto11_$tag" $B --backend auto --sizes 16,128 --concurrency 8
    fi
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
from collections import defaultdict
cells = defaultdict(dict)
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*_o*_*.json"))):
    name = os.path.basename(path)[:-5]
    shape, on, r = name.split("_")
    d = json.load(open(path))
    bad = sum(v["mismatches"] for v in d["engine"]["verified"])
    for c in d["engine"]["cells"]:
        key = (shape, c["mib"], c["concurrency"])
        cells[key].setdefault(on, []).append((c["gbps"], c["p50_ms"], c["failed"] + bad))
print(f"{'shape':<7} {'MiB':>4} {'C':>2} {'on GB/s':>16} {'off GB/s':>16} {'on/off':>6} {'bad':>4}")
for (shape, mib, conc), v in sorted(cells.items()):
    on, off = v.get("on", []), v.get("off", [])
    f = lambda xs: ",".join(f"{g:.1f}" for g, _, _ in xs)
    m = lambda xs: sum(g for g, _, _ in xs) / max(1, len(xs))
    bad = sum(b for g, _, b in on + off)
    print(f"{shape:<7} {mib:>4} {conc:>2} {f(on):>16} {f(off):>16} {m(on) / max(m(off), 1e-9):>6.2f} {bad:>4}")
PY
cd "$OUT" && tar czf ab.tgz ./*_o*_* && rm -f ./*_o*_*
