"""Shared test set-up.

Triton reads ``TRITON_INTERPRET`` once, when it is first imported, so it is set here before any
test module can import triton: on a machine without a GPU the Triton kernels then run in the
interpreter. A caller may set it first (``TRITON_INTERPRET=0`` on a GPU machine runs them
compiled).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
