"""The engine's Prometheus metrics, named, labelled and bucketed exactly as vLLM's.

Existing vLLM dashboards, KEDA triggers and llm-d's endpoint picker read these
names, so they are a contract: `vllm:` prefix, `model_name` and `engine` labels,
vLLM's bucket boundaries. (prometheus_client appends `_total` to counters, so
`vllm:prompt_tokens` is exposed as `vllm:prompt_tokens_total`, as in vLLM.)

One `EngineMetrics` per engine core; pass a fresh `CollectorRegistry` to keep
several in one process (tests), or leave the process-wide default registry,
which the service's `/metrics` endpoint serves.
"""

from __future__ import annotations

from collections import Counter as Multiset

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from pagoda.core.scheduler import SchedulerStats
from pagoda.metrics.kv_offload_metrics import KVOffloadMetrics
from pagoda.metrics.stats import IterationStats

FINISH_REASONS = ("stop", "length", "abort", "repetition")  # vLLM's, less "error"
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class EngineMetrics:
    """Records `SchedulerStats` snapshots and `IterationStats` as vLLM's metrics.

    Invariant: counters only move by what the engine did since the previous
    `record` (cumulative core counters are turned into increments here).
    """

    def __init__(self, model_name: str, max_model_len: int, engine: str = "0",
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.model_name = model_name
        self.engine = engine
        self._registry = registry
        names, values = ["model_name", "engine"], (model_name, engine)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(*values)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets,
                             registry=registry).labels(*values)

        self.num_requests_running = gauge("vllm:num_requests_running",
                                          "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting",
                                          "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # The worker's encoder cache (multi-modal models): media items looked up where a
        # step first needs their encoder rows, and those found (vLLM has no such series).
        self.encoder_cache_queries = counter(
            "pagoda_encoder_cache_queries",
            "Encoder cache lookups of media items (once per request and item).")
        self.encoder_cache_hits = counter(
            "pagoda_encoder_cache_hits",
            "Encoder cache lookups that found the item's encoder output.")
        self.num_preemptions = counter("vllm:num_preemptions",
                                       "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=registry)
        self.request_success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKENS_BUCKETS)
        self._init_latency_histograms(histogram)
        self._last_queries = self._last_hits = 0
        self._last_encoder = (0, 0)
        self._kv_offload = KVOffloadMetrics(names, values, registry)
        self._lora_info: Gauge | None = None  # log_lora_config, under --enable-lora
        self._spec: SpecDecodingMetrics | None = None  # log_spec_config

    def _init_latency_histograms(self, histogram) -> None:
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS)
        phases = [("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
                  ("request_queue_time_seconds",
                   "Histogram of time spent in WAITING phase for request."),
                  ("request_inference_time_seconds",
                   "Histogram of time spent in RUNNING phase for request."),
                  ("request_prefill_time_seconds",
                   "Histogram of time spent in PREFILL phase for request."),
                  ("request_decode_time_seconds",
                   "Histogram of time spent in DECODE phase for request.")]
        (self.e2e_request_latency, self.request_queue_time, self.request_inference_time,
         self.request_prefill_time, self.request_decode_time) = (
            histogram(f"vllm:{name}", doc, REQUEST_LATENCY_BUCKETS) for name, doc in phases)

    def log_cache_config(self, block_size: int, num_gpu_blocks: int,
                         enable_prefix_caching: bool, gpu_memory_utilization: float) -> None:
        """`vllm:cache_config_info`: an info-style gauge fixed at 1 (as vLLM emulates Info)."""
        info = {"block_size": str(block_size), "num_gpu_blocks": str(num_gpu_blocks),
                "enable_prefix_caching": str(enable_prefix_caching),
                "gpu_memory_utilization": str(gpu_memory_utilization), "cache_dtype": "auto",
                "model_name": self.model_name, "engine": self.engine}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=self._registry).labels(**info).set(1)

    def log_lora_config(self, max_loras: int) -> None:
        """Under --enable-lora: vLLM's `vllm:lora_requests_info`, one series whose labels
        name the adapters of the running and waiting requests (comma-separated) and
        whose value is when they were seen (Unix seconds). Only the current series is
        kept: a dashboard reads the adapters in use now without aggregating history."""
        self._lora_info = Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self._registry)
        self._max_loras = str(max_loras)
        self._lora_labels: tuple[str, str, str] | None = None

    def log_spec_config(self, num_speculative_tokens: int) -> None:
        """Under --speculative-config: vLLM's `vllm:spec_decode_*` counters."""
        self._spec = SpecDecodingMetrics(num_speculative_tokens, self._registry,
                                         (self.model_name, self.engine))

    def _record_lora(self, s: SchedulerStats) -> None:
        labels = (self._max_loras, ",".join(s.waiting_lora_adapters),
                  ",".join(s.running_lora_adapters))
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self._lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
        self._lora_info.labels(*labels).set_to_current_time()

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)

    def _record_scheduler(self, s: SchedulerStats) -> None:
        self.num_requests_running.set(s.num_running)
        self.num_requests_waiting.set(s.num_waiting)
        self.kv_cache_usage.set(s.kv_cache_usage)
        self.prefix_cache_queries.inc(max(s.prefix_cache_queries - self._last_queries, 0))
        self.prefix_cache_hits.inc(max(s.prefix_cache_hits - self._last_hits, 0))
        self._last_queries, self._last_hits = s.prefix_cache_queries, s.prefix_cache_hits
        q, h = self._last_encoder
        self.encoder_cache_queries.inc(max(s.encoder_cache_queries - q, 0))
        self.encoder_cache_hits.inc(max(s.encoder_cache_hits - h, 0))
        self._last_encoder = (s.encoder_cache_queries, s.encoder_cache_hits)
        if self._lora_info is not None:
            self._record_lora(s)
        if self._spec is not None and s.spec_decoding is not None:
            self._spec.record(s.spec_decoding)
        if s.kv_offload is not None:
            self._kv_offload.record(s.kv_offload, "cpu")
        if s.kv_offload_disk is not None:
            self._kv_offload.record(s.kv_offload_disk, "disk")
        if s.kv_onload_waits:
            self._kv_offload.record_waits(s.kv_onload_waits)

    def _record_iteration(self, it: IterationStats) -> None:
        if it.num_preempted_reqs:
            self.num_preemptions.inc(it.num_preempted_reqs)
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_scheduled_tokens:
            self.iteration_tokens.observe(it.num_scheduled_tokens)
        for ttft in it.time_to_first_tokens_iter:
            self.time_to_first_token.observe(ttft)
        observe_all(self.inter_token_latency, it.inter_token_latencies_iter)
        for req in it.finished_requests:
            self.request_success[req.finish_reason].inc()
            self.e2e_request_latency.observe(req.e2e_latency)
            self.request_queue_time.observe(req.queued_time)
            self.request_prefill_time.observe(req.prefill_time)
            self.request_inference_time.observe(req.inference_time)
            self.request_decode_time.observe(req.decode_time)
            self.request_prompt_tokens.observe(req.num_prompt_tokens)
            self.request_generation_tokens.observe(req.num_generation_tokens)
            if req.max_tokens_param:
                self.request_params_max_tokens.observe(req.max_tokens_param)


