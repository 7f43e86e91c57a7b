"""The thin layer between sglang and this package.

``factory`` holds the functions sglang calls (registered by :mod:`dsv4_backend.registration`);
``backend`` and ``draft`` hold the backend classes they build. Nothing here imports sglang or
the kernels at import time.
"""
