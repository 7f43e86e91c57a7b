#!/usr/bin/env bash
# The test suite: create or reuse the pinned virtualenv (scripts/bootstrap.sh), lint with ruff,
# run pytest on tests/ (extra arguments are passed to pytest: scripts/test.sh -k registration).
# Tests run even when lint fails; the exit status is pytest's if it failed, else ruff's.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=$(bash "$repo/scripts/bootstrap.sh" | tail -n 1)
cd "$repo"
lint=0
"$py" -m ruff check . || lint=$?  # pyproject.toml configures it; .gitignore is honoured
"$py" -m pytest -q tests "$@"
exit "$lint"
