"""Benchmarks of the engine library: `pagoda bench throughput` and `pagoda bench latency`
(the offline engine), and `stats.percentile`, which the served benchmarks report too."""
