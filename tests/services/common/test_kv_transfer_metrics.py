"""The P/D transfer counters read 0, not "No data", before anything has failed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pagoda.services.common.kv_transfer_metrics import (FAILURE_REASONS, FALLBACK_KINDS,
                                                        KvTransferMetrics)
from pagoda.services.scheduler.kv_consumer import _REASONS


def test_every_failure_reason_and_fallback_kind_is_exported_at_zero():
    registry = CollectorRegistry()
    KvTransferMetrics(registry)
    text = generate_latest(registry).decode()
    for reason in FAILURE_REASONS:
        assert f'pagoda_kv_transfer_failures_total{{reason="{reason}"}} 0.0' in text
    for kind in FALLBACK_KINDS:
        assert f'pagoda_kv_transfer_fallbacks_total{{kind="{kind}"}} 0.0' in text


def test_the_consumer_counts_only_initialised_reasons():
    """A reason outside the list would appear only after its first failure."""
    assert set(_REASONS.values()) <= set(FAILURE_REASONS)
