"""/metrics and /health over HTTP for the gRPC services."""

from __future__ import annotations

import httpx

from pagoda.services.common.metrics_server import MetricsServer, maybe_start_metrics
from pagoda.services.common.redis_server import free_port


def test_metrics_and_health_follow_the_service_state():
    healthy = [True]
    server = MetricsServer("127.0.0.1", free_port(), lambda: healthy[0]).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert "python_info" in httpx.get(f"{base}/metrics").text
        assert httpx.get(f"{base}/health").status_code == 200
        healthy[0] = False
        assert httpx.get(f"{base}/health").status_code == 503
        assert httpx.get(f"{base}/nope").status_code == 404
    finally:
        server.stop()


def test_port_zero_means_off():
    assert maybe_start_metrics("127.0.0.1", 0, lambda: True) is None
