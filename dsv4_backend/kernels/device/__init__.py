"""Device helpers the kernels share and none of the variants owns: bit-exact FP8 / bf16
conversions and cache-slot loaders (``fp8.py``), the cache row stores every writer inlines
(``cache_rows.py``), and the launcher of kernels precompiled as cubins (``precompiled.py``)."""
