#!/usr/bin/env bash
# Issue 28 on a machine with four GPUs, every rank on its own GPU (the benches place ranks round
# robin over every visible GPU, prefill first): TP 1 -> 1, 2 -> 2, 2 -> 1 and 1 -> 2 over
# cudaipc (page writes), `auto` and staged NIXL; TP 2 -> 2 with decode pages of 32 tokens and
# with head-major decode pages, an MLA model TP 2 -> 1; per-page NIXL TP 2 -> 2 as the baseline;
# torch peer copies per rank pair (and GPU 0 to two GPUs at once, TP 1 -> 2's source). Every
# cell's first requests are checked element by element.
# On the development machine:  bash scripts/gpu_wheels.sh   (fills .whl/)
# Device call (nvidia-h100-x4), carry [".whl"]:  bash scripts/gpu_tp4_run.sh
# PARTS picks parts (default "peer cudaipc auto staged shapes sample"; also "nixl" (NIXL
# with the default staging), "shapes_cu", "shapes_nixl", "hm", "views", "pages", "sample_auto",
# "sample_staged", "gil": cudaipc TP 1 -> 1, 2 -> 2, 2 -> 1 and 1 -> 2 again with the switch
# interval held at 100 us (--gil-switch always)); REQUESTS, SIZES; CU_EXTRA: more flags for
# every gpu_cudaipc_bench.py run (e.g. "--gil-switch never").
# Results: $OUT/tp4.tgz (one JSON and log per run); the last lines printed are the table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tp4out}
source scripts/gpu_env.sh
PARTS=${PARTS:-peer cudaipc auto staged shapes sample}
SIZES=${SIZES:-16,128}
N=${REQUESTS:-64}
CU="python3 scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api --requests $N
    --verify-requests 2 --timeout 120 --sizes $SIZES --concurrency 1,8 ${CU_EXTRA:-}"
ST="python3 scripts/gpu_staged_bench.py --chunk-pages 64 --block-mib 8 --ring-mib 1024
    --requests $N --verify-requests 2 --timeout 120 --sizes $SIZES --concurrency 1,8
    --skip-mover --skip-per-page"
run() {  # name, then the command
  local name=$1; shift
  local t0=$SECONDS
  timeout 240 "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0)) s"
}
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1; head -6 "$OUT/topo.txt"
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has peer; then
  python3 - "$OUT/peer.json" <<'PY'
