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


_MEDIA_INPUT_BYTES: list[Counter] = []  # the process's one counter, made on first use


def media_input_bytes() -> Counter:
    """pagoda_mm_input_bytes_total: the bytes of media encoder input (pixel or embedding
    tensors) this replica's requests brought. A P/D decode replica's stays at 0 while the
    prefill's leases cover the images' runs: the prefill side encodes them."""
    if not _MEDIA_INPUT_BYTES:
        _MEDIA_INPUT_BYTES.append(Counter(
            "pagoda_mm_input_bytes", "Bytes of media encoder input (pixel or embedding "
            "tensors) received with this replica's requests."))
    return _MEDIA_INPUT_BYTES[0]


def count_media_input(request) -> None:
    """Add the encoder input bytes of `request`'s media items (those sent with data)."""
    total = sum(t.nbytes for f in request.mm_features if f.data is not None
                for t in f.data.values())
    if total:
        media_input_bytes().inc(total)


def build_recorder(config, args: argparse.Namespace, registry: CollectorRegistry = REGISTRY
                   ) -> tuple[SchedulerStatsRecorder, PeriodicLogger | None]:
    """The recorder for this replica's engine core, and the started stats-line thread
    (None when `--log-stats-interval 0` or `--disable-log-stats`)."""
    metrics = EngineMetrics(config.served_model_name[0], config.scheduler.max_model_len,
                            registry=registry)
    if config.multimodal is not None and registry is REGISTRY:
        media_input_bytes()  # exported at 0 from start-up
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
