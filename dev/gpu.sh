#!/usr/bin/env bash
# One device-machine call: `bash dev/gpu.sh tests tune bench` (any subset, in that order).
# Installs the fla wheels from .whl when present (carry .whl).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.tcache PYTHONPATH=$PWD
mkdir -p .tcache "${OUT:=/tmp/out}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for what in "$@"; do
  case $what in
    tests) timeout 210 python3 -m pytest tests/ops/test_memory_triton.py -m gpu -n 8 -q 2>&1 | tee $OUT/gpu_tests.log | tail -25 ;;
    tune) python3 dev/triton_tune.py 2>&1 | tee $OUT/tune.log ;;
    precision) python3 dev/check_precision.py 2>&1 | tee $OUT/precision.log ;;
    bench) python3 -m evict.cli bench ops --device cuda --out $OUT/bench_ops_cuda.json 2>&1 | tee $OUT/bench.log ;;
    quickbench) timeout 240 python3 -m evict.cli bench ops --device cuda --no-fla-backward --out $OUT/bench_ops_cuda.json 2>&1 | tee $OUT/bench.log ;;
  esac
done
