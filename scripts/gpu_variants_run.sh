#!/usr/bin/env bash
# Options side by side on one device call: each VARIANT is NAME=FLAGS (flags added to
# scripts/gpu_staging_ab.py, e.g. w2=--control-options={"num_workers":2}); ROUNDS rounds, the
# variants' order rotated each round (a position effect cancels); every run's first requests
# checked element by element. BACKEND (cudaipc), PTP/DTP (1 2), SIZES (16,128), CONC (8),
# REQUESTS (96). Variants are separated by ';', flags by spaces (JSON without spaces).
# On the development machine: bash scripts/gpu_wheels.sh (fills .whl/). Device call, carry
# [".whl"]:  VARIANTS='base=;w2=--control-options {"num_workers":2}' bash scripts/gpu_variants_run.sh
# Results: $OUT/variants.tgz (JSON and log per run, rewritten after each round); summary lines
# printed, then medians.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_FINAL=${OUT:-/tmp/variants_out}
OUT=/tmp/variants_res  # run_case writes here; only the archive goes to the call's $OUT
source scripts/gpu_env.sh
mkdir -p "$OUT_FINAL"
ROUNDS=${ROUNDS:-3}
IFS=';' read -r -a VS <<< "${VARIANTS:-base=}"
AB="scripts/gpu_staging_ab.py --requests ${REQUESTS:-96} --verify-requests 1 --timeout 120
    --backend ${BACKEND:-cudaipc} --staging auto --sizes ${SIZES:-16,128}
    --concurrency ${CONC:-8} --prefill-tp ${PTP:-1} --decode-tp ${DTP:-2}"
n=${#VS[@]}
for r in $(seq "$ROUNDS"); do
  for i in $(seq 0 $((n - 1))); do
    v=${VS[$(((i + r - 1) % n))]}
    name=${v%%=*}; flags=${v#*=}
    read -r -a extra <<< "$flags"
    run_case "${name}_r$r" python3 $AB "${extra[@]}"
  done
  tar -czf "$OUT_FINAL/variants.tgz" -C "$OUT" $(cd "$OUT" && ls *.json *.log 2>/dev/null) 2>/dev/null
done
python3 - "$OUT" <<'PY'
import json, pathlib, statistics, sys
from collections import defaultdict
cells = defaultdict(list)
for f in sorted(pathlib.Path(sys.argv[1]).glob("*_r*.json")):
    name = f.stem.rsplit("_r", 1)[0]
    rep = json.loads(f.read_text())
    bad = [v for v in rep.get("verified", []) if v["mismatches"]]
    for c in rep["cells"]:
        cells[(name, c["mib"], c["concurrency"])].append((c["gbps"], c["failed"], bool(bad)))
for (name, mib, conc), xs in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    g = [x[0] for x in xs]
    print(f"{name:>10} {mib:>4} MiB C={conc}: median {statistics.median(g):7.1f} GB/s "
          f"runs {' '.join(f'{x:.1f}' for x in g)} failed {sum(x[1] for x in xs)} "
          f"bad_verify {sum(x[2] for x in xs)}")
PY
