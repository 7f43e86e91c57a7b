"""The thin layer between sglang and this package (the only runtime code that knows sglang),
along the roles of an attention backend:

* ``settings``: what the backend serves of a model runner (``RunnerSettings``), read and
  validated once;
* ``pool_alias``: the shared ``AttentionState``, its sizes, and its caches as views of
  sglang's KV pool;
* ``batch_read``: the one read of a ``ForwardBatch`` (the planner's view, padding, CP rows,
  the planning inputs; what a consumer's batch offers to the match);
* ``plan_session``: the plan's life between planning and its consumers (no sglang class);
* ``backend``: sglang's calls (``DSV4AttentionBackend``); ``draft`` and ``dspark`` the draft
  backends; ``late_layer_tail`` DeepSeek-V4.1's tail; ``refusals`` the refusal table;
* ``factory``: the functions sglang calls (registered by :mod:`dsv4_backend.registration`).

Importing this package or ``factory`` imports neither sglang nor the kernels (the factories
import ``backend`` when called); the other modules but ``plan_session`` import sglang at
import time.
"""
