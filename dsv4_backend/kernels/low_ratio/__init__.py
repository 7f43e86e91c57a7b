"""DeepSeek-V4.1's low-ratio compressors and indexer (``torch.py``)."""
