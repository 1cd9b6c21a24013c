#!/usr/bin/env bash
# 1 GPU, then 2 GPUs (torchrun; FSDP2, then DDP): a ~310M-parameter kimi_linear-family model (18 layers KKKM, d 1024,
# MoE 16 experts top-2; ~120M active) trained on the repository's own text (byte tokenizer, no download) for STEPS
# steps at the same global batch. Reports tokens/s, model FLOPs utilisation (H200 bf16 peak 989 TFLOP/s) and the loss
# curves; writes $OUT/dist_bench.json. About 5 minutes on two H200s.
#     OUT=/tmp/out STEPS=40 bash dev/dist_bench.sh          (EXTRA="--compile" adds per-block torch.compile;
#     EXTRA='--set moe={"dispatch":"sort"}' runs the routed experts as before session 6; RUNS="gpu1 gpu1_accum2 ..."
#     picks runs: gpu1_accum2 is one GPU in two micro-batches of 16, the per-GPU batch of the two-GPU runs)
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/dist_bench}
STEPS=${STEPS:-40}
PY=${PY:-python}
mkdir -p "$OUT"
find evict docs dev tests -name '*.py' -o -name '*.md' | sort | xargs cat > "$OUT/corpus.txt"
MODEL=(--preset kimi_linear --size small --set d_model=1024 --set n_layers=18 --set n_heads=8 --set head_dim=128
       --set d_ff=2816)
COMMON=("${MODEL[@]}" --corpus "$OUT/corpus.txt" --tokenizer byte --seq-len 2048 --batch-size 32 --steps "$STEPS"
        --warmup 10 --lr 1e-3 --eval-every 100000 --eval-batches 1 --ckpt-every 100000 --log-every 5 --amp bf16
        --no-resume ${EXTRA:-})
export XDG_CACHE_HOME="$OUT/cache" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RUNS=(${RUNS:-gpu1 gpu2_fsdp gpu2_ddp})
for run in "${RUNS[@]}"; do
  case $run in
    gpu1) CUDA_VISIBLE_DEVICES=0 $PY -m evict.cli train "${COMMON[@]}" --out "$OUT/$run" ;;
    gpu1_accum2) CUDA_VISIBLE_DEVICES=0 $PY -m evict.cli train "${COMMON[@]}" --grad-accum 2 --out "$OUT/$run" ;;
    gpu2_fsdp) $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m evict.cli train "${COMMON[@]}" --dist fsdp --out "$OUT/$run" ;;
    gpu2_ddp) $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m evict.cli train "${COMMON[@]}" --dist ddp --out "$OUT/$run" ;;
    *) echo "dist_bench.sh: unknown run $run (gpu1 gpu1_accum2 gpu2_fsdp gpu2_ddp)"; exit 2 ;;
  esac
done
$PY dev/dist_bench.py "$OUT" "${RUNS[@]}"
