"""The host KV tier's counters (--kv-offloading-size), per tier.

vLLM's OffloadingConnector reports transfers in its own `vllm:kv_offload_*` family
whose per-tier hit counters have no settled name yet, so these are Pagoda's, labelled
by `tier` ("cpu": host memory; "disk": the disk tier below it, whose "offload"
bytes are the blocks the host tier spilled to it):

    pagoda_kv_offload_queries_total    blocks looked up in the tier (device misses)
    pagoda_kv_offload_hits_total       blocks onloaded from it instead of recomputed
    pagoda_kv_offload_bytes_total      bytes copied, direction="offload" | "onload"
    pagoda_kv_offload_evictions_total  blocks the tier dropped to make room (LRU)
    pagoda_kv_offload_onload_wait_seconds  a histogram: how long each request whose
                                       prefix was in a tier waited out of the batch for
                                       its asynchronous onload (no vLLM equivalent)

The onload latency and the failed onloads (hash or checksum: recomputed) are the
worker's (`pagoda_kv_offload_onload_seconds{tier}`,
`pagoda_kv_offload_failed_onloads_total{tier}`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pagoda.core.kv_offload import KVOffloadStats

TIERS = ("cpu", "disk")
ONLOAD_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                       5.0, 10.0)


class KVOffloadMetrics:
    """Counters fed from the scheduler's cumulative `KVOffloadStats` snapshots, one set
    of children per tier."""

    def __init__(self, names: list[str], values: tuple, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, "tier", *extra], registry=registry)

        queries = counter("pagoda_kv_offload_queries", "KV blocks looked up in the offload tier.")
        hits = counter("pagoda_kv_offload_hits", "KV blocks onloaded from the offload tier.")
        evictions = counter("pagoda_kv_offload_evictions",
                            "KV blocks evicted from the offload tier (LRU).")
        moved = counter("pagoda_kv_offload_bytes", "Bytes copied to or from the offload tier.",
                        ("direction",))
        self.onload_wait = Histogram(
            "pagoda_kv_offload_onload_wait_seconds",
            "Seconds a request waited out of the batch for its asynchronous KV onload.",
            names, buckets=ONLOAD_WAIT_BUCKETS, registry=registry).labels(*values)
        self._last_wait = 0
        self._tiers = {}
        for tier in TIERS:
            labels = (*values, tier)
            self._tiers[tier] = _TierCounters(
                queries.labels(*labels), hits.labels(*labels), evictions.labels(*labels),
                moved.labels(*labels, "offload"), moved.labels(*labels, "onload"))

    def record(self, s: KVOffloadStats, tier: str = "cpu") -> None:
        self._tiers[tier].record(s)

    def record_waits(self, waits: tuple[tuple[int, float], ...]) -> None:
        """Observe each wait not seen yet (`SchedulerStats.kv_onload_waits`)."""
        for seq, seconds in waits:
            if seq > self._last_wait:
                self.onload_wait.observe(seconds)
                self._last_wait = seq


class _TierCounters:
    def __init__(self, queries, hits, evictions, offload_bytes, onload_bytes) -> None:
        self.queries, self.hits, self.evictions = queries, hits, evictions
        self.offload_bytes, self.onload_bytes = offload_bytes, onload_bytes
        self._last = KVOffloadStats()

    def record(self, s: KVOffloadStats) -> None:
        last = self._last
        self.queries.inc(max(s.queries - last.queries, 0))
        self.hits.inc(max(s.hits - last.hits, 0))
        self.evictions.inc(max(s.evictions - last.evictions, 0))
        self.offload_bytes.inc(max(s.stored - last.stored, 0) * s.block_bytes)
        self.onload_bytes.inc(max(s.hits - last.hits, 0) * s.block_bytes)
        self._last = s
