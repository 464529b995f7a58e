#!/bin/bash
# The GPU call of helper "ipcpages" (session 12), as run: copy this branch's core/src, plugins/{nixl,cudaipc}/src
# and scripts to .gpu/ipcpages/new, main f6a7a80's to .gpu/ipcpages/old (git archive), this file to
# .gpu/ipcpages/run.sh, and run `bash .gpu/ipcpages/run.sh` with carry [.gpu/whl, .gpu/whl-nixl, .gpu/ipcpages].
# helper ipcpages (session 12): cudaipc page writes (branch ipcpages) vs old main f6a7a80, alternating,
# engine path TP 1->1, 2->1, 1->2 at 16 and 128 MiB, C=1 and 8; every verified element checked.
export UCX_MODULES=^efa NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl .gpu/whl-nixl/*.whl > $OUT/pip.log 2>&1 || { cat $OUT/pip.log; exit 1; }
N=$PWD/.gpu/ipcpages/new
NEW=$N/core/src:$N/plugins/nixl/src:$N/plugins/cudaipc/src:/tmp/site
O=$PWD/.gpu/ipcpages/old
OLD=$O/core/src:$O/plugins/nixl/src:$O/plugins/cudaipc/src:/tmp/site
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/topo.txt 2>&1; head -4 $OUT/topo.txt
ARGS="--skip-backend-api --sizes 16,128 --requests 16 --verify-requests 4"
run() { name=$1; tree=$2; t=$3; shift 3
  if [ $tree = new ]; then P=$NEW; S=$N/scripts/gpu_cudaipc_bench.py; else P=$OLD; S=$O/scripts/gpu_cudaipc_bench.py; fi
  PYTHONPATH=$P timeout $t python3 $S $ARGS "$@" --json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$? $(date +%T)"; grep "^| \|^verified\|mismatch\|rror" $OUT/$name.log | grep -v "^|--" | cut -c1-150 | tail -8; }
PYTHONPATH=$NEW timeout 120 python3 $N/scripts/gpu_pool_page_check.py --json $OUT/pool_pages.json > $OUT/pool_pages.log 2>&1; echo "pool_pages rc=$?"; tail -12 $OUT/pool_pages.log
run new_1_1_a new 90 --repeat 10
run old_1_1_a old 60 --skip-mover
run new_1_1_b new 60 --skip-mover
run old_1_1_b old 60 --skip-mover
run new_2_1 new 60 --skip-mover --prefill-tp 2 --decode-tp 1
run old_2_1 old 60 --skip-mover --prefill-tp 2 --decode-tp 1
run new_1_2 new 60 --skip-mover --prefill-tp 1 --decode-tp 2
run old_1_2 old 60 --skip-mover --prefill-tp 1 --decode-tp 2
cd $OUT && tar -czf /tmp/all.tgz . && rm -f $OUT/* && mv /tmp/all.tgz $OUT/all.tgz
