"""The gpu-worker's metrics: how long each step's forward pass and sampling take.

`pagoda_worker_execute_model_seconds`: one `ExecuteModel` (the model runner's
step: inputs, forward, sampling), without the network; the scheduler's step
time minus this is the plan's round trip and (de)serialization.

`pagoda_worker_group_rebuilds_total`: how often this worker's TP/PP group was torn
down and built again after a rank died or failed a step (executor/group.py; vLLM
has no such metric). It moving at all is worth a look; a crash loop ends the worker.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from pagoda.services.common.metrics_server import one_per_process

STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0]


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.execute_model = Histogram("pagoda_worker_execute_model_seconds",
                                       "Seconds the model runner spent on one step.",
                                       buckets=STEP_BUCKETS, registry=registry)
        self.group_rebuilds = Counter("pagoda_worker_group_rebuilds",
                                      "Times the worker group was rebuilt after a rank "
                                      "failed.", registry=registry)


@one_per_process
def worker_metrics() -> WorkerMetrics:
    """The process's WorkerMetrics, in the default registry (created on first use)."""
    return WorkerMetrics()
