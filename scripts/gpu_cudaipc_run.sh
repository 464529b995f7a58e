#!/bin/bash
# The same-host GPU run of docs/benchmarks.md ("Same host over CUDA IPC"), on a machine with two
# NVLink-joined GPUs and no internet. Lay out a folder beside this script's copy as:
#   whl/       kvwire, kvwire-cudaipc, kvwire-nixl wheels (uv build --package NAME --wheel) and
#              pydantic, pydantic-core, pydantic-settings, python-dotenv, pyzmq, annotated-types,
#              typing-inspection (pip download ... --platform manylinux_2_28_x86_64, cp312)
#   whl-nixl/  nixl-cu13 1.5.1 (its nixl_ep_cu13 folder may be dropped: the bench does not use it)
#   src/scripts/gpu_cudaipc_bench.py, src/plugins/cudaipc/tests, src/pyproject.toml
#   (the bench's phases live in kvwire.bench.gpu_mover and kvwire.bench.gpu_engine: the kvwire
#   wheel must come from this tree, or put core/src first on PYTHONPATH)
# then run `bash run.sh` there with $OUT set; STAGES picks stages (mover nixl engine pytest diag).
cd "$(dirname "$0")"
export UCX_MODULES=^efa NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl whl-nixl/*.whl > $OUT/pip.log 2>&1 || { cat $OUT/pip.log; exit 1; }
export PYTHONPATH=/tmp/site
printf 'import os, sys\nif os.environ.get("KVWIRE_SWITCH_INTERVAL"):\n    sys.setswitchinterval(float(os.environ["KVWIRE_SWITCH_INTERVAL"]))\n' > /tmp/site/sitecustomize.py
{ nvidia-smi topo -m; nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), torch.cuda.can_device_access_peer(0,1))"; python3 -c "import cuda.bindings, sys; print('cuda-bindings', getattr(cuda.bindings, '__version__', '?'))"; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
STAGES=${STAGES:-mover nixl engine pytest}
for s in $STAGES; do
  echo "=== stage $s $(date +%T)"
  case $s in
    mover) timeout 240 python3 src/scripts/gpu_cudaipc_bench.py --skip-engine --json $OUT/mover.json > $OUT/mover.log 2>&1; echo rc=$?; tail -8 $OUT/mover.log ;;
    engine) timeout ${ENGINE_S:-270} python3 src/scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api --mover-json $OUT/mover.json --nixl-json $OUT/nixl.json --json $OUT/cudaipc_bench.json ${ENGINE_ARGS:---requests 32 --verify-requests 6} > $OUT/engine.log 2>&1; echo rc=$?; tail -25 $OUT/engine.log ;;
    nixl) timeout 100 python3 -m kvwire_nixl.gpu_bench --cases 64x32KiB,512x32KiB,4096x32KiB,16384x32KiB --chunks "" --repeat 10 --json $OUT/nixl.json > $OUT/nixl.log 2>&1; echo rc=$?; tail -12 $OUT/nixl.log ;;
    diag) B="timeout 100 python3 src/scripts/gpu_cudaipc_bench.py --skip-mover --concurrency 1 --requests 16 --verify-requests 2"
      $B --sizes 2,16,128 --json $OUT/diag_a.json > $OUT/diag_a.log 2>&1; echo a rc=$?; grep ^engine $OUT/diag_a.log
      KVWIRE_SWITCH_INTERVAL=0.0002 $B --sizes 2,16,128 --json $OUT/diag_b.json > $OUT/diag_b.log 2>&1; echo b rc=$?; grep ^engine $OUT/diag_b.log
      $B --sizes 2,16 --backend nixl --json $OUT/diag_c.json > $OUT/diag_c.log 2>&1; echo c rc=$?; grep ^engine $OUT/diag_c.log ;;
    tp) for t in "1 1" "2 1" "1 2"; do set -- $t
        timeout 150 python3 src/scripts/gpu_cudaipc_bench.py --skip-mover --skip-backend-api --sizes 16,128 --requests 24 --verify-requests 4 --prefill-tp $1 --decode-tp $2 --json $OUT/tp_$1_$2.json > $OUT/tp_$1_$2.log 2>&1; echo tp $1-$2 rc=$?; grep "^engine\|^verified" $OUT/tp_$1_$2.log | cut -c1-260; done ;;
    pytest) (cd src && timeout 90 python3 -m pytest plugins/cudaipc/tests -x -q -p no:cacheprovider) > $OUT/pytest.log 2>&1; echo rc=$?; tail -3 $OUT/pytest.log ;;
  esac
done
echo "=== end $(date +%T)"
