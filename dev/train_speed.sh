#!/usr/bin/env bash
# One device call for issue 74's model-level training table: `evict.bench.model` one process per row group, each
# writing its JSON as every row finishes (a cut keeps what finished), all inside one wall budget (BUDGET seconds,
# default 300: pass the run tool a timeout_s a little above it). Row groups, in order (ROWS to choose / reorder):
#   hyb    evict's KDA LM 226M and its 3:1 hybrids KKKA, KKKM at B4 T4096, eager (the hybrids' ratio to KDA-only)
#   kdac   evict's KDA LM 226M compiled per block
#   kdacl  the same, compiled lean (`compile_blocks(lean=True)`: the blocks recompute elementwise values in the backward)
#   gpt2c  GPT-2 124M B16 T1024 compiled: evict (per block) beside transformers (whole model)
#   gpt2   GPT-2 124M eager, both
#   fla    fla 0.6.0's KDAForCausalLM (eager, its own kernels; its autotuned kernels compile their configs in parallel
#          first, evict/bench/autotune.py), with a profile of one step; last: it takes whatever time is left
#   tests  the loss / norm GPU tests;  ops  dev/train_ops_bench.py (the loss and norm pieces beside their old forms)
#   mem    the block's memory: GPU tests of the recomputed pieces, the compiled KDA block, the KDA presets' bf16
#          training steps; then dev/train_memory.py (every tensor one KDA block keeps for its backward at B4 T4096 on
#          CUDA, $OUT/train_memory.json)
#   cmem   the lean compiled block's tests: GPU (lean vs eager, bytes kept on CUDA), its CPU trace's saved-bytes bound
#          under this torch, the compiled blocks' and the recomputed pieces' GPU tests (q, k, v now split)
# Each group's timeout is min(its cap, what is left of BUDGET less the later groups' floors). Then every JSON is
# merged into one table (train_all.json, ratios across groups); the logs and the Triton autotune results (fla's
# kernels' choices) come back in one tar, train_speed_logs.tar (the call returns at most 8 files); FLA_AUTOTUNE=path
# of its autotune.tar, carried, restores them so fla skips its tuning on the same card type. Carry .whl (fla's wheels:
# `bash dev/wheels.sh`); from a .dev_<branch> copy, main's ../.whl is used. Output in $OUT (or runs/bench).
# SMOKE=1: the same groups on the CPU with the tiny presets of the same families at T 32 (fla's row stops at its
# first Triton kernel there), to catch a broken path before spending device time.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-runs/bench}
BUDGET=${BUDGET:-300}
ROWS=${ROWS:-hyb kdac gpt2c fla}
mkdir -p "$OUT"
LOGS=$(mktemp -d)  # each group's full log, versions.txt, autotune.tar: packed into $OUT/train_speed_logs.tar at the end
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/evict_train_speed_triton}
if [ -n "${FLA_AUTOTUNE:-}" ]; then  # a tar of Triton autotune results from an earlier call on the same card type
  mkdir -p "$TRITON_CACHE_DIR" && tar -C "$TRITON_CACHE_DIR" -xf "$FLA_AUTOTUNE" && echo "autotune results restored: $FLA_AUTOTUNE"
  PARALLEL=False  # the tuned kernels compile their chosen config only; compiling every config first would waste it
