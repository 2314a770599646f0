"""vLLM's metric names, labels and buckets; the timings behind them; the stats line;
merging several processes' /metrics into one."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, SchedulerOutput
from pagoda.core.scheduler import SchedulerStats
from pagoda.metrics.aggregate import render
from pagoda.metrics.engine_metrics import EngineMetrics, build_1_2_5_buckets
from pagoda.metrics.stat_logger import StatLogger
from pagoda.metrics.stats import RequestStatsTracker
from pagoda.sampling_params import SamplingParams

# The names vLLM exposes, as a scrape shows them (counters with `_total`).
VLLM_SAMPLES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:iteration_tokens_total_bucket",
    "vllm:cache_config_info",
}


def _samples(registry) -> list:
    return [s for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples]


def _request(rid: str, arrival: float, prompt_len: int = 5) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(range(prompt_len)), SamplingParams(max_tokens=3),
                             arrival_time=arrival)


def _plan(*rids: str, tokens: int = 1, preempted=()) -> SchedulerOutput:
    out = SchedulerOutput.empty()
    out.num_scheduled_tokens = {r: tokens for r in rids}
    out.total_num_scheduled_tokens = tokens * len(rids)
    out.preempted_req_ids = set(preempted)
    return out


def test_metrics_have_vllms_names_labels_and_buckets():
    registry = CollectorRegistry()
    metrics = EngineMetrics("tiny", 1024, registry=registry)
    metrics.log_cache_config(16, 4096, True, 0.9)
    samples = _samples(registry)
    assert VLLM_SAMPLES <= {s.name for s in samples}
    for s in samples:
        if s.name.startswith("vllm:"):
            assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0", s
    reasons = {s.labels["finished_reason"] for s in samples
               if s.name == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "repetition"}
    info = next(s for s in samples if s.name == "vllm:cache_config_info")
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"], info.value) == \
        ("16", "4096", 1.0)

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in samples if s.name == f"{name}_bucket"][:-1]
    assert bounds("vllm:time_to_first_token_seconds")[:3] == [0.001, 0.005, 0.01]
    assert bounds("vllm:time_to_first_token_seconds")[-1] == 2560.0
    assert bounds("vllm:inter_token_latency_seconds")[-1] == 80.0
    assert bounds("vllm:e2e_request_latency_seconds")[:2] == [0.3, 0.5]
    assert bounds("vllm:iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024,
                                                     2048, 4096, 8192, 16384]
    assert bounds("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_tracker_times_each_phase_from_the_engines_steps():
    tracker = RequestStatsTracker()
    tracker.add_request(_request("a", arrival=0.0), queued_ts=1.0)
    idle = tracker.on_step(1.5, 1.6, None, [])
    assert idle.num_scheduled_tokens == 0 and not idle.finished_requests
    first = tracker.on_step(2.0, 3.0, _plan("a", tokens=5),
                            [EngineCoreOutput("a", [7])])  # prefill -> first token at 3
    assert (first.num_prompt_tokens, first.num_generation_tokens) == (5, 1)
    assert first.time_to_first_tokens_iter == [3.0] and first.num_scheduled_tokens == 5
    second = tracker.on_step(3.0, 4.5, _plan("a"), [EngineCoreOutput("a", [8])])
    assert second.inter_token_latencies_iter == [1.5] and second.num_prompt_tokens == 0
    last = tracker.on_step(4.5, 5.0, _plan("a"), [
        EngineCoreOutput("a", [9], finish_reason=FinishReason.LENGTH)])
    (done,) = last.finished_requests
    assert (done.finish_reason, done.num_prompt_tokens, done.num_generation_tokens) == \
        ("length", 5, 3)
    assert (done.e2e_latency, done.queued_time, done.prefill_time, done.decode_time,
            done.inference_time) == (5.0, 1.0, 1.0, 2.0, 3.0)
    assert tracker.num_tracked == 0


def test_a_request_aborted_while_waiting_finishes_with_zero_length_phases():
    tracker = RequestStatsTracker()
    tracker.add_request(_request("w", arrival=0.0), queued_ts=0.5)
    stats = tracker.on_step(2.0, 2.0, None,
                            [EngineCoreOutput("w", [], finish_reason=FinishReason.ABORT)])
    (done,) = stats.finished_requests
    assert done.finish_reason == "abort" and done.num_generation_tokens == 0
    assert (done.queued_time, done.prefill_time, done.decode_time) == (1.5, 0.0, 0.0)
    assert not stats.time_to_first_tokens_iter


def test_a_preemption_counts_but_does_not_move_the_first_schedule():
    tracker = RequestStatsTracker()
    tracker.add_request(_request("p", arrival=0.0), queued_ts=0.0)
    tracker.on_step(1.0, 1.5, _plan("p", tokens=2), [])  # a partial prefill: no token yet
    preempt = tracker.on_step(2.0, 2.5, _plan(preempted=["p"]), [])
    assert preempt.num_preempted_reqs == 1
    tracker.on_step(3.0, 3.5, _plan("p", tokens=5), [EngineCoreOutput("p", [1])])
    end = tracker.on_step(4.0, 4.0, _plan("p"), [
        EngineCoreOutput("p", [2], finish_reason=FinishReason.STOP)])
    assert end.finished_requests[0].queued_time == 1.0  # first scheduled at 1.0


def test_each_request_is_first_scheduled_when_its_own_first_plan_ran():
    """The tracker looks up only the requests not scheduled yet, walking whichever of
    them and the plan is smaller: both ways give each its own first plan's start."""
    tracker = RequestStatsTracker()
    for rid in "abcde":
        tracker.add_request(_request(rid, arrival=0.0), queued_ts=0.0)
    tracker.on_step(1.0, 1.1, _plan("a", "b"), [])  # 5 unscheduled, a plan of 2
    tracker.on_step(2.0, 2.1, _plan("a", "b", "c"), [])  # 3 unscheduled, a plan of 3
    tracker.on_step(3.0, 3.1, _plan("a", "b", "c", "d", "e"), [])  # 2, a plan of 5
    end = tracker.on_step(4.0, 4.0, _plan(*"abcde"), [
        EngineCoreOutput(rid, [1], finish_reason=FinishReason.LENGTH) for rid in "abcde"])
    queued = {r.request_id: r.queued_time for r in end.finished_requests}
    assert queued == {"a": 1.0, "b": 1.0, "c": 2.0, "d": 3.0, "e": 3.0}
    assert end.num_generation_tokens == 5 and tracker.num_tracked == 0


