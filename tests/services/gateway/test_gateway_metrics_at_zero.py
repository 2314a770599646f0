"""The gateway's counters the dashboards read as rates exist at 0 from start-up (a series
that appears on its first event has no sample before it: its rate misses that event, and
a panel over it reads "No data" until then), and a migration's reason label takes only
the values exported so."""

from __future__ import annotations

import grpc
from prometheus_client import CollectorRegistry, generate_latest

from pagoda.services.common.protocol.scheduler import MIGRATION_REASON_KEY
from pagoda.services.gateway.observability.metrics import (GENERATION_ROUTES, MIGRATION_REASONS,
                                                           GatewayMetrics)
from pagoda.services.gateway.routing.peers import ReplicaLost


def test_migrations_and_5xx_series_are_exported_at_zero():
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    text = generate_latest(registry).decode()
    for reason in MIGRATION_REASONS:
        assert f'pagoda_gateway_migrations_total{{reason="{reason}"}} 0.0' in text
    for route in GENERATION_ROUTES:  # the 5xx ratio's numerator
        assert (f'pagoda_gateway_http_requests_total{{method="POST",route="{route}",'
                f'status="500"}} 0.0') in text


class _Lost(grpc.RpcError):
    def __init__(self, reason: str) -> None:
        self.reason = reason

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "gone"

    def trailing_metadata(self):
        return ((MIGRATION_REASON_KEY, self.reason),)


def test_a_migration_reason_is_one_exported_at_zero():
    for reason in MIGRATION_REASONS:
        assert ReplicaLost.from_rpc_error(_Lost(reason), "a:1").reason == reason
    # A scheduler's unknown word would be a new series on its first use: replica_lost.
    assert ReplicaLost.from_rpc_error(_Lost("cosmic_ray"), "a:1").reason == "replica_lost"


def test_prefill_decode_fallbacks_and_handshake_mismatches_are_exported_at_zero():
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    text = generate_latest(registry).decode()
    for kind in ("no_prefill_replica", "prefill_failed", "media_recompute"):
        assert f'pagoda_gateway_disagg_fallbacks_total{{kind="{kind}"}} 0.0' in text
    for field in ("model", "kv_connector", "block_size", "prefix_hash_seed"):
        assert f'pagoda_gateway_disagg_handshake_mismatches_total{{field="{field}"}} 0.0' in text
