#!/usr/bin/env bash
# The GPU check, one command: on a machine with a CUDA device, run every serving mode with the
# compiled Triton kernels against the reference (TRITON_INTERPRET=0), then the EAGLE v2 loop
# with CUDA graphs captured and replayed, compared with eager (benchmarks/gpu_eagle_loop.py);
# then the per-op, attention and planning benchmarks. Prints a summary.
# Without a CUDA device it exits 3 at once, saying so. PYTHON overrides the interpreter
# (default: .venv/bin/python).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
py=${PYTHON:-$repo/.venv/bin/python}
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); this check needs a GPU." >&2
    echo "gpu_check: nothing was run. On a GPU machine: scripts/gpu_check.sh" >&2
    exit 3
fi
export TRITON_INTERPRET=0
# The kernel tests proper run on the CPU through the interpreter; on the GPU, every serving mode
# runs the compiled kernels against the reference (tests marked for CUDA).
"$py" -m pytest -q tests/test_serving_modes.py -k cuda
tests=$?
"$py" benchmarks/gpu_eagle_loop.py
loop=$?
# The opt-in attention kernels (DSV4_ATTENTION_KERNEL=pipelined / ws) against the torch path;
# reported, not part of the exit status while neither is the default.
"$py" -m pytest -q tests/test_attention_kernels_cuda.py
opt_in=$?
# Figures for the notes (they print; they do not decide the exit status).
"$py" benchmarks/bench_ops.py
"$py" benchmarks/bench_attention.py --verify
"$py" benchmarks/bench_planning.py --device cuda
echo "gpu_check summary: kernel/serving tests $([ $tests -eq 0 ] && echo PASS || echo FAIL)," \
     "CUDA-graph loop $([ $loop -eq 0 ] && echo PASS || echo FAIL)," \
     "opt-in attention kernels $([ $opt_in -eq 0 ] && echo PASS || echo FAIL)"
[ $tests -eq 0 ] && [ $loop -eq 0 ]
