#!/usr/bin/env bash
# Serving on one CUDA GPU (about 5 minutes on an H200): the GPU engine tests, then `evict bench serve` on the 3:1 hybrid
# (KKKM, last layer MLA: Kimi Linear's pattern, dense FFN) and the all-attention model of the same width and depth,
# 32K-token prompts, 64 concurrent clients, 64 new tokens each, bf16. Results: runs/bench/serve_{hybrid,attention}_cuda.json.
#
# fastapi, uvicorn and httpx are pure-Python wheels that this machine may lack (no package index). Carry them:
#   on a machine with an index:  pip download fastapi uvicorn httpx -d wheels/serve
#   copy wheels/ into this repository's root; this script installs them with --no-index when the imports fail.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
if ! $PY -c "import fastapi, uvicorn, httpx" 2>/dev/null; then
    if [ -d wheels/serve ]; then
        echo "serve_gpu.sh: fastapi / uvicorn / httpx missing: installing them from ./wheels/serve (no index)"
        $PY -m pip install --no-index --find-links wheels/serve fastapi uvicorn httpx
    else
        echo "serve_gpu.sh: fastapi, uvicorn and httpx are not installed and ./wheels/serve does not exist." >&2
        echo "  On a machine with a package index run: pip download fastapi uvicorn httpx -d wheels/serve" >&2
        echo "  then copy wheels/ into $(pwd) and run this script again." >&2
        exit 1
    fi
fi
$PY -c "import torch; assert torch.cuda.is_available(), 'serve_gpu.sh needs a CUDA GPU'"
$PY -m pytest -q -rf -m gpu tests/serve
WIDTH="d_model=1024 n_layers=8 n_heads=8 head_dim=128 d_ff=2816 kv_lora_rank=512 qk_nope_dim=128 qk_rope_dim=64 v_head_dim=128"
for model in hybrid attention; do
    # all-attention at 64 x 33K tokens holds ~69 GB of bf16 KV; the pool takes the whole budget up front
    $PY -m evict.cli bench serve --device cuda --preset "$model" --set $WIDTH --dtype bfloat16 \
        --clients 64 --requests 64 --prompt-len 32768 32768 --output-len 64 64 --check 4 \
        --max-batch 64 --cache-budget 80G --block-size 256 --max-len 32896 --prefill-chunk 4096 \
        --out "runs/bench/serve_${model}_cuda.json"
done
