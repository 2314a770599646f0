"""`pagoda.metrics.reader`: a registry's vLLM series as vLLM's metric objects (the
shapes `LLM.get_metrics()` returns), the per-position counter as a Vector."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter as PromCounter

from pagoda.metrics.engine_metrics import FINISH_REASONS, EngineMetrics, SpecDecodingMetrics
from pagoda.metrics.reader import Counter, Gauge, Histogram, Vector, get_metrics_snapshot


def test_every_vllm_series_comes_back_typed():
    registry = CollectorRegistry()
    metrics = EngineMetrics("tiny", 64, registry=registry)
    PromCounter("other_total_things", "not vLLM's", registry=registry).inc()
    metrics.prompt_tokens.inc(7)
    metrics.num_requests_running.set(2)
    for value in (0.003, 0.03, 3.0):
        metrics.time_to_first_token.observe(value)
    spec = SpecDecodingMetrics(3, registry, ("tiny", "0"))
    for counter, value in zip(spec.accepted_per_pos, (5, 2)):
        counter.inc(value)
    by_name = {}
    for metric in get_metrics_snapshot(registry):
        by_name.setdefault(metric.name, []).append(metric)
    assert all(name.startswith("vllm:") for name in by_name)
    (prompt,) = by_name["vllm:prompt_tokens"]
    assert isinstance(prompt, Counter) and prompt.value == 7
    assert prompt.labels == {"model_name": "tiny", "engine": "0"}
    (running,) = by_name["vllm:num_requests_running"]
    assert isinstance(running, Gauge) and running.value == 2
    (ttft,) = by_name["vllm:time_to_first_token_seconds"]
    assert isinstance(ttft, Histogram) and ttft.count == 3 and abs(ttft.sum - 3.033) < 1e-9
    assert (ttft.buckets["0.005"], ttft.buckets["0.04"], ttft.buckets["+Inf"]) == (1, 2, 3)
    (per_pos,) = by_name["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == [5, 2, 0]
    assert per_pos.labels == {"model_name": "tiny", "engine": "0"}
    assert sorted(m.labels["finished_reason"] for m in by_name["vllm:request_success"]) \
        == sorted(FINISH_REASONS)  # one series per finished_reason
