#!/usr/bin/env bash
# Wheels the device machine lacks (it has no package index): `bash dev/wheels.sh` here, then `run` with carry [".whl"].
#   .whl/serve: fastapi + uvicorn (+ httptools, uvloop: its C parser and loop) and what they need beyond the device image (pydantic, starlette, …), and the
#               official `openai` client (tests/serve/test_remote.py imports it: without it its GPU test is never collected)
#   .whl/fla:   fla 0.6.0 (flash-linear-attention + fla-core), the optional oracle of `evict bench ops` / `dev/gpu.sh ops`
# dev/gpu.sh installs them from there. .whl/ is git-ignored; a fresh checkout must run this again.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac  # the comment above is the help
set -euo pipefail
cd "$(dirname "$0")/.."
get() { python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"; }
get .whl/serve fastapi uvicorn httptools uvloop httpx openai
get .whl/fla --no-deps fla-core==0.6.0 flash-linear-attention==0.6.0
du -sh .whl/serve .whl/fla
