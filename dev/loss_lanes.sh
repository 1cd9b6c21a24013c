#!/usr/bin/env bash
# One device call (`run`, carry .whl; `D=450 bash dev/loss_lanes.sh`): issue 74's loss candidate, prepared in session 71
# and not yet run on a card (no machine came that session). GPT-2 124M compiled at B48 x T1024 on this tree, then
# dev/loss_lanes.patch applied — dev/ce_lanes.py's row kernel (per-lane running max / sum / first argmax, 16-byte loads
# over the padded vocabulary) as evict/ops/loss_triton.py's, the dW sum inside the product (addmm out_dtype), tests for
# ties / padding / GPT-2's unaligned V — and: tests/ops/test_loss.py's GPU tests, GPT-2 B48 again at the loss's row
# chunk x2 / x1 (CHUNK_ELEMENTS scaled for the run), dev/ce_lanes.py (float64 checks, BV / warps timings), x4, the
# packed memory op's last two owed GPU cases, the chunk sweep. A step that would end past D seconds is skipped; the
# results ($OUT/r.tgz) are rewritten after each step. If the tests pass and the step is faster: `git apply
# dev/loss_lanes.patch`, set the chunk the timings chose, delete dev/ce_lanes.py, this script and the patch.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r; D=${D:-450}
T0=$(date +%s); left() { echo $(( D - ($(date +%s) - T0) )); }
el() { tar czf $OUT/r.tgz -C $OUT r; echo "[$(( $(date +%s) - T0 )) s] $*"; }
step() { local need=$1; shift; [ $(left) -lt $need ] && { el "skipped (under $need s left): $*"; return 1; }; el "$*"; }
gpt2() { timeout $(( $(left) < 110 ? $(left) : 110 )) python3 -c "import sys, evict.ops.loss as L; L.CHUNK_ELEMENTS = int(L.CHUNK_ELEMENTS * float(sys.argv[1])); from evict.cli import main; sys.exit(main(sys.argv[2:]))" $1 bench train --lm gpt2_124m --device cuda --modes compiled \
  --batch-size 48 --seq-len 1024 --no-reference --profile 12 --out $OUT/r/$2.json > $OUT/r/$2.log 2>&1; grep "tok/s\|^| gpt2" $OUT/r/$2.log | tail -2; }
el start; bash dev/gpu.sh 2>&1 | tail -2
step 60 "gpt2 main" && gpt2 1 gpt2_main
git apply dev/loss_lanes.patch && el "patch applied" || el "PATCH FAILED"
step 60 tests && { timeout 120 python3 -m pytest -o addopts="" -v -rf -p no:cacheprovider -m gpu -n 4 tests/ops/test_loss.py > $OUT/r/test_loss.log 2>&1; grep -v "^  \|^$" $OUT/r/test_loss.log | tail -6; }
for m in 2 1; do step 50 "gpt2 new x$m" && gpt2 $m gpt2_new_x$m; done
step 50 "ce_lanes (after the patch: library = the candidate)" && { timeout $(( $(left) - 5 )) python3 dev/ce_lanes.py --out $OUT/r/ce_lanes.json > $OUT/r/ce_lanes.log 2>&1; grep -v "arn" $OUT/r/ce_lanes.log | cut -c1-160 | tail -16; }
step 50 "gpt2 new x4" && gpt2 4 gpt2_new_x4
step 60 packed && { timeout $(( $(left) - 5 )) python3 -m pytest -o addopts="" -v -rf -p no:cacheprovider -m gpu -n 4 tests/ops/test_memory_triton.py -k "packed_sequences_match_each and channel-True" > $OUT/r/packed.log 2>&1; grep -v "^  \|^$" $OUT/r/packed.log | tail -4; }
step 40 "chunk sweep new" && { timeout $(( $(left) - 5 )) python3 dev/train_ops_bench.py --chunk-rows 1 2 4 8 --out $OUT/r/losschunk_new.json > $OUT/r/losschunk_new.log 2>&1; grep -v arn $OUT/r/losschunk_new.log | tail -6; }
el done
