"""Small helpers shared by tests, benchmarks and tools."""
