#!/usr/bin/env bash
# One device call for issue 74's model-level training numbers (session 58's owed rows): the GPU tests of the loss and
# norm changes, the changed pieces beside the old forms (dev/train_ops_bench.py: the Triton loss, its vocabulary
# padding at GPT-2's V 50257, the fused RMSNorm), then `evict.bench.model` one process per row so a cut call keeps the
# rows before it: GPT-2 124M eager + compiled beside transformers, the KDA LM 226M eager + compiled, its hybrids, and
# last fla's KDAForCausalLM (its autotuning takes minutes on a fresh machine: give the call >= 8 min, T_FLA).
# Carry the folder holding .whl/fla (`bash dev/wheels.sh` or its fla line). JSON lands in $OUT (or runs/bench).
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"
wheels=$(ls .whl/fla/*.whl ../.whl/fla/*.whl 2>/dev/null)  # the tree's own, or main's beside a .dev_<branch> copy
python3 -c "import fla" 2>/dev/null || { [ -n "$wheels" ] && python3 -m pip install -q --no-index --no-deps $wheels 2>&1 | tail -2; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
t() { local s=$1; shift; timeout "$s" "$@" 2>&1 | grep -v "Warning\|warn(" | tail -${TAIL:-6}; }
t ${T_TESTS:-60} python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/ops/test_loss.py tests/layers/test_norms.py
t ${T_OPS:-30} python3 dev/train_ops_bench.py --out "$OUT/train_ops.json"
bench() { local s=$1 out=$2; shift 2
  TAIL=4 t "$s" python3 -c "from evict.bench.model import bench_model; bench_model($*, out='$OUT/$out')"; }
KDA="batch=4, seq_len=4096, warmup=2, steps=5"
bench ${T_GPT2:-100} gpt2_eager.json "models=('gpt2_124m',), batch=16, seq_len=1024, modes=('eager',)"
bench ${T_GPT2C:-150} gpt2_compiled.json "models=('gpt2_124m',), batch=16, seq_len=1024, modes=('compiled',)"
bench ${T_KDA:-40} kda_eager.json "models=('kda_226m',), $KDA, references=False, profile=30"
bench ${T_KDAC:-120} kda_compiled.json "models=('kda_226m',), $KDA, references=False, modes=('compiled',)"
bench ${T_HYB:-90} hybrids.json "models=('kda_226m', 'kkka_226m', 'kkkm_226m'), $KDA, references=False"
bench ${T_FLA:-480} kda_fla.json "models=('kda_226m',), $KDA, profile=30"
