#!/usr/bin/env bash
# Create or reuse the pinned virtualenv (default .venv) and install this package into it.
# Idempotent: a stamp holding the hash of the requirement files skips the install when
# nothing changed. Prints the virtualenv's python path on the last line.
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
{
  python3.11 -m venv "$venv"
  pip="$venv/bin/python -m pip --disable-pip-version-check -q"
  $pip install --upgrade pip setuptools wheel
  $pip install -r "$repo/requirements/torch.txt"
  $pip install -r "$repo/requirements/cpu.txt"
  $pip install --no-deps -r "$repo/requirements/no-deps.txt"
  # torchvision's CUDA build needs two op schemas defined before it imports (see the shim).
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cp "$repo/scripts/torchvision_cpu_shim.py" "$site/"
  echo "import torchvision_cpu_shim" > "$site/torchvision_cpu_shim.pth"
  $pip install --no-deps --no-build-isolation -e "$repo"
} 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } >&2
echo "$want" > "$stamp"
echo "$venv/bin/python"
