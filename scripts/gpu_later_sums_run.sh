#!/usr/bin/env bash
# Issue 26 item 1 on two GPUs: prefill's checksums computed beside the write (later notes).
#  check: scripts/gpu_later_sums_check.py (the later sums equal the sums; host time per call);
#  ab:    scripts/gpu_checksum_engine.py over cudaipc (kv_checksum off and on alternating),
#         this tree and a base tree in ABBA order, ROUNDS rounds (the base's core and cudaipc
#         sources first on PYTHONPATH). CK_EXTRA: more flags for it (e.g. --only 1: checksums on
#         only).
# On the development machine:
#   bash scripts/gpu_wheels.sh                       # fills .whl/
#   rm -rf ab_base && mkdir ab_base && git archive BASE core/src plugins/cudaipc/src | tar -x -C ab_base
# Device call (nvidia-h100-x2), carry [".whl"]. Results: $OUT/later.tgz; table lines printed.
set -uo pipefail
cd "$(dirname "$0")/.."
RES=/tmp/later_res
rm -rf "$RES"  # a machine that kept /tmp must not archive an earlier run's files
OUT_FINAL=${OUT:-/tmp/later_out}
OUT=$RES  # run_case writes here; only the archive goes to the call's $OUT
source scripts/gpu_env.sh
PARTS=${PARTS:-check ab}
ROUNDS=${ROUNDS:-2}
NEW=$PYTHONPATH
BASE=$PWD/ab_base/core/src:$PWD/ab_base/plugins/cudaipc/src:${PYTHONPATH#*:}
if has check; then
  run_case later_check python3 scripts/gpu_later_sums_check.py
  grep -E "chunks|LATER" "$RES/later_check.log"
fi
if has ab; then
  [ -d ab_base/core/src ] || { echo "no ab_base/core/src"; exit 1; }
  for r in $(seq "$ROUNDS"); do
    # ABBA BAAB: over four rounds each tree runs first and last once (session 25 saw the
    # first and last runs of a call slower; with two rounds one tree held both places)
    case $((r % 4)) in 1|0) order="new base" ;; *) order="base new" ;; esac
    for t in $order; do
      pp=$NEW; [ $t = base ] && pp=$BASE
      PYTHONPATH=$pp run_case "ck_${t}_r$r" python3 scripts/gpu_checksum_engine.py \
        --paths cudaipc --rounds 1 --sizes ${SIZES:-16,128} --requests ${REQUESTS:-32} \
        --verify-requests 2 --label "$t" ${CK_EXTRA:-}
      grep -E "^\| cudaipc" "$RES/ck_${t}_r$r.log" | sed "s/^/$t r$r /"
    done
  done
fi
python3 - "$RES" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("ck_*.json")):
    rep = json.loads(f.read_text())
    for path, rounds in rep["paths"].items():
        for r in rounds:
            bad = sum(v["mismatches"] for v in r.get("verified", []))
            failed = sum(c["failed"] for c in r["cells"])
            cells = " ".join(f"{c['mib']}/{c['concurrency']}:{c['gbps']:.1f}" for c in r["cells"])
            print(f"{f.stem} {path} checksum={r.get('kv_checksum')} failed={failed} "
                  f"mismatches={bad} {cells}")
# what checksums add per run (time per request, on against off), and checked GB/s this
# tree / base per round (runs named ck_<tree>_r<round>)
gbps = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("ck_*_r*.json")):
    tree, rnd = f.stem[3:].rsplit("_", 1)
    for path, rounds in json.loads(f.read_text())["paths"].items():
        for r in rounds:
            for c in r["cells"]:
                gbps[(tree, rnd, path, bool(r.get("kv_checksum")), c["mib"], c["concurrency"])] = c["gbps"]
for (tree, rnd, path, on, mib, conc), g in sorted(gbps.items()):
    off = gbps.get((tree, rnd, path, False, mib, conc))
    if on and off:
        base = gbps.get(("base", rnd, path, True, mib, conc)) if tree == "new" else None
        vs = f", checked new/base {g / base:.2f}" if base else ""
        print(f"added {tree} {rnd} {path} {mib}/{conc}: {off / g - 1:+.0%}{vs}")
PY
mkdir -p "$OUT_FINAL"
tar -czf "$OUT_FINAL/later.tgz" -C "$RES" $(cd "$RES" && ls *.json *.log 2>/dev/null)
