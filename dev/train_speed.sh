#!/usr/bin/env bash
# One device call for issue 74's model-level training numbers (prepared 2026-12-06 on branch train-speed; not yet run):
# the GPU tests of what changed, then `evict.bench.model` at the issue's shapes. Carry the folder holding .whl/fla
# (`bash dev/wheels.sh` or its fla line) so fla's KDAForCausalLM can be the oracle. JSON lands in $OUT (or runs/bench).
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"
python3 -c "import fla" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/fla/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
t() { local s=$1; shift; timeout "$s" "$@" 2>&1 | grep -v "Warning\|warn(" | tail -${TAIL:-6}; }
t ${T_TESTS:-85} python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_compile_blocks.py tests/ops/test_loss.py tests/ops/test_conv.py
t ${T_OPTESTS:-45} python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/ops/test_memory_triton.py -k "gradients_match_reference or kept_factors_off or packed"
t ${T_SDPA:-30} python3 dev/sdpa_vs_kda.py
bench() { local s=$1 out=$2; shift 2
  TAIL=14 t "$s" python3 -c "from evict.bench.model import bench_model; bench_model($*, out='$OUT/$out')"; }
bench ${T_KDA:-110} bench_train_kda_226m.json "models=('kda_226m', 'kkka_226m', 'kkkm_226m'), batch=4, seq_len=4096"
bench ${T_GPT2:-100} bench_train_gpt2_124m.json "models=('gpt2_124m',), batch=16, seq_len=1024, modes=('eager', 'compiled')"
