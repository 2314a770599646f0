"""Prefill/decode transfer metrics, shared by the gpu-worker (what moved) and the
scheduler (leases, failures, fallbacks); the gateway's /metrics merges every
service's, so one scrape shows both sides.

* `pagoda_kv_transfer_blocks_total`, `_bytes_total`, `_seconds`: pulls that
  completed, counted by the worker that pulled (the decode side).
* `pagoda_kv_transfer_failures_total{reason}`: pulls that did not complete
  (`FAILURE_REASONS`).
* `pagoda_kv_transfer_fallbacks_total{kind}`: what the request did instead
  (`FALLBACK_KINDS`; recompute: the decode replica prefilled locally).

Every label value is exported at 0 from the start, so a dashboard panel reads 0, not
"No data", on a cluster that has not failed yet (and a rate over it is defined).
* `pagoda_kv_leased_blocks`: blocks a prefill replica holds for decode replicas now.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from pagoda.services.common.metrics_server import one_per_process

# Every reason a pull can fail for (the scheduler's KV consumer and lease table), and
# every fallback kind: the label values the counters are initialised with.
FAILURE_REASONS = ("timeout", "unavailable", "checksum", "stale_epoch", "lease_expired",
                   "no_room", "hash_mismatch", "kv_reset", "error")
FALLBACK_KINDS = ("recompute",)
# The results of a peer's prefix lease served from the KV tiers (kv_tier_lease.py).
TIER_LEASE_RESULTS = ("leased", "too_few_blocks", "failed")
TRANSFER_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0]


class KvTransferMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.blocks = Counter("pagoda_kv_transfer_blocks_total",
                              "KV blocks pulled from a prefill replica.", registry=registry)
        self.bytes = Counter("pagoda_kv_transfer_bytes_total",
                             "KV bytes pulled from a prefill replica.", registry=registry)
        self.seconds = Histogram("pagoda_kv_transfer_seconds",
                                 "Seconds one request's KV pull took.",
                                 buckets=TRANSFER_BUCKETS, registry=registry)
        self.failures = Counter("pagoda_kv_transfer_failures_total",
                                "KV pulls that did not complete, by reason.", ["reason"],
                                registry=registry)
        self.fallbacks = Counter("pagoda_kv_transfer_fallbacks_total",
                                 "Disaggregated requests served another way, by kind.",
                                 ["kind"], registry=registry)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)
        for kind in FALLBACK_KINDS:
            self.fallbacks.labels(kind)
        # A peer's prefix lease served from this replica's KV tiers (kv_tier_lease.py).
        self.tier_leases = Counter(
            "pagoda_kv_prefix_tier_leases_total",
            "Prefix leases a peer asked of this replica's host/disk KV tiers, by result: "
            "leased (onloaded to the device, then leased), too_few_blocks (the tiers no "
            "longer held enough), failed (the onload request was refused, failed or its "
            "caller gave up).", ["result"], registry=registry)
        self.tier_lease_blocks = Counter(
            "pagoda_kv_prefix_tier_lease_blocks_total",
            "Blocks this replica brought up from its host/disk KV tiers to lease them to a "
            "peer (counted when leased).", registry=registry)
        for result in TIER_LEASE_RESULTS:
            self.tier_leases.labels(result)
        self.leased_blocks = Gauge("pagoda_kv_leased_blocks",
                                   "KV blocks held under leases for decode replicas.",
                                   registry=registry)


@one_per_process
def kv_transfer_metrics() -> KvTransferMetrics:
    """The process's KvTransferMetrics, in the default registry (created on first use)."""
    return KvTransferMetrics()
