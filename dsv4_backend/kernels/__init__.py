"""The attention kernels, a package per op (docs/kernels.md#the-variant-tables):
``attention/``, ``indexer/``, ``compressor/``, ``cache_store/``. Each holds one file per
variant beside its launcher and the op's torch variant, the op's shared host (``common.py``)
and device (``device.py``) helpers, and ``table.py``: the op's variant table and its entry
point. ``device/`` holds the helpers no variant owns; ``variants.py`` the variant record and
the one rule that chooses; ``dispatch.py`` the path (compiled Triton, interpreter, torch) a
device takes. The planner's kernels are in ``planning/kernels/``."""
