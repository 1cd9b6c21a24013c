#!/usr/bin/env bash
# Issue 73's scheduling knobs side by side on a CPU (tiny hybrid KKKM, float32, one server thread): TTFT / TPOT under
# each. JSON into ${RES:-runs/bench/serve73_cpu}. Usage: bash dev/serve_knobs_cpu.sh [RUN ...] (default: all; a RUN is
# one of base prefill_first budget64 budget1024 chunk256 max8 cap64 base_repeat)
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
RES=${RES:-runs/bench/serve73_cpu}
mkdir -p "$RES"
BASE="--preset hybrid --threads 1 --clients 24 --requests 24 --prompt-len 200 400 --output-len 32 32 --check 2
      --max-batch 16 --block-size 16 --cache-budget 64M --prefill-chunk 64 --max-num-batched-tokens 256"
declare -A FLAGS=([base]="" [prefill_first]="--priority prefill" [budget64]="--max-num-batched-tokens 64"
    [budget1024]="--max-num-batched-tokens 1024" [chunk256]="--prefill-chunk 256" [max8]="--max-batch 8"
    [cap64]="--decode-prefill-tokens 64" [base_repeat]="")
for name in ${*:-base prefill_first budget64 budget1024 chunk256 max8 cap64}; do
    [[ -v FLAGS[$name] ]] || { echo "serve_knobs_cpu.sh: unknown run $name"; exit 2; }
    echo "== $name $(date -u +%T)"
    $PY -m evict.cli bench serve $BASE ${FLAGS[$name]} --out "$RES/$name.json" | grep -v "^json:"
done
