#!/usr/bin/env bash
# The test suite: create or reuse the pinned virtualenv (scripts/bootstrap.sh), lint with ruff
# (check and format --check), type-check with mypy, run pytest on tests/ with a worker a core
# (pytest-xdist; DSV4_TEST_WORKERS sets the count, 0 runs in one process; a test file stays on
# one worker, so its module fixtures run once). Extra arguments are passed to pytest:
# scripts/test.sh -k registration; select by marker (pyproject.toml: gpu, compiled, stress,
# sglang) with scripts/test.sh -m compiled or -m "not compiled and not sglang". Tests run even
# when a check fails; the exit status is pytest's if it failed, else that of the first failing
# check.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=$(bash "$repo/scripts/bootstrap.sh" | tail -n 1)
cd "$repo"
status=0
check() {  # run a check; remember the status of the first one that fails
  "$@" || { local rc=$?; [ "$status" -ne 0 ] || status=$rc; }
}
# pyproject.toml configures all three; ruff honours .gitignore.
check "$py" -m ruff check .
check "$py" -m ruff format --check .
check "$py" -m mypy
"$py" -m pytest -q -n "${DSV4_TEST_WORKERS:-auto}" --dist loadfile --no-loadscope-reorder tests "$@"
exit "$status"
