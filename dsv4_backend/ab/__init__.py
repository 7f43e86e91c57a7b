"""The A/B tool: replay one serving trace through two attention backends and compare them.

``python -m dsv4_backend ab`` (``cli``); from Python: build a ``Trace`` (``build_trace``), two
backends (``make_backend`` or ``DSV4Backend`` / ``ReferenceBackend`` directly), ``run_trace``,
then ``build_report`` / ``write_report``.
"""

from dsv4_backend.ab.backends import Backend, DSV4Backend, ReferenceBackend, make_backend
from dsv4_backend.ab.report import build_report, render_markdown, write_report
from dsv4_backend.ab.runner import ABResult, ModeStats, run_trace
from dsv4_backend.ab.trace import MODES, PATHS, Step, Trace, build_trace

__all__ = [
    "MODES",
    "PATHS",
    "ABResult",
    "Backend",
    "DSV4Backend",
    "ModeStats",
    "ReferenceBackend",
    "Step",
    "Trace",
    "build_report",
    "build_trace",
    "make_backend",
    "render_markdown",
    "run_trace",
    "write_report",
]
