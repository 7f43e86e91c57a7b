#!/usr/bin/env bash
# Create or reuse the pinned virtualenv (default .venv) and install this package into it.
# Idempotent: a stamp holding the hash of the requirement files skips the install when
# nothing changed. Prints the virtualenv's python path on the last line of stdout; a cold set-up
# says what it is doing on stderr: one line per stage, then pip's own output (its progress bars
# where stderr is a terminal).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${DSV4_VENV:-$repo/.venv}
stamp=$venv/.dsv4-bootstrap-stamp
want=$(cat "$repo"/requirements/*.txt "$repo"/pyproject.toml "$repo"/setup.py "$0" "$repo/scripts/torchvision_cpu_shim.py" | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  echo "$venv/bin/python"
  exit 0
fi

if ! command -v python3.11 >/dev/null; then
  echo "bootstrap: python3.11 not found (Debian: apt-get install python3.11 python3.11-venv)" >&2
  exit 1
fi

stages=7
stage=0
started=$SECONDS
say() {  # one line per stage on stderr: "bootstrap [3/7] ..."
  stage=$((stage + 1))
  echo "bootstrap [$stage/$stages] $*" >&2
}
run_pip() {  # pip's output to stderr, keeping its terminal (progress bars) when stderr is one; the
  # "Location 'file:...' is ignored" warnings a local mirror configuration causes are dropped.
  "$venv/bin/python" -m pip --disable-pip-version-check "$@" \
    2> >(grep --line-buffered -v "^WARNING: Location 'file:" >&2 || true) >&2
}

echo "bootstrap: setting up $venv (first use, or requirements/pyproject/setup changed)" >&2
say "virtualenv: python3.11 -m venv $venv"
python3.11 -m venv "$venv"
say "pip, setuptools, wheel (latest)"
run_pip install --upgrade pip setuptools wheel
say "torch, CPU build (requirements/torch.txt; the largest download)"
run_pip install -r "$repo/requirements/torch.txt"
say "development and sglang import-time dependencies (requirements/cpu.txt)"
run_pip install -r "$repo/requirements/cpu.txt"
say "sglang, flashinfer-python, torchvision without their dependencies (requirements/no-deps.txt)"
run_pip install --no-deps -r "$repo/requirements/no-deps.txt"
say "torchvision import shim (scripts/torchvision_cpu_shim.py, into the virtualenv only)"
# torchvision's CUDA build needs two op schemas defined before it imports (see the shim).
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp "$repo/scripts/torchvision_cpu_shim.py" "$site/"
echo "import torchvision_cpu_shim" > "$site/torchvision_cpu_shim.pth"
say "this package, editable ($repo)"
run_pip install --no-deps --no-build-isolation -e "$repo"
echo "$want" > "$stamp"
echo "bootstrap: done in $((SECONDS - started)) s" >&2
echo "$venv/bin/python"
