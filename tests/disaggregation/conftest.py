"""Fixtures for the disaggregation tests (the cluster helpers live in pd_cluster.py: a
`conftest` module name is ambiguous when several folders' conftests are on sys.path)."""

from __future__ import annotations

import pytest
from observability.obs_harness import OtlpCollector
from pd_cluster import start_pd
from shared_clusters import running, shared_cluster

from pagoda.services.common.redis_server import PrivateRedis


@pytest.fixture(scope="module")
def redis_server():
    server = PrivateRedis().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pd_collector():
    """The OTLP collector `traced_pd_cluster` exports its spans to."""
    server = OtlpCollector()
    yield server
    server.stop()


@shared_cluster
def traced_pd_cluster(tiny_llama_dir, pd_collector):
    """1 prefill + 1 decode replica with pd_cluster.BASE's flags and nothing else but
    tracing to `pd_collector` (quickly: 100 ms batches), on its own Redis: the P/D cluster
    of test_pd_equivalence and test_pd_trace (tests/shared_clusters.py)."""
    with PrivateRedis() as redis:
        serve = start_pd(tiny_llama_dir, redis.url, "--otlp-traces-endpoint",
                         pd_collector.endpoint, env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
        running("traced_pd_cluster", serve.stop)
        yield serve
        code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]
