#!/usr/bin/env bash
# One device call for session 4's GPU checks: wheels the GPU box lacks (no package index; carried in ./.whl),
# every `gpu` test but the memory op's (run earlier the same session), the chunk dial's GPU numbers, the decode bench.
#   bash dev/gpu_session4.sh tests dial decode        (any subset, in order)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.tcache PYTHONPATH=$PWD
mkdir -p .tcache "${OUT:=/tmp/out}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import fastapi, uvicorn, httpx" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl/serve fastapi uvicorn httpx
python3 -c "import fla" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/fla/*.whl
python3 -c "import torch, triton, fastapi; print('torch', torch.__version__, 'triton', triton.__version__, 'fastapi', fastapi.__version__)"
for what in "$@"; do
  case $what in
    tests) timeout ${T:-260} python3 -m pytest tests -m gpu -n 8 -q -rf --ignore=tests/ops/test_memory_triton.py -p no:cacheprovider 2>&1 \
             | tee $OUT/gpu_tests.log | grep -v "Warning\|warn\|^  \|^$" | tail -30 ;;
    dial) timeout 90 python3 dev/chunk_dial_gpu.py --out $OUT/chunk_dial_gpu.json 2>&1 | tail -5 ;;
    decode) timeout ${TD:-240} python3 -m evict.cli bench decode --device cuda --paths before graph compiled --batch1-only \
              --contexts 8192 131072 --steps 8 --out $OUT/decode_final.json 2>&1 | grep "^|\|copy" | tee $OUT/decode_final.log ;;
    decode1m) timeout 150 python3 -m evict.cli bench decode --device cuda --paths before graph compiled --batch1-only \
              --models attention mla hybrid --contexts 1048576 --steps 5 --out $OUT/decode_final_1m.json 2>&1 | grep "^|\|copy" | tee $OUT/decode_final_1m.log ;;
  esac
done
