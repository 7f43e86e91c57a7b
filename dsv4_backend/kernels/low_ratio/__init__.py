"""DeepSeek-V4.1's low-ratio compressors and indexer: the torch ops (``torch.py``), the index
scores' variants (``table.py``) and the selection over them (``selection.py``)."""
