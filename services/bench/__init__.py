"""Benchmarks that start or drive a served cluster: `pagoda bench serve` and `pagoda bench routing`."""
