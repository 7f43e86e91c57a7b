"""What the tools need to check the runtime, above it: nothing that serves imports this package.

* :mod:`.reference`: the plain float32 torch reference every kernel and serving test compares
  against (independent of the runtime: it imports only ``config`` and ``errors``);
* :mod:`.simulation`: a random-weight model served through the stack, with reference rows;
* :mod:`.harness`: a simulated sglang host (model runner, ``ForwardBatch`` builders, stand-ins
  for the model's modules) driving the sglang adapter;
* :mod:`.interpreter`: the Triton interpreter's patches.

The shipped commands live in ``dsv4_backend/tools/``; helpers only tests use live in
``tests/support/`` (``tests/tool/test_import_graph.py`` holds both rules).
"""
