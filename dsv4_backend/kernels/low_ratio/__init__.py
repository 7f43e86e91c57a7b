"""DeepSeek-V4.1's low-ratio compressors and indexer: the variants of its fp4 rows and index
scores (``table.py``: Triton in ``triton.py``, torch in ``torch.py``, which also holds the pair
pooling) and the selection over the scores (``selection.py``)."""
