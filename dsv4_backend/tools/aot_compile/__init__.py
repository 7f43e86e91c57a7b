"""Compile the Triton and Gluon kernels ahead of time for sm_90a (Hopper: H100 / H200) and
sm_100a (Blackwell: B200 / B300 / GB200 / GB300) on the CPU, and read the compiled code.

    python -m dsv4_backend.tools.aot_compile [--target sm_90a] [--target sm_100a] [NAME ...]

No GPU is needed: Triton's backend for the target and its bundled ptxas and cuobjdump do the
work. The compile tests (``tests/compiled/``) run it in a subprocess, because their session's
``TRITON_INTERPRET=1`` turns every ``@triton.jit`` function into an interpreted one;
``benchmarks/sass_report.py`` prints its reports as a table.

* :mod:`.configurations`: every launch the backend makes at DeepSeek-V4-Flash shapes, with the
  block sizes and warps its launchers pick: the default Triton kernels (sparse attention, its
  merge and key union, the indexer, compressor and planner kernels) and the opt-in attention
  kernels (``pipelined``, and the Gluon ``ws`` kernels, each for its own architecture);
* :mod:`.toolchain`: the compile and the figures of one configuration (``compile_report``):
  PTX matrix instructions and their shapes, ``ptxas -v``'s registers, spills and stack,
  asynchronous copies, shared memory, SASS instruction facts;
* :mod:`.roofline`: the SASS main loop read for a roofline model (``kernel_report``:
  instructions a key against the HBM share, warp-specialised partitions, the criteria each
  kernel claims in :data:`.roofline.SPECS`).

The command prints one JSON object (``kernel_report``) per configuration and target: every
configuration for each of its targets by default; ``--target`` (repeatable) keeps those,
``NAME`` substrings select configurations, ``TARGET:NAME`` for one target only.
"""

import os

# Set before any submodule imports triton: the interpreter would turn the kernels into
# interpreted functions, which do not compile.
os.environ["TRITON_INTERPRET"] = "0"
