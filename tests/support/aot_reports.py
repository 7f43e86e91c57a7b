"""The reports of the ahead-of-time compile tool (``dsv4_backend.tools.aot_compile``), for the
tests in ``tests/compiled/``. It runs in a fresh interpreter: the test session's
``TRITON_INTERPRET=1`` turns every ``@triton.jit`` function into an interpreted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The tool, and ``benchmarks/sass_report.py`` printing the same reports.
AOT_COMPILE = (sys.executable, "-m", "dsv4_backend.tools.aot_compile")
SASS_REPORT = (sys.executable, str(REPO / "benchmarks" / "sass_report.py"), "--json")


def compiled_reports(command: Sequence[str], timeout: float) -> list[dict]:
    """The JSON objects ``command`` prints, one a line; its stderr's tail if it fails."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(list(command), env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines()]
