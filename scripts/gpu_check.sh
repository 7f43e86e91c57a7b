#!/usr/bin/env bash
# The GPU check, one time-boxed command (dsv4_backend/tools/gpu_check.py; docs/gpu-check.md):
#   scripts/gpu_check.sh [--budget SECONDS] [--out DIR] [--only STEP ...] [--dry-run]
# Steps ordered by value, each under its own timeout, each verdict written to
# OUT/gpu-check.json as it ends (OUT: --out, else $OUT, else gpu-check/). Without a CUDA device
# it exits 3 at once, saying so; --dry-run lists the steps and their budgets anywhere.
# PYTHON overrides the interpreter (default: .venv/bin/python).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
py=${PYTHON:-$repo/.venv/bin/python}
export TRITON_INTERPRET=0
# Kernels compiled ahead of time for a host whose Triton cannot build them (scripts/gpu_bundle.sh)
if [ -z "${DSV4_PRECOMPILED_DIR:-}" ] && [ -d "$repo/.gpu-bundle/precompiled" ]; then
    export DSV4_PRECOMPILED_DIR=$repo/.gpu-bundle/precompiled
fi
exec "$py" -m dsv4_backend.tools.gpu_check --python "$py" "$@"
