"""The thin layer between sglang and this package (the only runtime code that knows sglang).

``factory`` holds the functions sglang calls (registered by :mod:`dsv4_backend.registration`);
``backend`` and ``draft`` hold the backend classes they build, ``batch_view`` maps a
``ForwardBatch`` onto the planner's ``BatchView`` and ``pool_alias`` views sglang's KV pool.
Importing this package or ``factory`` imports neither sglang nor the kernels (the factories
import ``backend`` when called); ``backend``, ``draft``, ``batch_view`` and ``pool_alias``
import sglang at import time.
"""
