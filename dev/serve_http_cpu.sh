#!/usr/bin/env bash
# Issue 73's HTTP side on a CPU, before/after in one run: dev/serve_http_profile.py's CPU per output token of the
# event loop and the engine thread, (1) with a stand-in engine (dev/serve_http_profile.py --stub-step-ms: 128 streams, 20 ms steps,
# no model: the loop's own cost), (2) the tiny hybrid (128 x (16 + 64), one torch thread) through HTTP and in
# process. Rows: OLD (a source tree, default: main checked out to a temporary folder) on h11 + asyncio, this tree on
# h11 + asyncio, this tree on httptools + uvloop (when installed). Usage: bash dev/serve_http_cpu.sh [OLD_TREE]
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OLD=${1:-}
if [[ -z $OLD ]]; then
    OLD=$(mktemp -d)
    trap 'rm -rf "$OLD"' EXIT
    git archive main | tar -x -C "$OLD"
fi
export PYTHONPATH=$PWD
LOAD="--preset hybrid --threads 1 --clients 128 --requests 128 --prompt-len 16 16 --output-len 64 64 --max-batch 128
      --cache-budget 64M --warmup 8"
for what in "--stub-step-ms 20 --output-len 128 128" ""; do
    echo "== ${what:-tiny hybrid} $(date -u +%T)"
    $PY dev/serve_http_profile.py $LOAD $what --modes http --trees "$OLD" "$PWD" --http h11 --loop asyncio --repeat 2 | grep "^|"
    $PY dev/serve_http_profile.py $LOAD $what --modes http $([[ -n $what ]] || echo engine) --repeat 2 | grep "^|" | tail -n +3
done
