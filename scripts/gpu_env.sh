# Sourced by the GPU run scripts (scripts/gpu_gil_run.sh, scripts/gpu_trace_run.sh) on the
# device machine, from the repository root, with OUT set: the environment those runs share,
# and the wheels of .whl/ (scripts/gpu_wheels.sh) installed into /tmp/site. Sets PYTHONPATH
# to this tree's sources first, then /tmp/site.
export UCX_MODULES=^efa NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl .whl/nixl/*.whl > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
export PYTHONPATH=$PWD/core/src:$PWD/plugins/cudaipc/src:$PWD/plugins/nixl/src:$PWD/plugins/hisparse/src:/tmp/site
# The GPU run scripts' shared helpers: has PART (is PART in $PARTS) and run_case NAME CMD...
# (CMD with --json $OUT/NAME.json, its output in $OUT/NAME.log, 200 s at most; prints the
# exit status, the seconds and the run's `summary` line).
has() { [[ " ${PARTS:-} " == *" $1 "* ]]; }
run_case() {
  local name=$1; shift
  local t0=$SECONDS
  timeout 200 "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0)) s: $(grep '^summary' "$OUT/$name.log")"
}
