"""`pagoda kv-cache-manager` as a process: serves health, stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.free_ports import free_port


def test_serves_health_and_metrics_then_exits_zero_on_sigterm(redis_server):
    port, metrics_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.services.cli.main", "kv-cache-manager", "--port", str(port),
         "--metrics-port", str(metrics_port), "--redis-url", redis_server.url],
        stderr=subprocess.PIPE, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        deadline = time.monotonic() + 10
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{metrics_port}/health").status_code == 200
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
        log = process.stderr.read()
        assert "kv-cache-manager stopped" in log and "Traceback" not in log
    finally:
        if process.poll() is None:
            process.kill()
