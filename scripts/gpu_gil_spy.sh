#!/usr/bin/env bash
# Which code holds the GIL in each rank process while requests run: py-spy (its wheel in
# .whl/tools/, fetched on the development machine with `pip download py-spy`) samples only
# the thread holding the GIL (`--gil`), without pausing the process (`--nonblocking`), in
# every rank process of one engine run, once the run's verified requests are done.
#   SPY_CASES="cudaipc:16 nixl:128" bash scripts/gpu_gil_spy.sh     (device call, carry .whl)
# SPY_FLAGS="--idle --threads" samples every thread's wall time instead (waits included).
# A case is BACKEND:MIB, or BACKEND:MIB:PREFILL_TP:DECODE_TP (e.g. cudaipc:128:1:2).
# SPY_EXTRA: more flags for every case's scripts/gpu_staging_ab.py (e.g. --checksum).
# SPY_CONC: requests in flight (default 8).
# Results: $OUT/spy.tgz (py-spy's raw stacks per process, the runs' logs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/spyout}
source scripts/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl/tools/*.whl > /dev/null
SPY=/tmp/spy/bin/py-spy
for case in ${SPY_CASES:-cudaipc:16 nixl:128}; do
  IFS=: read -r backend mib ptp dtp <<< "$case"; ptp=${ptp:-1}; dtp=${dtp:-1}
  tag="${backend}_${mib}"; [ "$ptp$dtp" != 11 ] && tag="${tag}_tp$ptp$dtp"
  n=$(( mib >= 128 ? 6000 : 20000 ))
  python3 scripts/gpu_staging_ab.py --backend "$backend" --staging auto --sizes "$mib" \
    --concurrency ${SPY_CONC:-8} --requests $n --verify-requests 1 --timeout 300 \
    --prefill-tp "$ptp" --decode-tp "$dtp" ${SPY_EXTRA:-} \
    --json "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1 &
  bench=$!
  for _ in $(seq 600); do grep -q "^verified" "$OUT/$tag.log" 2>/dev/null && break; sleep 0.1; done
  sleep 1.5
  for p in $(pgrep -f multiprocessing-fork); do
    timeout 20 $SPY record ${SPY_FLAGS:---gil} --nonblocking -r 400 -d 5 -f raw \
      -o "$OUT/spy_${tag}_$p.txt" \
      -p "$p" > /dev/null 2>&1 &
  done
  wait $bench
  wait
  echo "$tag: $(grep '^summary' "$OUT/$tag.log")"; ls "$OUT" | grep "spy_$tag" | head
done
(cd "$OUT" && tar czf spy.tgz ./*.txt ./*.log ./*.json && rm -f ./*.txt ./*.log ./*.json)
