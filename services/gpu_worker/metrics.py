"""The gpu-worker's metrics: how long each step's forward pass and sampling take.

`pagoda_worker_execute_model_seconds`: one `ExecuteModel` (the model runner's
step: inputs, forward, sampling), without the network; the scheduler's step
time minus this is the plan's round trip and (de)serialization.

`pagoda_worker_group_rebuilds_total`: how often this worker's TP/PP group was torn
down and built again after a rank died or failed a step (executor/group.py; vLLM
has no such metric). It moving at all is worth a look; a crash loop ends the worker.

`pagoda_kv_offload_onload_seconds{tier}`: one step's copies from a KV tier into the
device cache (--kv-offloading-size: tier="cpu"; --kv-offloading-disk-path: "disk",
the file reads included), checksums included; observed for each step that onloads
from that tier. `pagoda_kv_offload_failed_onloads_total{tier}`: blocks whose copy
failed its hash or checksum (or, on disk, was missing or foreign), recomputed instead
(the answer is the same).
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
        self.onload_seconds = Histogram("pagoda_kv_offload_onload_seconds",
                                        "Seconds one step spent onloading KV blocks from a "
                                        "tier.", ["tier"], buckets=STEP_BUCKETS,
                                        registry=registry)
        self.failed_onloads = Counter("pagoda_kv_offload_failed_onloads",
                                      "KV blocks whose tier copy failed its checks and were "
                                      "recomputed.", ["tier"], registry=registry)
        self._last = {"cpu": (0, 0.0, 0), "disk": (0, 0.0, 0)}
        for tier in self._last:  # exported at 0 from start-up: a rate has a baseline
            self.failed_onloads.labels(tier)

    def observe_host_tier(self, tier) -> None:
        """After a step: the host tier's onloads of that step (`HostKVTier.stats`)."""
        if tier is None:
            return
        s = tier.stats
        self._observe("cpu", (s.onloaded_blocks, s.onload_seconds, s.failed_onloads))
        if tier.disk is not None:
            d = tier.disk.stats
            self._observe("disk", (d.read_blocks, d.read_seconds, d.failed_reads))

    def _observe(self, name: str, now: tuple[int, float, int]) -> None:
        blocks, seconds, failed = self._last[name]
        if now[0] + now[2] > blocks + failed:
            self.onload_seconds.labels(name).observe(now[1] - seconds)
        if now[2] > failed:
            self.failed_onloads.labels(name).inc(now[2] - failed)
        self._last[name] = now


@one_per_process
def worker_metrics() -> WorkerMetrics:
    """The process's WorkerMetrics, in the default registry (created on first use)."""
    return WorkerMetrics()
