#!/usr/bin/env bash
# One device call for session 5's GPU work: wheels the GPU box lacks (no package index; carried in ./.whl), then
#   verify   the distributed / fast-training GPU tests (compile of the step, CUDA-graph statics)
#   optests  the memory op's GPU tests (Triton kernels vs the float64 reference)
#   ops      `evict bench ops` against fla and SDPA flash, with the per-kernel stage table
#   tune     dev/triton_tune.py (per-kernel time of the knob variants); tunefwd / tunebwd: session 5's variant sets
#   split    the three-kernel first stage (intra(split=True)) against the one kernel, fwd and fwd+bwd
#   dist     dev/dist_bench.sh on two GPUs (kind nvidia-h200-x2);  varlen  the memory op's GPU tests again
#   precision  dev/check_precision.py;  opsfwd  the ops bench without fla's (slowly autotuned) backward
#   bash dev/gpu_session5.sh verify ops        (any subset, in order; T / TO override the timeouts)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.tcache PYTHONPATH=$PWD
mkdir -p .tcache "${OUT:=/tmp/out}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import fastapi, uvicorn, httpx" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl/serve fastapi uvicorn httpx
python3 -c "import fla" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/fla/*.whl
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for what in "$@"; do
  case $what in
    verify) timeout ${T:-300} python3 -m pytest tests/test_distributed_gpu.py tests/test_train_fast.py -m gpu -n 4 -q -rf -p no:cacheprovider 2>&1 \
              | tee $OUT/verify.log | grep -v "Warning\|warn\|^  \|^$" | tail -25 ;;
    optests) timeout ${T:-240} python3 -m pytest tests/ops/test_memory_triton.py -m gpu -n 8 -q -rf -p no:cacheprovider 2>&1 \
              | tee $OUT/optests.log | grep -v "Warning\|warn\|^  \|^$" | tail -25 ;;
    ops) timeout ${TO:-300} python3 -m evict.cli bench ops --device cuda --shapes ${SHAPES:-4x8192 1x32768} --out $OUT/bench_ops.json 2>&1 \
              | grep -v "^{'op'" | tee $OUT/bench_ops.log ;;
    tune) timeout ${TO:-200} python3 dev/triton_tune.py ${TUNE:-} 2>&1 | tee $OUT/tune.log ;;
    tunefwd) timeout 150 python3 dev/triton_tune.py --fwd-only --shapes 4x8192,1x32768 --variants v0,f32,iw8,bv64,sw8,sw8bv64,ow8 2>&1 \
              | grep -v "Warn\|warn" | tee $OUT/tunefwd.log ;;
    split) timeout 200 python3 dev/triton_tune.py --fwd-only --shapes 4x8192,1x32768 --variants v0,split,split8 2>&1 \
              | grep -v "Warn\|warn" | tee $OUT/split_fwd.log
           timeout 150 python3 dev/triton_tune.py --variants v0,split,split8 2>&1 | grep -v "Warn\|warn" | tee $OUT/split.log ;;
    tunebwd) timeout 120 python3 dev/triton_tune.py --variants v0,t32,pk3,pr3 2>&1 | grep -v "Warn\|warn" | tee $OUT/tunebwd.log ;;
    precision) timeout 90 python3 dev/check_precision.py 2>&1 | tee $OUT/precision.log ;;
    dist) (OUT=/tmp/dist STEPS=${STEPS:-30} PY=python3 timeout ${TD:-330} bash dev/dist_bench.sh 2>&1 | grep -v "Warn\|warn" | tail -40) \
              | tee $OUT/dist.log
          mkdir -p $OUT/dist && cp /tmp/dist/dist_bench.json $OUT/dist/ 2>/dev/null
          for r in /tmp/dist/gpu*; do mkdir -p $OUT/dist/${r##*/}; cp $r/run.json $r/metrics.jsonl $OUT/dist/${r##*/}/ 2>/dev/null; done ;;
    varlen) timeout ${T:-200} python3 -m pytest tests/ops/test_memory_triton.py -m gpu -n 8 -q -rf -p no:cacheprovider 2>&1 \
              | tee $OUT/optests.log | grep -v "Warning\|warn\|^  \|^$" | tail -15 ;;
    opsfwd) timeout ${TO:-200} python3 -m evict.cli bench ops --device cuda --no-fla-backward --shapes ${SHAPES:-4x8192 1x32768} \
              --out $OUT/bench_ops.json 2>&1 | tee $OUT/bench_ops.log ;;
  esac
done
