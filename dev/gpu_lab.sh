#!/usr/bin/env bash
# One device-machine call for the GPU lab (issue 10): `bash dev/gpu_lab.sh tests bench` (any subset, in order).
# tests: every GPU test, each training test in its own process (a CUDA error cannot cascade into the next test).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.tcache PYTHONPATH=$PWD
mkdir -p .tcache "${OUT:=/tmp/out}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for what in "$@"; do
  case $what in
    optests) timeout 240 python3 -m pytest tests/ops -m gpu -n 8 -q 2>&1 | tee $OUT/gpu_op_tests.log | tail -15 ;;
    mptests) timeout 200 python3 -m pytest tests/models/test_mixed_precision.py -m gpu -n 4 -q 2>&1 | tee $OUT/gpu_mp_tests.log | tail -15 ;;
    traintests)
      for t in $(python3 -m pytest tests/test_train_fast.py -m gpu --collect-only -q 2>/dev/null | grep '::'); do
        timeout 120 python3 -m pytest "$t" -q -p no:cacheprovider 2>&1 | tail -3 | tee -a $OUT/gpu_train_tests.log
      done ;;
    bench)
      python3 -m evict.cli bench train --arch kda attention --procs 4 --train-steps 150 --variants before bf16 labels graphs --out $OUT/bench_train_p4.json 2>&1 | grep -v Warn | tee $OUT/bench_train.log
      python3 -m evict.cli bench train --arch kda attention --procs 8 --train-steps 150 --variants graphs --out $OUT/bench_train_p8.json 2>&1 | grep -v Warn | tee -a $OUT/bench_train.log ;;
  esac
done
