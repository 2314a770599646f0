"""The kv-cache-manager's metrics: the cluster prefix index's size, intake and lookups.

`pagoda_kv_index_blocks{instance_id}`: blocks recorded for each scheduler instance
(the index's size); `pagoda_kv_index_events_total{kind}` and
`pagoda_kv_index_event_batches_total`: what the schedulers published;
`pagoda_kv_index_sequence_gaps_total`: batches that did not follow their
predecessor (events were lost, the index may have drifted);
`pagoda_kv_index_resyncs_total{reason}`: an instance's entries dropped and rebuilt
(reason=restart: it came back with a new epoch; gap: batches were lost and it sent a
snapshot; unknown_instance: the index had forgotten it, e.g. an expired registration
or a flushed Redis); `pagoda_kv_index_instances`: instances with a current heartbeat;
`pagoda_kv_index_dropped_instances_total{reason}`: instances removed from the index
(heartbeat: it lapsed; deregistered: the replica drained); `pagoda_kv_index_apply_seconds`
and `pagoda_kv_index_lookup_seconds`: latency of applying a batch and of a
longest-prefix lookup, Redis included; `pagoda_kv_index_redis_errors_total`.
The event lag (creation to acknowledgement) is measured by the publishing
scheduler: `pagoda_kv_index_event_lag_seconds`.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from pagoda.services.common.metrics_server import one_per_process

EVENT_KINDS = ("stored", "removed", "cleared")
RESYNC_REASONS = ("restart", "gap", "unknown_instance")
DROP_REASONS = ("heartbeat", "deregistered")
LATENCY_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5]


class KvIndexMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.blocks = Gauge("pagoda_kv_index_blocks",
                            "KV blocks the index records for a scheduler instance.",
                            ["instance_id"], registry=registry)
        self.events = Counter("pagoda_kv_index_events", "KV events applied, by kind.", ["kind"],
                              registry=registry)
        self.batches = Counter("pagoda_kv_index_event_batches", "KV event batches applied.",
                               registry=registry)
        self.sequence_gaps = Counter(
            "pagoda_kv_index_sequence_gaps",
            "Batches whose sequence number did not follow the instance's previous one.",
            registry=registry)
        self.resyncs = Counter("pagoda_kv_index_resyncs",
                               "Times an instance's entries were dropped and rebuilt.", ["reason"],
                               registry=registry)
        self.apply_latency = Histogram("pagoda_kv_index_apply_seconds",
                                       "Seconds to apply one KV event batch to Redis.",
                                       buckets=LATENCY_BUCKETS, registry=registry)
        self.lookup_latency = Histogram("pagoda_kv_index_lookup_seconds",
                                        "Seconds to answer one longest-prefix lookup.",
                                        buckets=LATENCY_BUCKETS, registry=registry)
        self.redis_errors = Counter("pagoda_kv_index_redis_errors",
                                    "Redis failures, by operation.", ["operation"],
                                    registry=registry)
        self.instances = Gauge("pagoda_kv_index_instances",
                               "Scheduler instances whose heartbeat is current.",
                               registry=registry)
        self.dropped_instances = Counter(
            "pagoda_kv_index_dropped_instances",
            "Instances removed from the index with all their entries, by reason.", ["reason"],
            registry=registry)
        for reason in DROP_REASONS:
            self.dropped_instances.labels(reason)
        for kind in EVENT_KINDS:
            self.events.labels(kind)
        for reason in RESYNC_REASONS:
            self.resyncs.labels(reason)
        for operation in ("publish", "lookup"):
            self.redis_errors.labels(operation)


@one_per_process
def kv_index_metrics() -> KvIndexMetrics:
    """The process's KvIndexMetrics, in the default registry (created on first use)."""
    return KvIndexMetrics()
