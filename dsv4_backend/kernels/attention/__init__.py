"""Sparse attention with a per-head sink over window keys plus compressed keys (docs/design.md
§2, docs/kernels.md), one file per variant:

* ``table.py``: the variant table ``ATTENTION`` (``kernels/variants.py``;
  ``DSV4_ATTENTION_KERNEL`` names one) and the op's entry point ``sparse_attention_with_sink``;
* ``torch.py``: ``torch``, the plain implementation (gather, one masked softmax), the torch
  path;
* ``triton.py``: ``triton``, the CUDA baseline Triton kernel after FlashMLA's sparse decode (heads,
  or a request's rows, on the MMA M side; in-kernel fp8 dequantisation; split-K and a merge
  kernel), with its design notes;
* ``pipelined.py``: ``pipelined``, opt-in plain-Triton fp8 kernel with the gathers in flight
  (``cp.async``), no empty splits and the merge in the last split;
* ``ws.py``: ``ws``, opt-in warp-specialised Gluon kernel (Hopper); its Blackwell kernel is
  ``ws_sm100.py`` (tcgen05), their shared producer and merge ``ws_parts.py``;
* ``flashmla.py``: ``flashmla``, FlashMLA's sparse fp8 decode (the ``flash_mla`` package);
* ``flashmla_prefill.py``: ``flashmla_prefill``, FlashMLA's sparse prefill over a bf16 gather
  of the keys; ``flashmla_library.py``: the library contract both FlashMLA variants share;
* ``key_union.py``: the union key list of a group of rows, which the variants that group rows
  walk (``triton``, ``pipelined``), built in one launch before the attention launch (its own
  two-variant table, ``KEY_UNION``);
* ``common.py``: host-side helpers the variants and callers share (input checks, key-split
  counts, row groups, key spans, output dtype and tolerance, fp8 kernels' requirements);
* ``device.py``: ``@triton.jit`` helpers the variants share (``LOG2E``, the e4m3 rebias, the
  deal of key blocks to splits).
"""