import json, sys, torch
n, MiB = torch.cuda.device_count(), 1 << 20
def peer(src, dsts, mib):
    a = torch.empty(mib * MiB, dtype=torch.uint8, device=f"cuda:{src}")
    bs = [torch.empty(mib * MiB, dtype=torch.uint8, device=f"cuda:{d}") for d in dsts]
    ts = []
    for i in range(12):
        for d in [src, *dsts]:
            torch.cuda.synchronize(d)
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(src):
            s.record()
            for b in bs:
                b.copy_(a, non_blocking=True)
            e.record()
        e.synchronize()
        if i >= 2:
            ts.append(s.elapsed_time(e))
    ms = sorted(ts)[len(ts) // 2]
    return round(len(dsts) * mib * MiB / ms / 1e6, 1)
res = {"gpus": [torch.cuda.get_device_name(i) for i in range(n)], "cells": []}
for mib in (16, 128, 512):
    for src, dsts in ((0, [1]), (0, [2]), (1, [2]), (1, [3]), (0, [1, 2])):
        if max(dsts) < n:
            res["cells"].append({"src": src, "dsts": dsts, "mib": mib, "gbps": peer(src, dsts, mib)})
            print(f"peer {src}->{dsts} {mib} MiB: {res['cells'][-1]['gbps']} GB/s")
json.dump(res, open(sys.argv[1], "w"), indent=1)
PY
fi
for tp in "1 1" "2 2" "2 1" "1 2"; do
  set -- $tp; tag="$1$2"
  has cudaipc && run "cu_tp$tag" $CU --backend cudaipc --prefill-tp "$1" --decode-tp "$2"
  has auto && run "auto_tp$tag" $CU --backend auto --prefill-tp "$1" --decode-tp "$2"
  has nixl && run "nx_tp$tag" $CU --backend nixl --prefill-tp "$1" --decode-tp "$2"
  has staged && run "st_tp$tag" $ST --prefill-tp "$1" --decode-tp "$2"
done
if has gil; then
  for tp in "1 1" "2 2" "2 1" "1 2"; do
    set -- $tp
    run "cu_tp$1$2_always" $CU --backend cudaipc --prefill-tp "$1" --decode-tp "$2" --gil-switch always
  done
fi
if has shapes; then
  run cu_pg32 $CU --backend cudaipc --prefill-tp 2 --decode-tp 2 --decode-page-size 32
  run cu_hm $CU --backend cudaipc --prefill-tp 2 --decode-tp 2 --head-major decode
  run cu_mla21 $CU --backend cudaipc --prefill-tp 2 --decode-tp 1 --mla
  run st_pg32 $ST --prefill-tp 2 --decode-tp 2 --decode-page-size 32
  run st_hm $ST --prefill-tp 2 --decode-tp 2 --head-major decode
  run st_mla21 $ST --prefill-tp 2 --decode-tp 1 --mla
  run pp_tp22 python3 scripts/gpu_staged_bench.py --chunk-pages 64 --sizes 16,128 \
    --concurrency 1,8 --requests 16 --verify-requests 2 --skip-mover --skip-per-page \
    --staging-option equal_tp=never --prefill-tp 2 --decode-tp 2
fi
if has hm; then  # head-major pages over cudaipc (page form since 7af4788), beside token-major
  run cu_tp22 $CU --backend cudaipc --prefill-tp 2 --decode-tp 2
  run cu_hm $CU --backend cudaipc --prefill-tp 2 --decode-tp 2 --head-major decode
  run cu_hm21 $CU --backend cudaipc --prefill-tp 2 --decode-tp 1 --head-major decode
  run cu_hm12 $CU --backend cudaipc --prefill-tp 1 --decode-tp 2 --head-major prefill,decode
  run cu_hm11 $CU --backend cudaipc --head-major prefill
fi
if has pages; then  # page-size conversion over cudaipc (granules in page form), beside equal pages
  run cu_tp22 $CU --backend cudaipc --prefill-tp 2 --decode-tp 2
  run cu_pg32 $CU --backend cudaipc --prefill-tp 2 --decode-tp 2 --decode-page-size 32
  run cu_pg8 $CU --backend cudaipc --prefill-tp 2 --decode-tp 2 --decode-page-size 8
  run cu_pg32tp21 $CU --backend cudaipc --prefill-tp 2 --decode-tp 1 --decode-page-size 32
fi
if has shapes_cu; then  # the shapes over cudaipc, and per-page NIXL (the baseline)
  run cu_pg32 $CU --backend cudaipc --prefill-tp 2 --decode-tp 2 --decode-page-size 32
  run cu_hm $CU --backend cudaipc --prefill-tp 2 --decode-tp 2 --head-major decode
  run cu_mla21 $CU --backend cudaipc --prefill-tp 2 --decode-tp 1 --mla
  run pp_tp22 $CU --backend nixl --staging direct --requests 16 --prefill-tp 2 --decode-tp 2
fi
if has shapes_nixl; then  # NIXL with the default staging (auto: bulk at GPU sizes)
  run nx_pg32 $CU --backend nixl --prefill-tp 2 --decode-tp 2 --decode-page-size 32
  run nx_hm $CU --backend nixl --prefill-tp 2 --decode-tp 2 --head-major decode
  run nx_mla21 $CU --backend nixl --prefill-tp 2 --decode-tp 1 --mla
fi
if has views; then  # bulk staging with no kv_tensors (views of the layout's buffers)
  run st_views22 $ST --prefill-tp 2 --decode-tp 2 --no-kv-tensors
  run st_views12 $ST --prefill-tp 1 --decode-tp 2 --no-kv-tensors
fi
sample() {  # name, backend, prefill TP, decode TP: stack samples of 200 requests, 16 MiB C=8
  # (backend "staged": staged NIXL through gpu_staged_bench.py)
  local d="$OUT/sample_$1"; mkdir -p "$d"
  mkdir -p /tmp/sc && cp scripts/rank_sampler.py /tmp/sc/sitecustomize.py
  local bench="scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api --backend $2"
  [ "$2" = staged ] && bench="scripts/gpu_staged_bench.py --chunk-pages 64 --block-mib 8
    --ring-mib 1024 --skip-mover --skip-per-page"
  KVWIRE_SAMPLE_DIR=$d KVWIRE_SAMPLE_US=250 PYTHONPATH=/tmp/sc:$PYTHONPATH \
    run "smp_$1" python3 $bench --sizes 16 --concurrency 8 --requests 200 --verify-requests 1 \
    --prefill-tp "$3" --decode-tp "$4" --sample-dir "$d"
  python3 scripts/rank_sampler.py report "$d" --per 200 --top 14 > "$OUT/smp_$1.txt" 2>&1
  grep -E "== pid|-- thread" "$OUT/smp_$1.txt"
}
if has sample; then
  sample tp11 cudaipc 1 1
  sample tp12 cudaipc 1 2
fi
if has sample_staged; then
  sample st22 staged 2 2
  sample st21 staged 2 1
fi
if has sample_auto; then
  sample cu11 cudaipc 1 1
  sample auto11 auto 1 1
fi
python3 - "$OUT" <<'PY'
import glob, json, os, sys
print(f"{'run':<10} {'part':<8} {'MiB':>4} {'C':>2} {'p50 ms':>7} {'GB/s':>7} {'fail':>4}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*_*.json"))):
    d = json.load(open(path))
    for part in ("engine", "staged", "per_page"):
        v = (d.get(part) or {}).get("verified", [])
        if v:
            print(f"{os.path.basename(path)[:-5]:<10} {part:<8} verified {sum(x['requests'] for x in v)} "
                  f"requests, {sum(x['mismatches'] for x in v)} mismatches")
        for c in (d.get(part) or {}).get("cells", []):
            print(f"{os.path.basename(path)[:-5]:<10} {part:<8} {c['mib']:>4} {c['concurrency']:>2} "
                  f"{c['p50_ms']:>7.2f} {c['gbps']:>7.1f} {c['failed']:>4}")
PY
cd "$OUT" && tar czf tp4.tgz ./*.json ./*.log ./*.txt ./sample_* 2>/dev/null
rm -rf ./*.json ./*.log ./sample_* ./smp_*.txt
ls
