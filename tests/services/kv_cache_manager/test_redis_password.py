"""A password-protected Redis: the private one refuses strangers, and the kv-cache-manager
logs in with a password it gets only from its environment and never prints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.free_ports import free_port
from pagoda.services.common.redis_server import PrivateRedis
from pagoda.services.common.redis_url import redact

PASSWORD = "pw-Zq8rT2vLx9"


@pytest.fixture(scope="module")
def locked_redis():
    with PrivateRedis(password=PASSWORD) as server:
        yield server


def test_the_private_redis_requires_its_password_which_is_not_on_its_command_line(locked_redis):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(locked_redis.url).ping()
    assert redis.Redis.from_url(locked_redis.url, password=PASSWORD).ping()
    assert PASSWORD not in locked_redis.url
    cmdline = open(f"/proc/{locked_redis.process.pid}/cmdline", "rb").read()
    assert PASSWORD.encode() not in cmdline


def test_redact_hides_only_the_password():
    assert redact("redis://:s3cret@r.data.svc:6380/1") == "redis://:***@r.data.svc:6380/1"
    assert redact("rediss://user:s3cret@[::1]:6379/0") == "rediss://user:***@[::1]:6379/0"
    assert redact("redis://r:6379/0") == "redis://r:6379/0"


def _run_manager(env: dict[str, str], *flags: str) -> tuple[grpc.StatusCode | int, str]:
    """Start `pagoda kv-cache-manager`, ask its health, stop it: (status, its log)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.services.cli.main", "kv-cache-manager",
         "--port", str(port), *flags], stderr=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items()
                if k not in ("REDIS_PASSWORD", "PAGODA_REDIS_URL")}, **env})
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=60, wait_for_ready=True).status
        process.send_signal(signal.SIGTERM)
        process.wait(30)  # a loaded CI machine took over 15 s once
        return status, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_kv_cache_manager_logs_in_with_the_password_from_its_environment(locked_redis):
    status, log = _run_manager({"REDIS_PASSWORD": PASSWORD}, "--redis-url", locked_redis.url)
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "not reachable" not in log and PASSWORD not in log
    # The login really uses the environment's password: a wrong one is refused.
    status, log = _run_manager({"REDIS_PASSWORD": "wrong"}, "--redis-url", locked_redis.url)
    assert "not reachable yet" in log and "wrong" not in log


def test_a_url_with_a_password_comes_from_the_environment_and_is_redacted(locked_redis):
    url = locked_redis.url.replace("redis://", "redis://:not-the-password@")
    status, log = _run_manager({"PAGODA_REDIS_URL": url})  # no --redis-url on argv
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "not-the-password" not in log
    assert f"redis at {redact(url)} is not reachable yet" in log
