"""The endpoint picker's /metrics, with the Gateway API Inference Extension's EPP
metric names (GIE v1 `site-src/guides/metrics-and-observability`): per objective
(`model_name` as the request named it, `target_model_name` the model it runs as) the
requests, errors (GIE's error codes) and durations, and the running requests; per pool
(`name`) the ready pods and the average KV utilisation and queue, read at scrape time
from the replicas' last GetLoad. A registry of its own: nothing else in the process
publishes into it.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

# GIE's error codes for inference_objective_request_error_total{error_code}.
ERROR_CODES = {400: "BadRequest", 429: "InferencePoolResourceExhausted",
               503: "ServiceUnavailable", 500: "Internal"}
DURATION_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class EppMetrics:
    def __init__(self, pool_name: str, replicas: Callable[[], list],
                 endpoint: Callable[[object], str]) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "target_model_name"]
        self.requests = Counter("inference_objective_request_total",
                                "Counter of inference objective requests broken out for each "
                                "model and target model.", labels, registry=self.registry)
        self.errors = Counter("inference_objective_request_error_total",
                              "Counter of inference objective requests errors broken out for "
                              "each model and target model.", [*labels, "error_code"],
                              registry=self.registry)
        self.duration = Histogram("inference_objective_request_duration_seconds",
                                  "Inference objective response latency distribution in "
                                  "seconds for each model and target model.", labels,
                                  buckets=DURATION_BUCKETS, registry=self.registry)
        self.running = Gauge("inference_objective_running_requests",
                             "Inference objective number of running requests in each model.",
                             ["model_name"], registry=self.registry)
        self.registry.register(_PoolCollector(pool_name, replicas, endpoint))

    def error(self, model: str, target: str, status: int) -> None:
        self.errors.labels(model, target, ERROR_CODES.get(status, "Internal")).inc()


class _PoolCollector:
    """inference_pool_* gauges from the replicas' last reported load."""

    def __init__(self, pool: str, replicas: Callable[[], list],
                 endpoint: Callable[[object], str]) -> None:
        self.pool = pool
        self.replicas = replicas
        self.endpoint = endpoint

    def collect(self):
        ready = self.replicas()
        loads = [r.load for r in ready if r.load is not None]
        kv = GaugeMetricFamily("inference_pool_average_kv_cache_utilization",
                               "The average kv cache utilization for an inference server pool.",
                               labels=["name"])
        queue = GaugeMetricFamily("inference_pool_average_queue_size",
                                  "The average number of requests pending in the model server "
                                  "queue.", labels=["name"])
        pods = GaugeMetricFamily("inference_pool_ready_pods",
                                 "The number of ready pods in the inference server pool.",
                                 labels=["name"])
        per_pod = GaugeMetricFamily("inference_pool_per_pod_queue_size",
                                    "The total number of queue for each model server pod under "
                                    "the inference pool", labels=["model_server_pod", "name"])
        n = len(loads)
        kv.add_metric([self.pool], sum(l.kv_cache_usage for l in loads) / n if n else 0.0)
        queue.add_metric([self.pool], sum(l.num_waiting for l in loads) / n if n else 0.0)
        pods.add_metric([self.pool], len(ready))
        for r in ready:
            per_pod.add_metric([self.endpoint(r), self.pool], r.load.num_waiting if r.load else 0)
        return [kv, queue, pods, per_pod]

    def describe(self):
        return []
