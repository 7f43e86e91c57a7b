"""Shared test set-up.

Triton reads ``TRITON_INTERPRET`` once, when it is first imported, so it is set here before any
test module can import triton: on a machine without a GPU the Triton kernels then run in the
interpreter. A caller may set it first (``TRITON_INTERPRET=0`` on a GPU machine runs them
compiled).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread: on a 2-core machine torch's default thread pool oversubscribes the cores
# (the suite ran several times slower with it); set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Strict mode: device-side batch checks are read at planning, before anything is written
# (dsv4_backend/planning/checks.py). Free on the CPU; on a GPU it makes every test raise at once.
os.environ.setdefault("DSV4_STRICT_CHECKS", "1")

from hypothesis import settings

from dsv4_backend.testing.interpreter import patch_language_once

if os.environ["TRITON_INTERPRET"] == "1":
    patch_language_once()

# CI runs the same examples every time (a red run is reproducible); locally hypothesis explores.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
