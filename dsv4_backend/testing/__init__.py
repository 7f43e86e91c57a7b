"""The test oracle and the tools, above the runtime: nothing that serves imports this package.

* :mod:`.reference`: the plain float32 torch reference every kernel and serving test compares
  against (independent of the runtime: it imports only ``config`` and ``errors``);
* :mod:`.simulation`: a paged request pool and a random-weight model served through the stack;
* :mod:`.harness`: a simulated sglang host (model runner, ``ForwardBatch`` builders, stand-ins
  for the model's modules) driving the sglang adapter;
* :mod:`.ab`: the A/B tool (``python -m dsv4_backend ab``);
* :mod:`.op_counter`: counts aten ops and host syncs of a block of code;
* :mod:`.aot_compile`: the kernels compiled ahead of time for sm_90a / sm_100a on the CPU and
  read from their PTX and SASS (:mod:`.sass`), ``python -m dsv4_backend.testing.aot_compile``;
* :mod:`.transfer`, :mod:`.hicache`: sglang's PD transfer and HiCache host tier over a
  ``DeepSeekV4TokenToKVPool``'s regions;
* :mod:`.context_parallel`: prefill context-parallel ranks laid out by sglang's own CP code,
  in one process or over gloo.
"""
