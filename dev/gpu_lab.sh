#!/usr/bin/env bash
# One device-machine call for the GPU lab (issue 10): `bash dev/gpu_lab.sh tests bench` (any subset, in order).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.tcache PYTHONPATH=$PWD
mkdir -p .tcache "${OUT:=/tmp/out}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for what in "$@"; do
  case $what in
    alltests) timeout ${T:-420} python3 -m pytest tests -m gpu -n 8 -q -rf --durations=15 2>&1 | tee $OUT/gpu_all_tests.log | tail -40 ;;
    optests) timeout 240 python3 -m pytest tests/ops -m gpu -n 8 -q -rf 2>&1 | tee $OUT/gpu_op_tests.log | tail -15 ;;
    mptests) timeout 200 python3 -m pytest tests/models/test_mixed_precision.py -m gpu -n 4 -q -rf 2>&1 | tee $OUT/gpu_mp_tests.log | tail -15 ;;
    traintests) timeout 200 python3 -m pytest tests/test_train_fast.py -m gpu -n 4 -q -rf 2>&1 | tee $OUT/gpu_train_tests.log | tail -15 ;;
    decodetests) timeout 300 python3 -m pytest tests/ops/test_decode.py tests/layers tests/models tests/ops/test_memory_triton.py::test_gpu_hard_resets_forward_and_gradients "tests/test_train_fast.py::test_mqar_learns_on_cuda" -m gpu -n 8 -q -rf 2>&1 | tee $OUT/gpu_decode_tests.log | tail -25 ;;
    decodebench) timeout ${T:-240} python3 -m evict.cli bench decode --device cuda --paths before graph --contexts 8192 32768 131072 --steps 10 --out $OUT/decode_paths.json 2>&1 | grep -v Warn | tee $OUT/decode_paths.log | tail -40 ;;
    decodecompile) timeout ${T:-200} python3 -m evict.cli bench decode --device cuda --paths graph compiled --models kda hybrid --batch1-only --contexts 8192 131072 --steps 10 --out $OUT/decode_compiled.json 2>&1 | grep -v Warn | tee $OUT/decode_compiled.log | tail -14 ;;
    decode1m) timeout 150 python3 -m evict.cli bench decode --device cuda --paths before graph --models attention mla hybrid --batch1-only --contexts 1048576 --steps 5 --out $OUT/decode_1m.json 2>&1 | grep -v Warn | tee $OUT/decode_1m.log | tail -10 ;;
    decodeprofile) timeout 120 python3 dev/profile_decode.py 2>&1 | tee $OUT/decode_profile.log | grep -v "^-" | head -80 ;;
    sdpa) timeout 60 python3 dev/sdpa_check.py 2>&1 | grep -v "^$" | tail -12 ;;
    bench)
      timeout 150 python3 -m evict.cli bench train --arch kda --procs 4 --train-steps 100 --variants before graphs --out $OUT/bench_train_p4.json 2>&1 | grep -v Warn | tee $OUT/bench_train.log
      timeout 100 python3 -m evict.cli bench train --arch kda --procs 8 --train-steps 100 --variants graphs --out $OUT/bench_train_p8.json 2>&1 | grep -v Warn | tee -a $OUT/bench_train.log ;;
  esac
done
