#!/usr/bin/env bash
# Issue 73's engine on one CUDA GPU: the GPU engine tests (float32 greedy = generate through packed steps, CUDA-graph
# decode steps and preemption), then `evict bench serve` on the 3:1 hybrid (KKKM) and attention of the same width and
# depth side by side (bf16): 128 x (4K + 512) in a 4 GiB pool, batch 1 (the TPOT reference), 64 x (32K + 64), and the
# engine's knobs on the hybrid. JSON into ${RES:-runs/bench/serve73}. Needs fastapi, uvicorn, httpx (dev/wheels.sh:
# carried .whl/serve, installed here when missing). Modes, run in the order given (default all): tests (+ the attention,
# decode and packed memory ops' GPU tests), decode (the decode step's GPU tests and dev/serve_step_profile.py
# --decode-only 4352 --kernels 3 into $RES/decode_profile.txt), main (= 4k batch1 32k: the pairs), engine (the 4K load in process, no HTTP,
# both models, packed steps profiled; engine_hybrid / engine_attention one each), cap (the 4K hybrid with
# --decode-prefill-tokens 2048), attn (dev/packed_attention_gpu.py), profile (dev/serve_step_profile.py), knobs,
# http (the 4K hybrid through HTTP from one client process, from 4 (--client-procs 4), then the same load with
# `--spawn engine`: no server, the engine in the bench's process; side by side they are what the HTTP side and the
# bench's client cost; http_attention: the same three rows for attention), prefill (the prefill path's GPU tests: engine,
# attention op, mixed precision; then dev/serve_prefill_profile.py: one packed step of the 32K load per layer type, the
# hybrid with and without MLA's flash padding beside attention, then 32 x 32K through the engine in process; JSON
# $RES/prefill_profile.json; ~4 min), async (the engine's GPU tests, every case with and without async steps, then
# dev/serve_step_profile.py --decode-only 4352 --kernels 3 --compare-async into $RES/async_profile.txt: decode steps at
# 1 and 128 rows without and then with async steps in one process; ~150 s), async4k (the 4K hybrid load without and
# with --async-scheduling on, side by side; ~100 s), proc4k (the 4K hybrid and attention rows through HTTP, each without and with --engine-process on: the engine in a
# child process, its own GIL; 4 rows, ~4 min), budget (the 4K load, hybrid and attention at the default step budget and at
# --max-num-batched-tokens 16384, then the hybrid at 32768: four or eight 4K chunks a step; 5 rows, ~3 min), reps (the
# 4K pair REPS times, alternating, with REPFLAGS; ~35 s a row). Since session 67 the bench sends from a quarter of the
# host's CPUs (1 to 4 client processes) unless --client-procs is given; each row has client_busy.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
MODES=${*:-tests main engine cap attn profile knobs}
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RES=${RES:-runs/bench/serve73}
mkdir -p "$RES"
$PY -c "import fastapi, uvicorn, httpx, openai" 2>/dev/null || $PY -m pip install -q --no-index --find-links .whl/serve fastapi uvicorn httpx openai
$PY -c "import httptools, uvloop" 2>/dev/null || $PY -m pip install -q --no-index --find-links .whl/serve httptools uvloop \
    || echo "no httptools / uvloop wheels in .whl/serve (bash dev/wheels.sh): uvicorn runs h11 + asyncio"