class SpecDecodingMetrics:
    """vLLM's speculative-decoding counters; the scheduler's cumulative
    `SpecDecodingStats` become increments here. Acceptance rate in PromQL:
    rate(vllm:spec_decode_num_accepted_tokens_total) / rate(..._num_draft_tokens_total);
    mean acceptance length: 1 + accepted / drafts."""

    def __init__(self, num_speculative_tokens: int, registry: CollectorRegistry,
                 values: tuple[str, str]) -> None:
        names = ["model_name", "engine"]
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                  names, registry=registry).labels(*values)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                        names, registry=registry).labels(*values)
        self.num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens",
                                           "Number of accepted tokens.", names,
                                           registry=registry).labels(*values)
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted tokens per draft position.", names + ["position"],
                          registry=registry)
        self.accepted_per_pos = [per_pos.labels(*values, str(i))
                                 for i in range(num_speculative_tokens)]
        self._last = (0, 0, 0, [0] * num_speculative_tokens)

    def record(self, stats) -> None:
        drafts, tokens, accepted, per_pos = self._last
        self.num_drafts.inc(max(stats.num_drafts - drafts, 0))
        self.num_draft_tokens.inc(max(stats.num_draft_tokens - tokens, 0))
        self.num_accepted_tokens.inc(max(stats.num_accepted_tokens - accepted, 0))
        for counter, now, before in zip(self.accepted_per_pos, stats.accepted_per_pos, per_pos):
            counter.inc(max(now - before, 0))
        self._last = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                      list(stats.accepted_per_pos))


def observe_all(histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for each of `values`, equal values at once.

    A decode step's inter-token latencies are mostly one value (every request in the
    batch got its previous token in the same step), and an observe per request per
    step was a tenth of the scheduler's CPU at batch 256. The counts are the same;
    the sum is added as value x count rather than count times (float rounding only).
    """
    if len(values) < 2:
        for value in values:
            histogram.observe(value)
        return
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    total = getattr(histogram, "_sum", None)
    if buckets is None or bounds is None or total is None:  # another prometheus_client
        for value in values:
            histogram.observe(value)
        return
    for value, count in Multiset(values).items():
        if count == 1:
            histogram.observe(value)
            continue
        total.inc(value * count)
        for bucket, bound in zip(buckets, bounds):
            if value <= bound:
                bucket.inc(count)
                break
