#!/usr/bin/env bash
# Where a C=1 `cudaipc` request's time goes on a GPU host: the engine bench at 2 and 16 MiB
# under scripts/gpu_call_tracer.py (as sitecustomize in the rank processes), then the tracer's
# report (per function, and the first requests' timelines, one clock for the host).
#
# On the development machine:  bash scripts/gpu_wheels.sh   (fills .whl/)
# Device call (nvidia-h100-x2), carry [".whl"]:  bash scripts/gpu_trace_run.sh [bench options]
# Results in $OUT (default /tmp/traceout): trace.log (the report), c1.json, trace.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/traceout}
source scripts/gpu_env.sh
mkdir -p /tmp/tracer /tmp/trace && rm -rf /tmp/trace/*
cp scripts/gpu_call_tracer.py /tmp/tracer/sitecustomize.py
export PYTHONPATH=/tmp/tracer:$PYTHONPATH
export KVWIRE_TRACE_DIR=/tmp/trace
timeout 200 python3 scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api --backend cudaipc \
  --sizes 2,16 --concurrency 1 --requests 24 --verify-requests 2 --sample-dir /tmp/trace \
  --json "$OUT/c1.json" "$@" > "$OUT/c1.log" 2>&1
echo "bench rc=$?"
grep "^engine" "$OUT/c1.log" | cut -c1-400
python3 scripts/gpu_call_tracer.py report /tmp/trace > "$OUT/trace.log" 2>&1
cat "$OUT/trace.log"
tar czf "$OUT/trace.tgz" -C /tmp trace