def test_record_turns_cumulative_core_counters_into_increments():
    registry = CollectorRegistry()
    metrics = EngineMetrics("m", 64, registry=registry)
    for queries, hits in ((10, 4), (10, 4), (30, 9)):
        metrics.record(SchedulerStats(2, 1, 0.25, queries, hits, 0, 100, 75), None)
    values = {s.name: s.value for s in _samples(registry)}
    assert values["vllm:prefix_cache_queries_total"] == 30
    assert values["vllm:prefix_cache_hits_total"] == 9
    assert (values["vllm:num_requests_running"], values["vllm:num_requests_waiting"],
            values["vllm:kv_cache_usage_perc"]) == (2, 1, 0.25)


def test_stats_line_is_vllms_and_covers_the_interval(caplog):
    stat_logger = StatLogger()
    stats = RequestStatsTracker().on_step(0, 0, None, [])
    stats.num_prompt_tokens, stats.num_generation_tokens = 100, 20
    stat_logger.record(SchedulerStats(3, 1, 0.5, 40, 10, 0, 10, 5), stats)
    with caplog.at_level(logging.DEBUG, logger="pagoda.metrics"):
        line = stat_logger.log(now=stat_logger._last_log_time + 10.0)
        assert line == ("Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation "
                        "throughput: 2.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, GPU KV "
                        "cache usage: 50.0%, Prefix cache hit rate: 25.0%")
        stat_logger.record(SchedulerStats(0, 0, 0.0, 40, 10, 0, 10, 10), None)
        idle = stat_logger.log(now=stat_logger._last_log_time + 10.0)
        stat_logger.log(now=stat_logger._last_log_time + 10.0)
    assert "Avg generation throughput: 0.0 tokens/s" in idle and "hit rate: 0.0%" in idle
    # Busy and the first idle line after it at INFO; later idle lines only at DEBUG.
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.DEBUG]


def test_merged_exposition_keeps_every_source_apart_in_one_family():
    a, b = CollectorRegistry(), CollectorRegistry()
    EngineMetrics("m", 64, registry=a).generation_tokens.inc(3)
    EngineMetrics("m", 64, registry=b).generation_tokens.inc(5)
    text = render([({}, generate_latest(a).decode()),
                   ({"instance": "10.0.0.2:9090"}, generate_latest(b).decode())]).decode()
    type_lines = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(type_lines) == len(set(type_lines))  # Prometheus rejects a repeated TYPE
    values = {frozenset(s.labels.items()): s.value
              for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "vllm:generation_tokens_total"}
    base = {("model_name", "m"), ("engine", "0")}
    assert values == {frozenset(base): 3.0,
                      frozenset(base | {("instance", "10.0.0.2:9090")}): 5.0}


@pytest.mark.parametrize("max_model_len", [1, 7, 2048])
def test_token_buckets_never_exceed_the_context(max_model_len):
    buckets = build_1_2_5_buckets(max_model_len)
    assert buckets[0] == 1 and buckets[-1] <= max_model_len < buckets[-1] * 2.5