$PY -c "import importlib.util as u; print('uvicorn http:', 'httptools' if u.find_spec('httptools') else 'h11', 'loop:', 'uvloop' if u.find_spec('uvloop') else 'asyncio')"
$PY -c "import torch, triton; print('card', torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
date -u
WIDTH="d_model=1024 n_layers=8 n_heads=8 head_dim=128 d_ff=2816 kv_lora_rank=512 qk_nope_dim=128 qk_rope_dim=64 v_head_dim=128"
bench() {  # name model timeout flags...
    local name=$1 model=$2 t=$3; shift 3
    echo "== $name ($model) $(date -u +%T)"
    timeout "$t" $PY -m evict.cli bench serve --device cuda --preset "$model" --set $WIDTH --dtype bfloat16 \
        --block-size 256 --prefill-chunk 4096 "$@" --out "$RES/${name}_${model}.json" 2>&1 | grep -v "^json:"
}
B4K="--clients 128 --requests 128 --prompt-len 4096 4096 --output-len 512 512 --check 2 --max-batch 128 --cache-budget 4G --max-len 4608"
BATCH1="--clients 1 --requests 1 --warmup 1 --prompt-len 4096 4096 --output-len 512 512 --check 0 --max-batch 1 --cache-budget 4G --max-len 4608"
B32K="--clients 64 --requests 64 --prompt-len 32768 32768 --output-len 64 64 --check 1 --max-batch 64 --cache-budget ${BIG:-70G} --max-len 32896"
mode_tests() {
    timeout "${TEST_S:-150}" $PY -m pytest -o addopts="" -v -rf -m gpu tests/serve/test_engine_gpu.py tests/ops/test_attention.py \
        tests/ops/test_decode.py tests/ops/test_memory_triton.py::test_gpu_packed_sequences_match_each_sequence_alone \
        -p no:cacheprovider ${TEST_N:+-n $TEST_N}
}
mode_decode() {  # the decode step's GPU tests (engine, the step kernel with and without pre, the conv step), then
    # its profile at 1 and 128 rows (context 4,352: step, replay alone, torch.profiler tables of 3 eager and 3 graph steps)
    timeout "${TEST_S:-90}" $PY -m pytest -o addopts="" -v -rf -m gpu tests/serve/test_engine_gpu.py tests/ops/test_memory_preact.py \
        tests/ops/test_conv_step.py \
        tests/ops/test_memory_triton.py::test_gpu_step_matches_reference_in_place_and_graphed \
        tests/ops/test_memory_triton.py::test_gpu_step_rows_match_reference_in_place_and_graphed \
        -p no:cacheprovider ${TEST_N:+-n $TEST_N}
    timeout "${PROFILE_S:-60}" $PY dev/serve_step_profile.py --decode-only 4352 --kernels 3 > "$RES/decode_profile.txt" 2>&1
    grep "DECODE_PROFILE" "$RES/decode_profile.txt" || tail -5 "$RES/decode_profile.txt"
}
mode_async() {  # issue 73's async steps: GPU tests, then the decode step's time without / with them in one process
    timeout "${TEST_S:-90}" $PY -m pytest -o addopts="" -v -rf -m gpu tests/serve/test_engine_gpu.py -p no:cacheprovider ${TEST_N:+-n $TEST_N}
    timeout "${PROFILE_S:-85}" $PY dev/serve_step_profile.py --decode-only 4352 --kernels 3 --compare-async \
        > "$RES/async_profile.txt" 2>&1
    grep -E "DECODE_(PROFILE|COMPARE)" "$RES/async_profile.txt" || tail -5 "$RES/async_profile.txt"
}
mode_async4k() { bench 4k_sync hybrid 100 $B4K; bench 4k_async hybrid 100 $B4K --async-scheduling on; }
mode_proc4k() {  # the engine in the server's thread (default) vs in a child process, same B4K load, side by side
    for m in ${PROC_MODELS:-hybrid attention}; do
        bench 4k_thread "$m" 120 $B4K --engine-process off; bench 4k_proc "$m" 120 $B4K --engine-process on
    done
}
mode_4k() { for m in hybrid attention; do bench 4k "$m" 120 $B4K; done; }
mode_reps() {  # the 4K pair REPS times (default 3), hybrid and attention alternating, each with REPFLAGS (e.g.
    # "--engine-process on"): HTTP rows of the hybrid moved 19-28 req/s between calls at the same flags (session 67)
    for i in $(seq "${REPS:-3}"); do for m in hybrid attention; do bench "4k_rep$i" "$m" 100 $B4K ${REPFLAGS:-}; done; done
}
mode_batch1() { for m in ${BATCH1_MODELS:-hybrid attention}; do bench batch1 "$m" 60 $BATCH1; done; }  # BATCH1_MODELS=hybrid: one
mode_32k() { for m in hybrid attention; do bench 32k "$m" 120 $B32K; done; }
mode_main() { mode_4k; mode_batch1; mode_32k; }
mode_engine() {  # the same 4K load in process: the engine's own rate, no HTTP server or clients; 3 packed steps profiled
    timeout 90 $PY dev/serve_step_profile.py --steps 0 --warmup 8 --kernels 3
    timeout 90 $PY dev/serve_step_profile.py --steps 0 --warmup 8 --model attention
}
mode_engine_hybrid() { timeout 90 $PY dev/serve_step_profile.py --steps 0 --warmup 8 --kernels 3; }
mode_engine_attention() { timeout 90 $PY dev/serve_step_profile.py --steps 0 --warmup 8 --model attention; }
mode_http() {  # HTTP with one client process (the default before session 67), with 4, and the engine in process
    bench 4k_clients1 hybrid 120 $B4K --client-procs 1; bench 4k_clients4 hybrid 120 $B4K --client-procs 4
    bench 4k_inprocess hybrid 120 $B4K --spawn engine
}
mode_http_attention() {  # the same three rows for attention
    bench 4k_clients1 attention 120 $B4K --client-procs 1; bench 4k_clients4 attention 120 $B4K --client-procs 4
    bench 4k_inprocess attention 120 $B4K --spawn engine
}
mode_prefill() {
    timeout "${TEST_S:-150}" $PY -m pytest -o addopts="" -v -rf -m gpu tests/serve/test_engine_gpu.py tests/ops/test_attention.py \
        tests/models/test_mixed_precision.py -p no:cacheprovider ${TEST_N:+-n $TEST_N}
    timeout "${PROFILE_S:-130}" $PY -u dev/serve_prefill_profile.py --reps 3 --json "$RES/prefill_profile.json"
}
mode_budget() {  # the step budget on both models (a larger one gives the KDA op's carry more sequences a step)
    mode_4k
    for m in hybrid attention; do bench 4k_budget16k "$m" 100 $B4K --max-num-batched-tokens 16384; done
    bench 4k_budget32k hybrid 100 $B4K --max-num-batched-tokens 32768
}
mode_cap() { bench 4k_cap2k hybrid 100 $B4K --decode-prefill-tokens 2048; }
mode_attn() { timeout 60 $PY dev/packed_attention_gpu.py; }
mode_profile() {  # steps of the 4K load in process: the prefill phase, then the decode phase
    timeout 60 $PY dev/serve_step_profile.py --steps 90
    timeout 40 $PY dev/serve_step_profile.py --steps 40 --conv torch
}
mode_knobs() {
    bench 4k_prefill_first hybrid 100 $B4K --priority prefill
    bench 4k_budget2k hybrid 100 $B4K --max-num-batched-tokens 2048
    [[ -n ${ALL_KNOBS:-} ]] || return 0
    bench 4k_no_graphs hybrid 100 $B4K --cuda-graphs off
    bench 4k_chunk1k hybrid 100 $B4K --prefill-chunk 1024
    bench 4k_max64 hybrid 100 ${B4K/--max-batch 128/--max-batch 64}
}
for m in $MODES; do
    declare -F "mode_$m" >/dev/null || { echo "serve_engine_gpu.sh: unknown mode $m"; exit 2; }
    echo "=== mode $m $(date -u +%T)"
    "mode_$m"
done
date -u
