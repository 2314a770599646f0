"""Benchmarks: `pagoda bench throughput` (offline engine) and `pagoda bench serve`."""
