#!/usr/bin/env bash
# One device-machine call (`run` tool; carry .whl, made by `bash dev/wheels.sh`): `bash dev/gpu.sh MODE [MODE …]`,
# modes run in order. The GPU box has no package index: fastapi / uvicorn / httpx and fla (the optional oracle)
# install from the carried ./.whl (the default text corpus ships inside evict: evict/data/shakespeare.tar.bz2).
# Timeouts: T (tests), TO (benches); every mode writes its log under $OUT. Modes:
#   tests:   optests (memory op, default forms), formtests (its opt-in forms), alltests (every `gpu` test), verify (distributed + fast training), mptests
#            (mixed precision), labtests (the labs'), bwtests (the memory op's gradient tests), convtests (the short conv's Triton form + mixed precision), traintests, decodetests
#   kernels: opsfwd (bench ops without fla's slowly autotuned backward), ops (all of it), tune (TUNE=args),
#            tunefwd / tunebwd (session 5's variant sets), split (the key kernel in one launch or two), factors (session 10's kept
#            first-stage factors: GPU tests, precision rows, timings), close12 (session 11's leftovers: the opt-in forms'
#            GPU tests under the new warps; the value kernel at 4 warps at C 64; the recompute's carry at tf32; every
#            intermediate kept, keep_states: GPU tests, precision rows, timings), prep / prepbwd (session 6's prepared forms
#            at chunks 64 and 32: their GPU tests and forward timings / forward + backward; VARS), chunks (GPU tests of
#            `chunk` 32 / 16), tunelab (the kernels at the lab's full-grid shape, D 32),
#            precision (dev/check_precision.py), kgrid (`evict bench grid`: the kernel table over N x head dim x chunk,
#            GRIDFLAGS, default the full grid; rows resume from the committed results/bench/grid/grid_h100.jsonl), claims
#            (`evict bench claims --device cuda`: CLAIMS, default situ attn_res dplr, each its own process under TO, MODES),
#            artrain (`--claims attn_res_train --full --seeds SEEDS --resume` over the committed
#            results/bench/claims/attn_res_train_full.json: a seed or two a call, the result holding every seed so far),
#            fuse (session 59's output-in-the-carry form, forward_triton(fuse_out=True): its GPU tests, then
#            dev/fwd_stages.py: old vs new vs fla per stage, both shapes), kbwd (session 60: fuse_out by shape and the backward's
#            formed K e^{g_C - g}: their GPU tests, then dev/fwd_stages.py --fla-bwd: both output forms, the default marked,
#            fwd+bwd with the kernel table, GDN's backward as before, fla's fwd and fwd+bwd; both shapes; ~230 s)
#   decode:  decode, decode1m, decodebench, decodecompile, decodeprofile, dial (the chunk dial's GPU numbers)
#   train:   losschunk (the loss at GPT-2's head, B48: dev/train_ops_bench.py --chunk-rows 1 2 4 8, the row chunk
#            1-8x the default), bench (cells per second, issue 10), mpsbench (the same, compiled, PROCS each with and without MPS), learns (dev/learns_gpu.py: session 12's two MQAR-learns failures over
#            seeds and op forms), grid (a piece of `evict recall --full`: MIN, GRIDARGS, GRID; the runs
#            of earlier pieces in results/recall/full/ are restored first: dev/grid_restore.py), lab (a piece of
#            `evict lab $LAB --full` under MPS, pieces in results/$LAB/full/ restored first; LAB: capacity hybrid pairs
#            state stories ttt, or counters: `evict lab state --counters-full`, pieces in results/state/counters_full/;
#            CALL below), proflab (dev/profile_train.py: one cell's step, eager / graphed /
#            compiled, top kernels; PROFARGS="--hybrid PATTERN …": lab hybrid --full's models; "--pairs-dim D --arch …": lab pairs --full's top rungs; PROFTAG names the log), side (a side experiment of the grid: SIDE=finite | mla | gate | tied | untied | seeds, SIDEARGS; several names run side by side),
#            hybriddepth (dev/hybrid_depth.py: lab hybrid --full's MQAR models under a longer schedule, side by side), dist (dev/dist_bench.sh: two GPUs, kind nvidia-h200-x2)
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
set -uo pipefail
T0=${T0:-$(date +%s)}  # CALL (below) counts from here (a MODE+MODE group passes its own)
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.tcache PYTHONPATH=$PWD
mkdir -p .tcache "${OUT:=/tmp/out}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import fastapi, uvicorn, httpx, openai" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl/serve fastapi uvicorn httpx openai
python3 -c "import fla" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/fla/*.whl
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
FORMS="kept_factors or kept_states or dstate_stages or intra_key_blocks or dkey_block or one_tile or out_forms"  # opt-in knobs' tests
# a sweep folder's finished runs as one JSONL (each result.json plus its run folder's name as "dir"): what a piece
# brings back, to commit (dev/grid_piece.py FILES_AT) and restore (dev/grid_restore.py) on the next bare machine
finished() { python3 dev/grid_restore.py --finished "$1"; }  # finished runs (and pairs ladders' finished rungs) as JSONL
# CUDA MPS (the card's multi-process service): kernels of the sweep's worker processes then run side by side instead
# of taking turns (session 13: 4 compiled kda cells 69.2 -> 85.9 cell-steps/s). MPS=0 switches it off.
# MPS_HELD=1 (set by a MODE+MODE group, below): the group holds the daemon, its pieces leave it alone.
mps_on() { [ "${MPS_HELD:-0}" = 1 ] && return; [ "${MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d && echo "MPS on"; }
mps_off() { [ "${MPS_HELD:-0}" = 1 ] && return; echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }
quiet() { grep -v "Warning\|warn\|^  \|^$"; }
# CALL=S: the whole call may take S seconds. Each timed piece (grid, lab) then runs for min(MIN, what is left less
# 40 s for its stop and results) minutes under a timeout of what is left less 15 s, and is skipped with under a
# minute to go: `CALL=570 MIN=8.5 bash dev/gpu.sh grid lab` gives the rest of a call that finishes the grid to a lab.
# (60 s until session 49, whose pairs pieces stopped about 0.1 min past their minutes; the first one's call ended
# about 16 s after its minutes.)
piece_min() { python3 -c "import sys; m, call, used = map(float, sys.argv[1:]); print(f'{m if call <= 0 else min(m, (call - used - 40) / 60):.2f}')" \
                ${MIN:-8} ${CALL:-0} $(( $(date +%s) - T0 )); }
piece_to() { [ "${CALL:-0}" = 0 ] && echo ${TO:-$1} || echo $(( CALL - ($(date +%s) - T0) - 15 )); }
too_late() { [ "${CALL:-0}" != 0 ] && python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < 1 else 1)" $(piece_min) && echo "dev/gpu.sh: $1 skipped, under a minute of CALL left"; }
# A piece of `evict recall --full` (FLAGS) in DIR under MPS, after restoring the runs committed in PIECES; DIR's
# config and finished runs come back as STEM_config.json / STEM_results.jsonl (dev/grid_piece.py [--side STEM]
# commits them and writes the tables and plots), the log as STEM.log. The grid's pieces are restored against
# `--full`'s config (GRIDARGS may narrow which runs exist); a side experiment's against its own last piece's.
# every committed piece in PIECES back into DIR, in one process (one import of torch, not one per piece):
# `restore DIR PIECES [--lab LAB]`
restore() { local dir=$1 pieces=$2 c rows=(); shift 2
  for c in $pieces/piece*_config.json; do [ -e "$c" ] && rows+=("$c" "${c%_config.json}_results.jsonl"); done
  [ ${#rows[@]} = 0 ] || python3 dev/grid_restore.py "$@" $dir "${rows[@]}"; }
recall_piece() { local dir=$1 pieces=$2 stem=$3 flags=$4 last
  last=$(ls $pieces/piece*_config.json 2>/dev/null | sort -V | tail -1)
  [ $stem != grid ] && [ -n "$last" ] && [ ! -e $dir/config.json ] && mkdir -p $dir && cp $last $dir/config.json
  restore $dir $pieces
  mps_on
  timeout $(piece_to 560) python3 -m evict.cli recall --full --minutes $(piece_min) --out $dir $flags 2>&1 \
    | grep -v "it/s\]$" | tail -60 | tee $OUT/$stem.log
  mps_off
  cp $dir/config.json $OUT/${stem}_config.json  # tables and plots: dev/grid_piece.py writes them
  finished $dir > $OUT/${stem}_results.jsonl; }
# the screen keeps the summary line ("N passed, M warnings"), which `quiet` would drop. `-o addopts=""` drops pyproject's
# -q so -v names every result as it lands (under xdist -q prints bare dots and names failures only in the summary, which
# a timeout cuts: session 61 lost two runs' failure names so); pytest-timeout (PT s a test) fails a hung test by name
pyt() { local log=$1 t=$2; shift 2; local pt=""; python3 -c "import pytest_timeout" 2>/dev/null && pt="--timeout ${PT:-300}"
  timeout $t python3 -m pytest -o addopts="" -v $pt "$@" -m gpu -rf --tb=line -p no:cacheprovider 2>&1 | tee $OUT/$log \
    | grep -v "Warning\|^  \|^$\|PASSED\|SKIPPED" | tail -30; }
# MODE+MODE…: those modes at the same time (each in its own `bash dev/gpu.sh MODE`, same CALL clock, one MPS daemon
# for all), e.g. `grid+side` with SIDE="tied untied": the grid's last long runs and two side sweeps share the card.
# SIDE may name several experiments; `side` then runs them side by side the same way.
group() { local pid pids=() m; mps_on  # a member VAR=value:MODE runs MODE with VAR=value
  for m in "$@"; do if [[ $m == *:* ]]; then env MPS_HELD=1 T0=$T0 "${m%%:*}" bash "$0" ${m#*:} & else MPS_HELD=1 T0=$T0 bash "$0" $m & fi
    pids+=($!); done
  for pid in "${pids[@]}"; do wait $pid; done; mps_off; }
for what in "$@"; do
  [[ $what == *+* ]] && { group ${what//+/ }; continue; }
  [ $what = side ] && [[ ${SIDE:-finite} == *" "* ]] && { group $(for s in $SIDE; do echo SIDE=$s:side; done); continue; }
  case $what in
    optests) pyt optests.log ${T:-480} tests/ops/test_memory_triton.py -n 8 -k "not ($FORMS)" ;;  # the default forms (119 tests)
    formtests) pyt formtests.log ${T:-420} tests/ops/test_memory_triton.py -n 8 -k "$FORMS" ;;  # the opt-in forms (90)
    alltests) pyt alltests.log ${T:-420} tests -n 8 --durations=15 ;;
    verify) pyt verify.log ${T:-300} tests/test_distributed_gpu.py tests/test_train_fast.py -n 4 ;;
    bwtests) pyt bwtests.log ${T:-300} tests/ops/test_memory_triton.py -k "gradients_match or packed or hard_resets or strong_decay" -n 8 ;;
    convtests) pyt convtests.log ${T:-200} tests/ops/test_conv.py tests/layers/test_conv.py tests/models/test_mixed_precision.py -n 8 ;;
    mptests) pyt mptests.log ${T:-200} tests/models/test_mixed_precision.py -n 4 ;;
    labtests) pyt labtests.log ${T:-120} tests/lab ;;  # the labs' `gpu` tests (a `lab` call's first mode: labtests lab)
    traintests) pyt traintests.log ${T:-200} tests/test_train_fast.py -n 4 ;;
    decodetests) pyt decodetests.log ${T:-300} tests/ops/test_decode.py tests/layers tests/models \
                   tests/ops/test_memory_triton.py::test_gpu_hard_resets_forward_and_gradients tests/test_train_fast.py::test_mqar_learns_on_cuda -n 8 ;;
    opsfwd) timeout ${TO:-200} python3 -m evict.cli bench ops --device cuda --no-fla-backward --shapes ${SHAPES:-4x8192 1x32768} \
              --out $OUT/bench_ops.json 2>&1 | tee $OUT/bench_ops.log ;;
    ops) timeout ${TO:-420} python3 -m evict.cli bench ops --device cuda --shapes ${SHAPES:-4x8192 1x32768} --out $OUT/bench_ops.json 2>&1 \
           | tee $OUT/bench_ops.log ;;
    tune) timeout ${TO:-200} python3 dev/triton_tune.py ${TUNE:-} 2>&1 | quiet | tee $OUT/tune.log ;;
    tunefwd) timeout ${TO:-150} python3 dev/triton_tune.py --fwd-only --shapes 4x8192,1x32768 --variants v0,f32,iw8,bv64,sw8,sw8bv64,ow8 2>&1 \
               | quiet | tee $OUT/tunefwd.log ;;
    tunebwd) timeout ${TO:-120} python3 dev/triton_tune.py --variants v0,t32,pk3,pr3 2>&1 | quiet | tee $OUT/tunebwd.log ;;
    split) timeout ${TO:-200} python3 dev/triton_tune.py --variants dk1,dk2 2>&1 | quiet | tee $OUT/split.log ;;
    tunelab) timeout ${TO:-200} python3 dev/triton_tune.py --shapes 256x512 --heads 4 --dim 32 --variants v0,c32,c16,c32iw8,iw8,iw8bw4,dk2 2>&1 \
               | quiet | tee $OUT/tunelab.log ;;
    fuse) pyt fuse.log ${T:-150} tests/ops/test_memory_triton.py -n 12 -k out_forms
          timeout ${TO:-200} python3 -u dev/fwd_stages.py --budget $(( ${TO:-200} - 40 )) > $OUT/fwd_stages.log 2>&1  # session 59's fuse_out
          quiet < $OUT/fwd_stages.log | tail -120 ;;  # (to $OUT first: rows piped through grep die in its buffer at a timeout)
    kbwd) pyt kbwd_tests.log ${T:-85} tests/ops/test_memory_triton.py -n 12 \
            -k "(out_forms and fused) or default_output_form or (dtype1 and (gradients_match or chunk_size_reaches or packed_sequences_match_each))"
          timeout ${TO:-145} python3 -u dev/fwd_stages.py --fla-bwd --budget $(( ${TO:-145} - 25 )) > $OUT/kbwd_stages.log 2>&1
          quiet < $OUT/kbwd_stages.log | tail -150 ;;
    chunks) pyt chunks.log ${T:-300} tests/ops/test_memory_triton.py -k "shorter_chunks" -n 8 ;;
    prep) pyt prep.log ${T:-240} tests/ops/test_memory_triton.py -k "out_forms or intra_key_blocks or one_tile_states or dkey_block or chunk_size or auto or packed" -n 8
          timeout ${TO:-200} python3 dev/triton_tune.py --fwd-only --shapes 4x8192,1x32768 --variants ${VARS:-v0,c32,o16,c32o16,ikb32,c32ikb32,c32ikb64,hv,c32hv,all,c32all} \
            2>&1 | quiet | tee $OUT/prep_fwd.log ;;
    prepbwd) timeout ${TO:-240} python3 dev/triton_tune.py --shapes 4x8192,1x32768 --variants ${VARS:-v0,c32,c32ikb32,c32hv,c32dkb32,dkb32,c32all,all} \
            2>&1 | quiet | tee $OUT/prep_bwd.log ;;
    factors) pyt factors.log ${T:-240} tests/ops/test_memory_triton.py -k "kept_factors or dstate_stages" -n 8
             timeout ${TO:-150} python3 dev/check_precision.py channel scalar --factors 2>&1 | grep -v arn | tee $OUT/factors_precision.log
             timeout ${TO:-100} python3 dev/triton_tune.py --shapes 256x512 --heads 4 --dim 32 --variants c16,c16ds2 2>&1 | quiet | tee $OUT/factors_lab.log
             timeout ${TO:-300} python3 dev/triton_tune.py --shapes 4x8192,1x32768 --variants ${VARS:-v0,fk,fkt,kb64,c32,c32fk,c32fkt,c32ds2,c32fkds2,c32dk2,c32dkw4,c32bv64,c32bv16,c32st3} \
               2>&1 | quiet | tee $OUT/factors_time.log ;;
    close12) pyt close12.log ${T:-300} tests/ops/test_memory_triton.py -n 14 -k "$FORMS or test_gpu_auto or packed"  # the opt-in forms under session 11's warps
             timeout ${TO:-100} python3 dev/check_precision.py channel scalar --factors 2>&1 | grep -v arn | tee $OUT/close12_precision.log
             timeout ${TO:-120} python3 dev/triton_tune.py --shapes 4x8192,1x32768 --variants ${VARS:-fkt,fktw4,fktw444,ks,fkrc,c32fktw444,c32ks,c32fkrc} \
               2>&1 | quiet | tee $OUT/close12_time.log
             timeout 40 python3 dev/triton_tune.py --shapes 256x512 --heads 4 --dim 32 --variants c16fktds2,c16ks 2>&1 | quiet | tee $OUT/close12_lab.log ;;
    losschunk) timeout ${TO:-150} python3 dev/train_ops_bench.py --chunk-rows ${ROWSX:-1 2 4 8} --out $OUT/losschunk.json 2>&1 \
               | quiet | tee $OUT/losschunk.log ;;
    kgrid) cp results/bench/grid/grid_h100.jsonl $OUT/grid_cuda.jsonl 2>/dev/null  # the committed rows: resume past them
           timeout ${TO:-540} python3 -m evict.cli bench grid --device cuda ${GRIDFLAGS:-} --out $OUT/grid_cuda.jsonl 2>&1 \
             | grep -v "^cells" | tee $OUT/grid.log | tail -60 ;;
    claims) for c in ${CLAIMS:-situ attn_res dplr}; do  # one process (and timeout) per claim: a slow one costs only itself
              timeout ${TO:-150} python3 -m evict.cli bench claims --device cuda --claims $c --modes ${MODES:-eager compiled} \
                --out $OUT/claims_$c.json 2>&1 | quiet | tee $OUT/claims_$c.log; done ;;
    artrain) f=attn_res_train_full.json  # `--claims attn_res_train --full` SEEDS (default 0) at a time, resumed from the
             # committed results/bench/claims/$f: its JSON, .md and plot come back; copy them there (dev/LOG.md says how)
             [ -e results/bench/claims/$f ] && cp results/bench/claims/$f $OUT/$f
             timeout $(piece_to ${TO:-560}) python3 -m evict.cli bench claims --device cuda --claims attn_res_train --full \
               --seeds ${SEEDS:-0} --resume --out $OUT/$f 2>&1 | quiet | tee $OUT/attn_res_train_full.log ;;
    precision) timeout ${TO:-200} python3 dev/check_precision.py ${GATES:-channel} 2>&1 | tee $OUT/precision.log
               timeout ${TO:-150} python3 dev/triton_tune.py --variants v0,pr3,rc3,rc3t 2>&1 | quiet | tee $OUT/precision_time.log ;;
    decode) timeout ${TO:-240} python3 -m evict.cli bench decode --device cuda --paths before graph compiled --batch1-only \
              --contexts 8192 131072 --steps 8 --out $OUT/decode.json 2>&1 | grep "^|\|copy" | tee $OUT/decode.log ;;
    decode1m) timeout ${TO:-150} python3 -m evict.cli bench decode --device cuda --paths before graph compiled --batch1-only \
                --models attention mla hybrid --contexts 1048576 --steps 5 --out $OUT/decode_1m.json 2>&1 | grep "^|\|copy" | tee $OUT/decode_1m.log ;;
    decodebench) timeout ${TO:-240} python3 -m evict.cli bench decode --device cuda --paths before graph --contexts 8192 32768 131072 \
                   --steps 10 --out $OUT/decode_paths.json 2>&1 | quiet | tee $OUT/decode_paths.log | tail -40 ;;
    decodecompile) timeout ${TO:-200} python3 -m evict.cli bench decode --device cuda --paths graph compiled --models kda hybrid \
                     --batch1-only --contexts 8192 131072 --steps 10 --out $OUT/decode_compiled.json 2>&1 | quiet | tee $OUT/decode_compiled.log ;;
    decodeprofile) timeout 120 python3 dev/profile_decode.py 2>&1 | tee $OUT/decode_profile.log | grep -v "^-" | head -80 ;;
    dial) timeout 90 python3 dev/chunk_dial_gpu.py --out $OUT/chunk_dial_gpu.json 2>&1 | tail -5 ;;
    mpsbench) for p in ${PROCS:-4 8}; do for m in 0 1; do MPS=$m; mps_on; timeout ${TO:-150} python3 -m evict.cli bench train \
                --arch kda --procs $p --train-steps ${STEPS:-300} --variants compiled --out $OUT/bench_train_p${p}_mps$m.json 2>&1 \
                | quiet | grep "^| kda" | sed "s/^/MPS=$m /"; mps_off; done; done ;;  # cell-steps/s with and without MPS
    bench) timeout ${TO:-240} python3 -m evict.cli bench train --arch kda --procs 4 --train-steps ${STEPS:-100} --variants before graphs compiled \
             --out $OUT/bench_train_p4.json 2>&1 | quiet | tee $OUT/bench_train.log ;;
    lab) too_late lab && continue  # LAB: capacity context counters heads hybrid pairs state stories ttt; MIN, LABARGS
         # the lab and its mode (dev/grid_restore.py's MODES): "NAME full", or "state counters_full" for LAB=counters
         # (`evict lab state --counters-full`, pieces in results/state/counters_full/), "capacity heads_full" for
         # LAB=heads (`evict lab capacity --heads-full`, pieces in results/capacity/heads_full/)
         read -r name mode < <(python3 dev/grid_restore.py --mode $LAB) || continue
         restore runs/lab_$LAB results/$name/$mode --lab $LAB
         mps_on; own=LABARGS_$LAB  # LABARGS_state="--workers 8": that lab's own flags, else LABARGS
         timeout $(piece_to 580) python3 -m evict.cli lab $name --${mode//_/-} --minutes $(piece_min) --out runs/lab_$LAB \
           ${!own:-${LABARGS:-}} 2>&1 | grep -v "it/s\]$" | tail -40 | sed "s/^/$LAB: /"  # the log: the reply's output_tail ($OUT holds 8 files)
         mps_off
         # tables and plots: dev/grid_piece.py --lab writes them; named by lab, so two labs can share a call (lab+lab,
         # LAB=capacity:lab+LAB=state:lab)
         cp runs/lab_$LAB/config.json $OUT/lab_${LAB}_config.json
         finished runs/lab_$LAB > $OUT/lab_${LAB}_results.jsonl ;;
    learns) timeout ${TO:-300} python3 dev/learns_gpu.py --archs ${ARCHS:-gated_deltanet gla} --seeds 0 1 2 --out $OUT/learns.json 2>&1 \
              | quiet | tee $OUT/learns.log ;;  # test_mqar_learns_on_cuda over seeds: graphed / eager / fp32 / chunked / C 64 / factors recomputed
    proflab) timeout ${TO:-300} python3 dev/profile_train.py ${PROFARGS:---arch ${ARCHS:-kda deltanet attention}} --compile 2>&1 | grep -v "^---" | tee $OUT/proflab${PROFTAG:-}.log ;;
    grid) too_late grid && continue
          recall_piece ${GRID:-runs/grid} results/recall/full grid "${GRIDARGS:-}" ;;
    side) too_late side && continue  # a side experiment of the grid (SIDE; folder runs/$SIDE; pieces in results/recall/full/side_$SIDE):
          # finite: the grid's (512, 64) deltanet / gla cells at their best lrs on one fixed set of 100,000 examples
          #   (Zoology's regime, ~20 epochs in 8,000 steps) against the grid's fresh batches;
          # mla: MLA alone in the cells where kimi_linear (KDA + MLA) stays at chance at the large lrs;
          # gate: the gated rules at d 64 with slower-forgetting gates at init (dt 1e-3..1e-2, not 1e-3..1e-1), where
          #   Gated DeltaNet (0.908) and KDA (0.837) sit below DeltaNet (0.931), against the published GDN >= DeltaNet;
          # tied / untied: Kimi Linear (layer 1 KDA, layer 2 MLA, untied embeddings) stays at chance at (512, 64) d 64 at
          #   2.2e-3 and 1e-2 where MLA alone (tied) solves it: tied = Kimi Linear with tied embeddings, untied = MLA
          #   alone untied — which of the two differences holds it there;
          # seeds: the d 64 (512, 64) cell at 1e-2 at seeds 1 and 2 (the grid ran seed 0) for deltanet and gated_deltanet (is GDN's 0.908 < 0.931 one
          #   seed's spread?) and kimi_linear (does the untied model stall at chance on every seed?)
          case ${SIDE:=finite} in
            finite) args="--archs deltanet gla --setting 512 64 --d-model 64 128 --lr 2.2e-3 1e-2 --train-examples 100000" ;;
            mla) args="--archs mla --setting 512 64 --d-model 64 128 --lr 2.2e-3 1e-2" ;;
            gate) args="--archs gated_deltanet kda gla --setting 512 64 --d-model 64 --lr 2.2e-3 1e-2 --gate-dt 1e-3 1e-2" ;;
            tied) args="--archs kimi_linear --setting 512 64 --d-model 64 --lr 2.2e-3 1e-2 --set tie_embeddings=true" ;;
            untied) args="--archs mla --setting 512 64 --d-model 64 --lr 2.2e-3 1e-2 --set tie_embeddings=false" ;;
            seeds) args="--archs deltanet gated_deltanet kimi_linear --setting 512 64 --d-model 64 --lr 1e-2 --seed 1 --seeds 2 --workers 6" ;;
            *) echo "dev/gpu.sh: SIDE=$SIDE: expected finite, mla, gate, tied, untied or seeds"; continue ;;
          esac
          recall_piece runs/$SIDE results/recall/full/side_$SIDE $SIDE "${SIDEARGS:-$args}" ;;
    hybriddepth) too_late hybriddepth && continue  # dev/hybrid_depth.py: lab hybrid --full's MQAR models under longer
          # schedules, one process per (pattern, run) side by side under MPS for MIN minutes: when (if) each leaves chance
          # (session 17: at 2,000 steps every MQAR run of --full stayed at chance). HDPATTERNS, HDRUNS; the rows come
          # back as one hybriddepth.json (a list), the logs as hd_logs.tar.gz
          # HDDIR=runs/hd: checkpoints there, so the same command on the same warm machine continues each run (its
          # checkpoints are too large to come back in $OUT: back-to-back calls only)
          mps_on; pids=(); n=0; hdset=""; for kv in ${HDSET:-}; do hdset="$hdset --set $kv"; done  # HDSET: ModelConfig KEY=VALUE …
          [ -n "${HDDIR:-}" ] && hdset="$hdset --run-dir $HDDIR"
          for pat in ${HDPATTERNS:-K KKKMKKKMKKKMKKKM}; do for r in ${HDRUNS:-lr=3e-3,steps=8000 lr=1e-3,steps=8000}; do n=$((n + 1))
            timeout $(piece_to 580) python3 dev/hybrid_depth.py --full --pattern $pat --runs $r --minutes $(piece_min) $hdset \
              --out $OUT/hd_$n.json > $OUT/hd_$n.log 2>&1 & pids+=($!); done; done
          for pid in "${pids[@]}"; do wait $pid; done; mps_off
          (cd $OUT && python3 -c "import glob, json; json.dump([r for f in sorted(glob.glob('hd_*.json')) for r in json.load(open(f))], open('hybriddepth.json', 'w'), indent=1)" \
             && rm -f hd_*.json && cat hybriddepth.json && tail -n 3 hd_*.log && tar czf hd_logs.tar.gz hd_*.log && rm hd_*.log) ;;
    dist) (OUT=/tmp/dist STEPS=${STEPS:-30} PY=python3 timeout ${TO:-330} bash dev/dist_bench.sh 2>&1 | quiet | tail -40) | tee $OUT/dist.log
          mkdir -p $OUT/dist && cp /tmp/dist/dist_bench.json $OUT/dist/ 2>/dev/null
          for r in /tmp/dist/gpu*; do mkdir -p $OUT/dist/${r##*/}; cp $r/run.json $r/metrics.jsonl $OUT/dist/${r##*/}/ 2>/dev/null; done ;;
    *) echo "dev/gpu.sh: unknown mode $what"; exit 2 ;;
  esac
done
# A call brings back at most 8 files from $OUT: past 8, the logs go into one logs.tar.gz (the results and configs,
# which dev/grid_piece.py reads, stay files); past 8 even then, everything goes into out.tar.gz (`tar xzf` it first).
if [ "${MPS_HELD:-0}" != 1 ] && [ "$(find $OUT -type f | wc -l)" -gt 8 ]; then
  (cd $OUT && ls *.log >/dev/null 2>&1 && tar czf logs.tar.gz *.log && rm -f *.log)
  [ "$(find $OUT -type f | wc -l)" -gt 8 ] && (cd $OUT && tar czf /tmp/out.tar.gz . && rm -rf ./* && mv /tmp/out.tar.gz .)
  echo "dev/gpu.sh: over 8 files in \$OUT, packed: $(cd $OUT && ls | tr '\n' ' ')"
fi
