#!/usr/bin/env bash
# The GPU check, one command: on a machine with a CUDA device, run every serving mode with the
# compiled Triton kernels against the reference (TRITON_INTERPRET=0), then the EAGLE v2 loop
# with CUDA graphs captured and replayed, compared with eager (benchmarks/gpu_eagle_loop.py);
# then the A/B of this backend against sglang's own (scripts/dsv4 ab --device cuda --a
# sglang:dsv4 --b sglang:dsv4_builtin, real head dimensions) where the built-in can start, else
# the first thing it lacks; then the per-op, attention and planning benchmarks. The kernels not
# yet the CUDA default (DSV4_UNVERIFIED_KERNELS=1) run the serving modes and the CUDA-graph loop
# too, reported apart: their PASS is what makes them the default. Prints a summary.
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
"$py" -m pytest -q tests/test_serving_modes.py -k "cuda and default"
tests=$?
# The kernels not yet the CUDA default (dispatch.UNVERIFIED_OPS: the one-launch compressor, the
# length-bounded indexer; DSV4_UNVERIFIED_KERNELS=1 runs them) in every mode against the
# reference; reported, not part of the exit status until a change makes them the default.
"$py" -m pytest -q tests/test_serving_modes.py -k "cuda and unverified"
unverified=$?
DSV4_UNVERIFIED_KERNELS=1 "$py" benchmarks/gpu_eagle_loop.py  # their CUDA-graph capture too
unverified_loop=$?
"$py" benchmarks/gpu_eagle_loop.py
loop=$?
# The opt-in attention kernels (DSV4_ATTENTION_KERNEL=pipelined / ws) against the torch path;
# reported, not part of the exit status while neither is the default.
"$py" -m pytest -q tests/test_attention_kernels_cuda.py
opt_in=$?
# This backend against sglang's own, in the simulated host: Flash's attention dimensions (the
# built-in needs head_dim 512), one layer of each compress ratio.
ab_dir=$(mktemp -d)
trap 'rm -rf "$ab_dir"' EXIT
cat > "$ab_dir/config.json" <<'JSON'
{"num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0], "num_attention_heads": 64,
 "head_dim": 512, "qk_rope_head_dim": 64, "index_topk": 512, "index_n_heads": 64,
 "index_head_dim": 128, "sliding_window": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
 "compress_rope_theta": 160000.0,
 "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}}
JSON
"$py" -m dsv4_backend ab --device cuda --a sglang:dsv4 --b sglang:dsv4_builtin \
    --config "$ab_dir/config.json" --out "$repo/ab-report-sglang" --quiet 2> "$ab_dir/stderr"
ab=$?
cat "$ab_dir/stderr" >&2
ab_verdict=$("$py" - "$ab" "$repo/ab-report-sglang/report.json" "$ab_dir/stderr" <<'PY'
import json, sys
status, report, stderr = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if status == 2:  # refused before the run: the line names what is missing
    line = next((l for l in open(stderr) if l.strip()), "no message").strip()
    print(f"SKIPPED (sglang:dsv4_builtin cannot start here: {line})")
    sys.exit()
modes = json.load(open(report))["modes"]
errors = [m["error"] for m in modes if m["error"]]
if errors and "sglang:dsv4_builtin raised" in errors[0]:
    print(f"SKIPPED (sglang:dsv4_builtin cannot run here; first thing it lacks: {errors[0]})")
else:
    failed = [m["label"] for m in modes if not m["passed"]]
    print("PASS" if status == 0 else f"FAIL ({', '.join(failed)})")
PY
)
ab_verdict=${ab_verdict:-"FAIL (no report: ab exited $ab)"}
echo "gpu_check: sglang A/B (report in ab-report-sglang/): $ab_verdict"
# Figures for the notes (they print; they do not decide the exit status).
"$py" benchmarks/bench_ops.py
echo "gpu_check: bench_ops with DSV4_UNVERIFIED_KERNELS=1 (one-launch compressor, length-bounded indexer):"
DSV4_UNVERIFIED_KERNELS=1 "$py" benchmarks/bench_ops.py
"$py" benchmarks/bench_attention.py --verify --kernel triton pipelined ws --against flashmla
"$py" benchmarks/bench_planning.py --device cuda
echo "gpu_check summary: kernel/serving tests $([ $tests -eq 0 ] && echo PASS || echo FAIL)," \
     "CUDA-graph loop $([ $loop -eq 0 ] && echo PASS || echo FAIL)," \
     "opt-in attention kernels $([ $opt_in -eq 0 ] && echo PASS || echo FAIL)," \
     "unverified compressor / indexer kernels (modes, CUDA-graph loop)" \
     "$([ $unverified -eq 0 ] && echo PASS || echo FAIL) / $([ $unverified_loop -eq 0 ] && echo PASS || echo FAIL)," \
     "sglang A/B $ab_verdict"
[ $tests -eq 0 ] && [ $loop -eq 0 ] && [ "${ab_verdict%% *}" != FAIL ]
