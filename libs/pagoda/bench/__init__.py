"""Benchmarks of the engine library: `pagoda bench throughput` (offline engine)."""
