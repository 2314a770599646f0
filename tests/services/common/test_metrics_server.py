"""/metrics and /health over HTTP for the gRPC services."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client import CollectorRegistry, Counter

from pagoda.services.common.metrics_server import (MetricsServer, maybe_start_metrics,
                                                   one_per_process)
from pagoda.free_ports import free_port


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


def test_one_per_process_builds_once_even_when_threads_race():
    registry = CollectorRegistry()
    built = []

    @one_per_process
    def metrics():
        time.sleep(0.05)  # widen the window in which a second thread could also build
        built.append(Counter("pagoda_test_once", "A metric registered once.",
                             registry=registry))
        return built[-1]

    threads = [threading.Thread(target=metrics) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(built) == 1 and metrics() is built[0]
