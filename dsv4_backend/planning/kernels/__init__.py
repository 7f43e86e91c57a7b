"""The planner's kernels: the fused Triton planner (batch checks and every plan field,
``plan_fields.py``), the row compression fields of the torch planner (``row_fields.py``) and the
compress / write plans (``compress_plan_tvm.py`` with its shipped CUDA source,
``compress_plan_torch.py``). ``table.py`` declares the compress plans' variants (the planner's own
are ``planning/planner.py``'s ``PLAN``)."""
