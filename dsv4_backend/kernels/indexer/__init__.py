"""The lightning indexer (docs/design.md §2): score a row's visible c4 entries and keep the
top-k as c4 cache slots.

* ``table.py``: the variant table ``INDEXER`` (``DSV4_INDEXER_KERNEL`` names one), the entry
  points ``index_scores``, ``select_topk`` and ``run_indexer``; the op's contract.
* ``torch.py``: variant ``torch``, the plain implementation (the torch path).
* ``triton.py``: variant ``triton`` (the CUDA baseline): scores with one program per 64 columns
  of the page table's width; its selection is ``slots.py``'s.
* ``bounded.py``: variant ``bounded``, length-bounded (the interpreter's default, opt-in on
  CUDA): three launches whose work follows each row's own candidate count.
* ``deep_gemm.py``: variant ``deep_gemm``, DeepGEMM's ``fp8_paged_mqa_logits`` (fp8 keys) or
  ``fp8_fp4_paged_mqa_logits`` (fp4 keys) as the scores (first on CUDA once the self-check
  passes it; ``deep_gemm_unsupported_reason`` says where it runs), then ``slots.py``.
* ``slots.py``: the selection of the ``triton`` and ``deep_gemm`` variants: the top-k of the
  whole ``[T, N]`` matrix, then one launch writing the slots.
* ``topk.py``: the top-k columns of a score matrix as its own table ``INDEXER_TOPK``
  (flashinfer's on CUDA, a stable torch sort elsewhere) and ``warm_up_topk``.
* ``common.py``: shared host code: ``C4_ENTRIES_PER_PAGE``, ``BLOCK_N``, the input checks,
  ``entry_slots``, ``select_entries`` (the selection's definition), ``IndexerKernels``.
* ``device.py``: the ``@triton.jit`` helpers both Triton variants use.
* ``fp8.py``: torch helpers of sglang's quantised indexer inputs (``indexer_selection="fp8"``:
  ``hadamard``, ``e4m3_round_trip``, ``quantised_view``).
* ``fp4.py``: sglang's fp4 indexer inputs (``indexer_selection="fp4"``,
  ``--enable-deepseek-v4-fp4-indexer``: ``fp4_key_rows``, ``fp4_query_view``); the keys live in
  fp4 pages (``cache.fp4_format``), which every variant scores.
"""
