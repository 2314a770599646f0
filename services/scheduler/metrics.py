"""The scheduler service's metrics: vLLM's engine metrics, the stats log line, and
its KV-event publisher's lag (`pagoda_kv_index_*`).

The engine thread feeds `SchedulerStatsRecorder` after every add and step
(engine_loop.py); it records vLLM's metrics before the step's outputs are
dispatched, so a client that got its last token finds it counted on the next
scrape. All of it lands in the process registry served on `--metrics-port`.
"""

from __future__ import annotations

import argparse

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from pagoda.metrics.engine_metrics import EngineMetrics
from pagoda.metrics.recorder import EngineStatsRecorder
from pagoda.metrics.stat_logger import PeriodicLogger, StatLogger, log_stats_interval
from pagoda.metrics.stats import IterationStats
from pagoda.services.scheduler.tracing import record_phases

# From an event's creation to its batch being acknowledged: milliseconds to minutes.
EVENT_LAG_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class SchedulerStatsRecorder(EngineStatsRecorder):
    """vLLM's metrics and stats line, plus the phase spans of finished requests."""

    def on_step(self, core, step_start, outputs, scheduler_stats=None) -> IterationStats:
        iteration = super().on_step(core, step_start, outputs, scheduler_stats)
        if iteration.finished_requests:
            record_phases(iteration.finished_requests)
        return iteration


def build_recorder(config, args: argparse.Namespace, registry: CollectorRegistry = REGISTRY
                   ) -> tuple[SchedulerStatsRecorder, PeriodicLogger | None]:
    """The recorder for this replica's engine core, and the started stats-line thread
    (None when `--log-stats-interval 0` or `--disable-log-stats`)."""
    metrics = EngineMetrics(config.served_model_name[0], config.scheduler.max_model_len,
                            registry=registry)
    metrics.log_cache_config(config.cache.block_size, config.cache.num_blocks,
                             config.cache.enable_prefix_caching,
                             config.cache.gpu_memory_utilization)
    if config.lora is not None:
        metrics.log_lora_config(config.lora.max_loras)
    if config.scheduler.speculative_config is not None:
        metrics.log_spec_config(config.scheduler.speculative_config.num_speculative_tokens)
    interval = log_stats_interval(args)
    stat_logger = StatLogger() if interval > 0 else None
    periodic = PeriodicLogger(stat_logger, interval).start() if stat_logger else None
    return SchedulerStatsRecorder(metrics, stat_logger), periodic


class KvPublisherMetrics:
    """How far the cluster prefix index lags behind this replica's cache."""

    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.event_lag = Histogram(
            "pagoda_kv_index_event_lag_seconds",
            "Seconds from a KV event's creation in the scheduler to the kv-cache-manager "
            "acknowledging the batch that carries it (the oldest event of each batch).",
            ["model_name"], buckets=EVENT_LAG_BUCKETS, registry=registry).labels(model_name)
        self.dropped_batches = Counter(
            "pagoda_kv_index_dropped_batches",
            "KV event batches the kv-cache-manager did not acknowledge (the index misses them).",
            ["model_name"], registry=registry).labels(model_name)
        self.published_events = Counter(
            "pagoda_kv_index_published_events", "KV events published to the kv-cache-manager.",
            ["model_name"], registry=registry).labels(model_name)
