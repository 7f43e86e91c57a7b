"""The shipped commands, above the runtime and the oracle (``dsv4_backend/testing/``), which
they may import: nothing that serves imports this package.

* :mod:`.ab`: the A/B tool (``python -m dsv4_backend ab``);
* :mod:`.gpu_check`, :mod:`.gpu_verdict`: the GPU check (``scripts/gpu_check.sh``) and its
  step-by-step verdict;
* :mod:`.aot_compile`: the kernels compiled ahead of time for sm_90a / sm_100a on the CPU and
  read from their PTX and SASS (:mod:`.sass`), ``python -m dsv4_backend.tools.aot_compile``;
* :mod:`.op_counter`: counts aten ops, launches and host syncs of a block of code (the
  benchmarks, the launch budgets);
* :mod:`.precompile`: cubins for a host whose Triton cannot build a kernel;
* :mod:`.cpu_server`: sglang's own server on the CPU (``python -m dsv4_backend serve``).
"""
