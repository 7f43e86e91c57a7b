"""Skip marks the test files share (the markers that select tests are in pyproject.toml)."""

import pytest

from dsv4_backend.kernels.dispatch import interpreter_enabled

#: For tests that run the Triton kernels on the CPU: the interpreter is on only when
#: ``TRITON_INTERPRET=1`` was set before triton was imported (tests/conftest.py sets it unless
#: the caller set it first, e.g. ``TRITON_INTERPRET=0`` on a GPU machine).
needs_interpreter = pytest.mark.skipif(
    not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (tests/conftest.py)"
)
