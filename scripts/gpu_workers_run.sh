#!/usr/bin/env bash
# One transfer worker for cudaipc (TransferBackend.suggested_workers) against four, on two
# GPUs: C=1 and C=8, equal TP, TP 1 -> 2 and 2 -> 1, and with kv_checksum on; alternating,
# ROUNDS rounds, every cell's first requests checked element by element.
# On the development machine:  bash scripts/gpu_wheels.sh   (fills .whl/)
# Device call (nvidia-h100-x2), carry [".whl"]:  bash scripts/gpu_workers_run.sh
# Results: $OUT/w.tgz (one JSON and log per run); the last lines printed are the table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/wout}
source scripts/gpu_env.sh
B="python3 scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api --backend cudaipc
   --requests ${REQUESTS:-300} --verify-requests 4 --timeout 120"
C="python3 scripts/gpu_checksum_engine.py --paths cudaipc --only 1 --rounds 1 --sizes 16,128
   --concurrency 8 --requests 96"
run() {  # name, then the command
  local name=$1; shift
  timeout 200 "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
}
for r in $(seq "${ROUNDS:-2}"); do
  for w in 1 4; do
    opt="{\"num_workers\": $w}"
    run "eq_w${w}_$r" $B --sizes 2,16,128 --concurrency 1,8 --control-options "$opt"
    run "tp12_w${w}_$r" $B --sizes 16,128 --concurrency 8 --decode-tp 2 --control-options "$opt"
    run "tp21_w${w}_$r" $B --sizes 16,128 --concurrency 8 --prefill-tp 2 --control-options "$opt"
    run "sums_w${w}_$r" $C --control-options "$opt"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
print(f"{'run':<14} {'MiB':>4} {'C':>2} {'p50 ms':>7} {'GB/s':>7} {'fail':>4}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*_w*_*.json"))):
    d = json.load(open(path))
    if "engine" in d:
        cells = d["engine"]["cells"]
    else:  # gpu_checksum_engine: its rounds' cells
        cells = [c for runs in d["paths"].values() for r in runs for c in r.get("cells", [])]
    for c in cells:
        print(f"{os.path.basename(path)[:-5]:<14} {c['mib']:>4} {c['concurrency']:>2} "
              f"{c['p50_ms']:>7.2f} {c['gbps']:>7.1f} {c['failed']:>4}")
PY
cd "$OUT" && tar czf w.tgz ./*_w*_* && rm -f ./*_w*_*
