#!/usr/bin/env bash
# The default staging on GPUs (`auto`: bulk staging at its GPU sizes, long chunks cut into
# buffer-sized chunks) against the alternatives, one device call (nvidia-h100-x4 or x2):
#  1. `kvwire bench --device cuda` over every path (default, staged at large sizes, per-page,
#     cudaipc) at 16, 128 and 512 MiB, C = 1 and 8, beside the torch peer copy;
#  2. cudaipc with heterogeneous TP: `--staging direct` (head slices written in page form)
#     against `--staging bulk` (head slices staged through decode's ring), TP 2 -> 1 and 1 -> 2;
#  3. NIXL with the default staging at TP 2 -> 1 and 1 -> 2, one request a chunk.
# Every run's first requests are checked element by element.
# On the development machine:  bash scripts/gpu_wheels.sh   (fills .whl/); carry [".whl"].
# Results: $OUT/staging.tgz (JSON and log per run); the bench's table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/stagingout}
source scripts/gpu_env.sh
N=${REQUESTS:-48}
PARTS=${PARTS:-bench cudaipc nixl}
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1; head -5 "$OUT/topo.txt"
AB="python3 scripts/gpu_staging_ab.py --requests $N --verify-requests 2 --timeout 120
    --sizes 16,128 --concurrency 1,8"
if has cudaipc; then
  for tp in "2 1" "1 2"; do
    set -- $tp; tag="$1$2"
    run_case "cu_direct_tp$tag" $AB --backend cudaipc --prefill-tp "$1" --decode-tp "$2" --staging direct
    run_case "cu_bulk_tp$tag" $AB --backend cudaipc --prefill-tp "$1" --decode-tp "$2" --staging bulk
  done
fi
if has sizes; then  # the default staging's GPU sizes against larger ones, TP 1 -> 1
  for sz in "32 2 256" "64 4 512" "128 8 1024"; do
    set -- $sz; M=$((1 << 20))
    run_case "nixl_auto_b$1" $AB --backend nixl --staging auto --sizes 16,128,512 --staging-options \
      "{\"buffer_bytes\": $(($1 * M)), \"block_bytes\": $(($2 * M)), \"ring_bytes\": $(($3 * M))}"
  done
fi
if has nixl; then
  for tp in "2 1" "1 2"; do
    set -- $tp; tag="$1$2"
    run_case "nixl_auto_tp$tag" $AB --backend nixl --prefill-tp "$1" --decode-tp "$2" --staging auto
  done
  run_case "nixl_auto_views_tp11" $AB --backend nixl --staging auto --no-kv-tensors
fi
if has bench; then
  t0=$SECONDS
  timeout 420 python3 -m kvwire.cli bench --device cuda --mib 16,128,512 \
    --concurrency 1,8 --requests 32 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? $((SECONDS - t0)) s"
fi
(cd "$OUT" && tar czf staging.tgz ./*.json ./*.log topo.txt && rm -f ./*.json ./*.log)
[ -f "$OUT/staging.tgz" ] && tar xzf "$OUT/staging.tgz" -O ./bench.log 2>/dev/null | tail -30
