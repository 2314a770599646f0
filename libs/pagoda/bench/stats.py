"""Statistics the benchmarks report, offline (`pagoda bench latency`) and served
(`pagoda bench serve`, `pagoda bench routing`) alike."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The `q`th percentile (0-100) of a non-empty list: linear interpolation between the
    closest ranks, numpy's default and what vLLM's benchmarks report."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