fi
wheels=$(ls .whl/fla/*.whl ../.whl/fla/*.whl 2>/dev/null)  # the tree's own, or main's beside a .dev_<branch> copy
python3 -c "import fla" 2>/dev/null || { [ -n "$wheels" ] && python3 -m pip install -q --no-index --no-deps $wheels 2>&1 | tail -2; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1; date -u; } | tee "$LOGS/versions.txt"

# floor: seconds a group keeps for itself when the groups before it take their turn; cap: its own limit
floor() { case $1 in hyb) echo 40 ;; kdac|kdacl) echo 45 ;; gpt2c) echo 70 ;; gpt2) echo 40 ;; fla) echo 60 ;; *) echo 20 ;; esac; }
cap() { [ -n "${SMOKE:-}" ] && { echo 100000; return; }; case $1 in hyb) echo 80 ;; kdac|kdacl) echo 90 ;; cmem) echo 80 ;; gpt2c) echo 120 ;; gpt2) echo 80 ;; tests) echo 60 ;; ops) echo 40 ;; mem) echo 60 ;; *) echo 100000 ;; esac; }
K="'kda_226m'"; HYB=${HYB:-"'kda_226m', 'kkka_226m', 'kkkm_226m'"}  # HYB="'kda_226m'": the KDA-only row alone
KDA="batch=4, seq_len=4096, warmup=2, steps=5"
GPT2="models=('gpt2_124m',), batch=16, seq_len=1024, warmup=3, steps=10"
if [ -n "${SMOKE:-}" ]; then  # every group's code path on the CPU: the tiny presets of the same families at T 32
  K="'kda'"; HYB="'kda', 'kimi_linear'"
  KDA="batch=1, seq_len=32, warmup=1, steps=1, device='cpu'"
  GPT2="models=('gpt2',), batch=1, seq_len=32, warmup=1, steps=1, device='cpu'"
fi
bench() { python3 -c "from evict.bench.model import bench_model; bench_model($1, out='$OUT/$2.json')"; }
run_group() {
  case $1 in
    hyb) bench "models=($HYB,), $KDA, impls=('evict',)" hyb ;;
    kdac) bench "models=($K,), $KDA, impls=('evict',), modes=('compiled',)" kdac ;;
    kdacl) bench "models=($K,), $KDA, impls=('evict',), modes=('compiled-lean',)" kdacl ;;
    gpt2c) bench "$GPT2, modes=('compiled',)" gpt2c ;;
    gpt2) bench "$GPT2, modes=('eager',)" gpt2 ;;
    fla) bench "models=($K,), $KDA, impls=('reference',), profile=30, parallel_compile=${PARALLEL:-True}" fla ;;
    tests) python3 -m pytest -o addopts="" -v -rf -m gpu -p no:cacheprovider tests/ops/test_loss.py tests/layers/test_norms.py ;;
    ops) python3 dev/train_ops_bench.py --out "$OUT/train_ops.json" ;;
    mem) python3 -m pytest -o addopts="" -v -rf -m gpu -p no:cacheprovider tests/layers/test_recompute.py \
           "tests/ops/test_compile_blocks.py::test_gpu_blocks_compile_whole[K]" \
           tests/models/test_mixed_precision.py -k "recomputed or compile_whole or kda-cuda or kimi_linear-cuda"
         python3 dev/train_memory.py $([ -n "${SMOKE:-}" ] && echo "--device cpu --run-len 32") --json "$OUT/train_memory.json" ;;
    cmem) python3 -m pytest -vv -rf -p no:cacheprovider -p no:warnings tests/ops/test_compile_lean.py::test_lean_compiled_kda_block_saved_bytes_bound \
            "tests/ops/test_compile_lean.py::test_gpu_lean_block_matches_eager_and_keeps_less[K]" \
            "tests/ops/test_compile_blocks.py::test_gpu_blocks_compile_whole[K]" \
            tests/layers/test_recompute.py::test_recomputed_block_under_autocast_matches_plain ;;
    *) echo "ROWS: unknown group $1 (expected hyb kdac kdacl gpt2c gpt2 fla tests ops mem cmem)"; return 2 ;;
  esac
}
export -f bench run_group; export OUT K HYB KDA GPT2 PARALLEL
set -- $ROWS
while [ $# -gt 0 ]; do
  g=$1; shift
  later=0; for h in "$@"; do later=$((later + $(floor $h))); done
  left=$((BUDGET - SECONDS - 8 - later))  # 8 s for the merge at the end
  c=$(cap $g); s=$(( left < c ? left : c ))
  if [ $s -lt 10 ]; then echo "== $g: skipped, ${left} s left of BUDGET $BUDGET"; continue; fi
  echo "== $g (limit ${s} s, at ${SECONDS} s)"
  timeout -k 5 $s bash -c "run_group $g" > "$LOGS/$g.log" 2>&1  # timeout signals its whole process group
  rc=$?
  grep -v "Warning\|warn(" "$LOGS/$g.log" | grep -v "^autotune " | tail -${TAIL:-8}
  n=$(grep -c "^autotune " "$LOGS/$g.log"); [ "$n" -gt 0 ] && echo "($n autotuned kernels compiled in parallel: $g.log)"
  echo "== $g: exit $rc after ${SECONDS} s$([ $rc = 124 ] && echo ' (cut by its limit)')"
done
files=$(for g in hyb kdac kdacl gpt2c gpt2 fla; do [ -s "$OUT/$g.json" ] && printf "'%s', " "$OUT/$g.json"; done)
[ -n "$files" ] && python3 -c "from evict.bench.model import merge; merge([$files], out='$OUT/train_all.json')"
# the device call brings back at most 8 files: the logs, the versions and the autotune results travel as one tar
( cd "$TRITON_CACHE_DIR" 2>/dev/null && find . -name '*.autotune.json' | tar -cf "$LOGS/autotune.tar" -T - ) 2>/dev/null
echo "autotune results kept: $(tar -tf "$LOGS/autotune.tar" 2>/dev/null | grep -c 'json$') (train_speed_logs.tar: autotune.tar)"
tar -C "$LOGS" -cf "$OUT/train_speed_logs.tar" .
echo "== done at ${SECONDS} s"
