#!/usr/bin/env bash
# One device call (`run`, carry .whl; `D=560 bash dev/one_dot.sh`): issue 74's first-stage candidate, prepared in
# session 73 on the CPU (no device time was left). dev/one_dot.patch adds forward.ONE_DOT (opt-in): the first stage's
# Gram matrices in one [C, K] x [K, C] dot per chunk instead of C / SC strips, in `_intra_one_kernel` compiled without
# the strips (sm_90, bf16, K 128: 207 registers at chunks of 32 and 232 at 64 with 8 warps, no spill, against the
# one-tile kernel's 255 and 100 / 440 B spilled); per-channel gates go through each channel's midpoint, and chunks
# spreading past 2 SPREAD = 80 go to a second launch by strips. With it, forward.INV_DOTS (opt-in): the four
# diagonal 16 x 16 inverses as (I - L)(I + L^2)(I + L^4)(I + L^8), six batched dots, instead of 15 row updates. And
# backward.ONE_DOT (opt-in): the key kernel's phase 3 per chunk in dots (`_chunk_grads`, 16 key columns a tile)
# instead of per 16-row strip, the chunks past 2 SPREAD by strips. Its interpreter tests pass on the CPU and
# dev/ptx_same.py finds the default kernels' PTX unchanged.
# Here: the patch applied, its GPU tests (test_gpu_one_dot_matches_reference: 72, each form alone), dev/fwd_stages.py
# (ONE_DOT with and without INV_DOTS beside the default and fla, whole op and first stage alone, 4 / 8 warps, KDA with
# every chunk past 2 SPREAD; backward.ONE_DOT's forward + backward), then the default forward's GPU tests. A step
# that would end past D seconds is skipped; results ($OUT/r.tgz) are rewritten after each step. If the tests pass
# and it is faster: `git apply dev/one_dot.patch`, then make it the default where the timings say, and delete this
# script and the patch.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r; D=${D:-560}
T0=$(date +%s); left() { echo $(( D - ($(date +%s) - T0) )); }
el() { tar czf $OUT/r.tgz -C $OUT r; echo "[$(( $(date +%s) - T0 )) s] $*"; }
step() { local need=$1; shift; [ $(left) -lt $need ] && { el "skipped (under $need s left): $*"; return 1; }; el "$*"; }
pyt() { local log=$1 t=$2; shift 2; timeout $t python3 -m pytest -o addopts="" -v -rf -p no:cacheprovider -m gpu -n 16 \
  --durations=5 "$@" > $OUT/r/$log 2>&1; echo "rc $?"; grep -v "^  \|^$\|PASSED\|Warning" $OUT/r/$log | tail -8; }
el start; bash dev/gpu.sh 2>&1 | tail -2
git apply dev/one_dot.patch && el "patch applied" || { el "PATCH FAILED"; exit 1; }
step 120 "ONE_DOT GPU tests" && pyt one_dot_tests.log 210 tests/ops/test_memory_triton.py -k one_dot
step 100 "fwd_stages" && { timeout $(( $(left) - 80 )) python3 -u dev/fwd_stages.py --budget $(( $(left) - 120 )) \
  > $OUT/r/fwd_stages.log 2>&1; grep -v "Warning\|warn\|^  \|^$" $OUT/r/fwd_stages.log | grep "ONE_DOT\|fla\|evict\|sdpa\|skipped" | head -40; }
step 60 "default forward GPU tests" && pyt default_tests.log $(( $(left) - 5 )) tests/ops/test_memory_triton.py -k test_gpu_forward_matches_reference
el done
