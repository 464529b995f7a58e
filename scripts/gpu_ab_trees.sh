# A/B of two trees on the GPU host: the tree of this checkout ("new") against ab_base/ ("base":
# `git archive BASE core/src plugins/cudaipc/src plugins/nixl/src plugins/hisparse/src | tar -x
# -C ab_base`, ignored, carried), `gpu_cudaipc_bench.py`'s engine phase over cudaipc, the two
# alternated three times. SIZES, REQ, ABFLAGS (e.g. "--gil-switch never": no GIL watch, whose
# state is otherwise a variable of every run). Device call: carry [".whl", "ab_base"].
export OUT=$OUT; source scripts/gpu_env.sh
NEWPP=$PYTHONPATH; BASEPP=$PWD/ab_base/core/src:$PWD/ab_base/plugins/cudaipc/src:$PWD/ab_base/plugins/nixl/src:$PWD/ab_base/plugins/hisparse/src:/tmp/site
for r in 1 2 3; do for t in base new; do
  pp=$NEWPP; [ $t = base ] && pp=$BASEPP
  PYTHONPATH=$pp timeout 150 python3 scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api --backend cudaipc --sizes ${SIZES:-2,16,128} --concurrency 1,8 --requests ${REQ:-400} --verify-requests 2 ${ABFLAGS:-} --json $OUT/ab_${t}_$r.json > /tmp/log_$t$r 2>&1 || tail -5 /tmp/log_$t$r
done; done
python3 - <<'PY'
import json,glob,os,collections
out=os.environ["OUT"]; rows=collections.defaultdict(list)
for f in sorted(glob.glob(out+"/ab_*.json")):
    t=f.split("ab_")[1].split("_")[0]; d=json.load(open(f))
    for c in d["engine"]["cells"]:
        cs=c["cpu_share"]; p=[v for k,v in cs.items() if "prefill" in k][0]; dd=[v for k,v in cs.items() if "decode" in k][0]
        st=c["stages_ms"]
        rows[(c["mib"],c["concurrency"],t)].append((round(c["gbps"],1),round(c["p50_ms"],2),round(p,2),round(dd,2),c["failed"],c["gil"]["interval_us"][0],st.get("take"),st.get("land"),st.get("land_turn")))
print("(MiB, C, tree): [(GB/s, p50 ms, prefill cores, decode cores, failed, prefill GIL interval us, take, land, land_turn ms) per round]")
for k in sorted(rows): print(k, rows[k])
PY
