"""DeepSeek-V4 attention backend for sglang."""
