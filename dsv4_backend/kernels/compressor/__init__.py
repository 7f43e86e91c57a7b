"""Compressor: softmax-gated pooling of tokens into c4 / c128 entries, prefill and decode alike.

docs/design.md §2 (pooling and finish: :mod:`dsv4_backend.ops.compress`). Shapes use
``T`` ragged rows, ``B`` requests, ``D`` the compressed head dim (``config.head_dim`` for a layer,
``index_head_dim`` for the indexer's compressor), ``c`` the overlap (2 for ratio 4, else 1),
``r`` the ratio, ``span`` the tokens per entry (8 for ratio 4, 128 for ratio 128) and ``R``
``ring_rows``.

State: rings of ``R`` rows ``[kv | score + ape]`` (``2 * c * D`` fp32); position ``p`` lives in
ring row ``p % R`` of its ring slot. Like sglang's ``CompressStatePool``, c128 rings are
request-scoped (slot = the request's pool index) and c4 rings are page-scoped (slot = the window
page holding ``p``: ``window_slot(p) // page_size``). A c4 entry reaches at most one block back,
so the state of a page-aligned prefix (its last block, which the write plan always keeps) lives
with the prefix's own window page, where a request that starts from that cached prefix finds it.
One forward:

1. **pool** (reads only): for each compress-plan record ``(ragged_id, batch_id, position p,
   window_len L)`` the entry ending at ``p`` pools the ``span`` tokens ``p - span + 1 ... p``:
   the last ``L`` are this forward's ragged rows ``ragged_id - L + 1 ... ragged_id`` (score plus
   ``ape[q % r]``), the earlier ones come from the ring, and negative positions are missing
   slots (kv 0, score -inf). Ratio 4 slots 0-3 use projection dims ``[:D]``, slots 4-7
   ``[D:]``.
2. **write**: each write-plan record stores its row ``[kv | score + ape]`` at ring row
   ``p % R``. A write that replaces ring state an entry of the same forward still needs (only
   a request's first entries read the ring) happens after that entry is pooled.
3. **finish**: RMSNorm and RoPE at the entry's position ``p + 1 - r``; rows that complete no
   entry are exactly 0.

Positions are int32 (the plans'): every modulo by the runtime ``R`` is taken in int32, which
the GPU computes inline; an int64 one is a subroutine call.

The output is **aligned to rows**: ``entries[i]`` is the entry completed by ragged row ``i``,
zeros where row ``i`` completes none. Nothing reads a tensor value on the host, so a forward
can be captured in a CUDA graph (warm up first: the first call compiles).

Files:

* ``table.py``: the variant table ``COMPRESSOR`` (``DSV4_COMPRESSOR_KERNEL`` names one) and
  the entry point ``compress_forward``, which checks the inputs and runs one of the variants
  below;
* ``fused.py``: ``fused``, the **one-launch** kernel (the interpreter's default; on CUDA named
  or with ``DSV4_UNVERIFIED_KERNELS=1`` until it passes ``scripts/gpu_check.sh``): pool,
  finish, cache store and ring write in one launch;
* ``entries.py``: ``entries``, the kernels it replaces (the CUDA baseline): entries, then ring
  write, then the cache store (3 launches);
* ``torch.py``: ``torch``, the torch path: the same gathers, finished with
  ``ops.compress.finish_entries``;
* ``common.py``: the host-side checks and helpers the paths share; ``device.py``: the
  ``@triton.jit`` helpers both Triton paths inline.
"""
