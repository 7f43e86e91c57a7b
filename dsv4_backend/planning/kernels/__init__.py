"""The planner's kernels: the fused Triton planner (batch checks and every plan field,
``plan_fields.py``), the row compression fields (``row_fields.py``: Triton and torch) and the
compress / write plans (``compress_plan_tvm.py`` with its shipped CUDA source,
``compress_plan_torch.py``). ``table.py`` declares them as the variants of the plan ops."""
