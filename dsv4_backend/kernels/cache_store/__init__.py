"""Cache store: write rows at planned slots (slot -1 = skip) into a token or indexer cache, in
the cache's format (dense, fp8 token or fp8 indexer: ``kernels/device/cache_rows.py``; fp4
index keys, quantised by their cache's rounding: ``kernels/device/fp4.py``).

* ``table.py``: :func:`~dsv4_backend.kernels.cache_store.table.store_rows`, the entry point:
  checks the rows and slots and runs one of the paths below;
* ``triton.py``: one program per row, the row stores of ``kernels/device/cache_rows.py``;
* ``torch.py``: the torch implementation (``Fp8*Layout.pack_tokens``), the same bytes.
"""
