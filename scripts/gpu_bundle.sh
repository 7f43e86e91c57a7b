#!/usr/bin/env bash
# The GPU bundle: ../shared/tools/gpu-bundle.sh builds .gpu-bundle/ (what a stock CUDA + PyTorch
# + Triton image lacks to run scripts/gpu_check.sh), then the Gluon ws attention kernels are
# compiled here with the pinned Triton 3.8 for sm_90a into .gpu-bundle/precompiled/ (the GPU
# image's Triton 3.6 cannot compile them; with DSV4_PRECOMPILED_DIR naming that folder the
# launcher runs the cubins through the CUDA driver: dsv4_backend/kernels/device/precompiled.py).
# pytest and hypothesis go in too. Prints the bundle's size and fails when it passes 64 MiB (what a device run carries).
# PYTHON overrides the interpreter (default: .venv/bin/python, after scripts/bootstrap.sh).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
export PYTHON=${PYTHON:-$repo/.venv/bin/python}
bash "$repo/../shared/tools/gpu-bundle.sh"  # run from the project root: it builds ./.gpu-bundle
# pytest and hypothesis (the GPU check's pytest step and the tests' conftest) at the venv's
# versions, as wheels for the GPU image's CPython 3.12: .gpu-bundle/run.sh installs whl/*.whl
test_deps=(pytest pluggy iniconfig packaging hypothesis sortedcontainers attrs)
specs=(); for p in "${test_deps[@]}"; do
    specs+=("$p==$("$PYTHON" -c "import importlib.metadata as m; print(m.version('$p'))")")
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$repo/.gpu-bundle/whl" "${specs[@]}"
TRITON_INTERPRET=0 "$PYTHON" -m dsv4_backend.tools.precompile --target sm_90a \
    --out "$repo/.gpu-bundle/precompiled"
bytes=$(du -sb "$repo/.gpu-bundle" | cut -f1)
limit=$((64 * 1024 * 1024))
echo "gpu_bundle: .gpu-bundle/ is $((bytes / 1024 / 1024)) MiB ($bytes bytes;" \
     "precompiled/ $(du -sh "$repo/.gpu-bundle/precompiled" | cut -f1)), limit 64 MiB"
if [ "$bytes" -gt "$limit" ]; then
    echo "gpu_bundle: over the 64 MiB a device run carries" >&2
    exit 1
fi
