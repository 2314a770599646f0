"""`pagoda serve` hardened: mutual TLS between all five services, the API key and the
private Redis's password only in environments, never on a command line."""

from __future__ import annotations

import re

import grpc
import openai
import psutil
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_cluster import ServeProcess, flag_value
from tls_certs import SERVER_NAME, make_certs

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
API_KEY = "k-" + "7" * 30
GRPC_SERVICES = ("kv-cache-manager", "tokenizer", "gpu-worker", "scheduler")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_cluster(tiny_llama_dir, certs):
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                          "--max-model-len", "1024", *certs.flags()],
                         env={"PAGODA_API_KEY": API_KEY})
    yield serve
    code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]


def _check(channel: grpc.Channel):
    with channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=10).status
        except grpc.RpcError as exc:
            return exc.code()


def test_a_cluster_with_mutual_tls_serves(tls_cluster):
    client = openai.OpenAI(base_url=tls_cluster.url, api_key=API_KEY, max_retries=0,
                           timeout=120)
    out = client.completions.create(model="tiny", prompt="The capital of France", max_tokens=8,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8
    assert "handshake" not in tls_cluster.stderr_text().lower()


def test_no_service_answers_a_client_without_a_certificate_from_the_ca(tls_cluster, certs):
    name = [("grpc.ssl_target_name_override", SERVER_NAME)]
    full = grpc.ssl_channel_credentials(certs.ca.read_bytes(), certs.key.read_bytes(),
                                        certs.cert.read_bytes())
    ca_only = grpc.ssl_channel_credentials(certs.ca.read_bytes())
    rogue = grpc.ssl_channel_credentials(certs.ca.read_bytes(), certs.rogue_key.read_bytes(),
                                         certs.rogue_cert.read_bytes())
    for service in GRPC_SERVICES:
        address = f"127.0.0.1:{flag_value(tls_cluster.service_args(service), '--port')}"
        assert _check(grpc.secure_channel(address, full, options=name)) == \
            health_pb2.HealthCheckResponse.SERVING, service
        for channel in (grpc.insecure_channel(address),
                        grpc.secure_channel(address, ca_only, options=name),
                        grpc.secure_channel(address, rogue, options=name)):
            assert _check(channel) == grpc.StatusCode.UNAVAILABLE, service


def test_secrets_reach_the_services_only_through_their_environment(tls_cluster):
    match = re.search(r"starting a private Redis at (redis://\S+)", tls_cluster.stderr_text())
    assert match, tls_cluster.stderr_text()[-2000:]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(match.group(1)).ping()
    manager = psutil.Process(tls_cluster.service_pid("kv-cache-manager"))
    password = manager.environ()["REDIS_PASSWORD"]
    assert redis.Redis.from_url(match.group(1), password=password).ping()
    assert psutil.Process(tls_cluster.service_pid("gateway")).environ()["PAGODA_API_KEY"] == \
        API_KEY
    supervisor = psutil.Process(tls_cluster.process.pid)
    for process in [supervisor, *supervisor.children(recursive=True)]:
        cmdline = " ".join(process.cmdline())
        assert password not in cmdline and API_KEY not in cmdline, cmdline
    assert password not in "".join(tls_cluster.log) and API_KEY not in "".join(tls_cluster.log)
