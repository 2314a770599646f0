"""grpc_channels: mutual TLS lets in only callers with a certificate the CA signed,
every unary call has a deadline, stream reads are bounded, and keepalive ends the
calls on a peer that froze."""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tls_certs import SERVER_NAME, make_certs

from pagoda.services.common import grpc_channels
from pagoda.services.common.grpc_channels import GrpcTLS

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls(certs):
    """This process configured for mutual TLS; plaintext again afterwards."""
    config = GrpcTLS(str(certs.cert), str(certs.key), str(certs.ca), SERVER_NAME)
    grpc_channels.configure(config)
    yield config
    grpc_channels.configure(None)


def _health_server() -> tuple[grpc.Server, str]:
    server = grpc_channels.server(2)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = grpc_channels.add_port(server, "127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _check(channel: grpc.Channel) -> grpc.StatusCode | int:
    """SERVING, or the status code the call failed with."""
    with channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=5).status
        except grpc.RpcError as exc:
            return exc.code()


def _credentials(ca=None, cert=None, key=None) -> grpc.ChannelCredentials:
    read = lambda path: path.read_bytes() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


def test_only_callers_with_a_certificate_from_the_ca_get_in(tls, certs):
    server, address = _health_server()
    name = [("grpc.ssl_target_name_override", SERVER_NAME)]
    try:
        assert _check(grpc_channels.channel(address)) == SERVING
        refused = {
            "plaintext": _check(grpc.insecure_channel(address)),
            "CA but no certificate": _check(grpc.secure_channel(
                address, _credentials(certs.ca), options=name)),
            "certificate of another CA": _check(grpc.secure_channel(
                address, _credentials(certs.ca, certs.rogue_cert, certs.rogue_key),
                options=name)),
            "no CA (server not trusted)": _check(grpc.secure_channel(
                address, _credentials(None, certs.cert, certs.key), options=name)),
        }
    finally:
        server.stop(None)
    assert refused == dict.fromkeys(refused, grpc.StatusCode.UNAVAILABLE)


def test_a_client_refuses_a_server_of_another_ca(certs):
    grpc_channels.configure(GrpcTLS(str(certs.rogue_cert), str(certs.rogue_key),
                                    str(certs.rogue_ca), SERVER_NAME))
    try:
        server, address = _health_server()  # presents the rogue certificate
    finally:
        grpc_channels.configure(None)
    try:
        genuine = grpc.secure_channel(address, _credentials(certs.ca, certs.cert, certs.key),
                                      options=[("grpc.ssl_target_name_override", SERVER_NAME)])
        assert _check(genuine) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_tls_flags_come_all_three_or_none(certs, tmp_path):
    parser = argparse.ArgumentParser()
    grpc_channels.add_tls_args(parser)
    assert GrpcTLS.from_args(parser.parse_args([])) is None
    full = GrpcTLS.from_args(parser.parse_args(certs.flags()))
    assert full == GrpcTLS(str(certs.cert), str(certs.key), str(certs.ca), SERVER_NAME)
    assert GrpcTLS.from_args(parser.parse_args(full.flags())) == full  # `pagoda serve` passes it on
    with pytest.raises(SystemExit, match="missing: --grpc-tls-ca"):
        GrpcTLS.from_args(parser.parse_args(["--grpc-tls-cert", str(certs.cert),
                                             "--grpc-tls-key", str(certs.key)]))
    with pytest.raises(SystemExit, match="no file"):
        GrpcTLS.from_args(parser.parse_args(["--grpc-tls-cert", str(tmp_path / "none.pem"),
                                             "--grpc-tls-key", str(certs.key),
                                             "--grpc-tls-ca", str(certs.ca)]))


# -------------------------------------------------------------- deadlines, keepalive
SCHEDULER = "pagoda.scheduler.v1.SchedulerService"


def _slow_scheduler(delay_s: float) -> tuple[grpc.Server, str]:
    """Raw-bytes handlers under the scheduler's method names: a unary call that
    answers after `delay_s`, and a stream that sends one message at once, then one
    more after `delay_s`."""
    def unary(request, context):
        time.sleep(delay_s)
        return b"late"

    def stream(request, context):
        yield b"first"
        time.sleep(delay_s)
        yield b"second"

    handler = grpc.method_handlers_generic_handler(SCHEDULER, {
        "GetLoad": grpc.unary_unary_rpc_method_handler(unary),
        "Generate": grpc.unary_stream_rpc_method_handler(stream),
    })
    server = grpc_channels.server(4)
    server.add_generic_rpc_handlers((handler,))
    port = grpc_channels.add_port(server, "127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_unary_calls_get_a_default_deadline_and_generation_streams_do_not():
    server, address = _slow_scheduler(1.0)
    options = [o for o in grpc_channels.CLIENT_OPTIONS if o[0] != "grpc.service_config"]
    options.append(("grpc.service_config", grpc_channels.service_config(0.3)))
    try:
        with grpc_channels.channel(address, options) as channel:
            with pytest.raises(grpc.RpcError) as failed:
                channel.unary_unary(f"/{SCHEDULER}/GetLoad")(b"")  # no timeout given
            streamed = list(channel.unary_stream(f"/{SCHEDULER}/Generate")(b""))
    finally:
        server.stop(None)
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert streamed == [b"first", b"second"]


def test_a_stream_read_that_waits_too_long_fails_unavailable():
    server, address = _slow_scheduler(5.0)

    async def read_two():
        async with grpc_channels.aio_channel(address) as channel:
            call = channel.unary_stream(f"/{SCHEDULER}/Generate")(b"")
            first = await grpc_channels.read_within(call, 3.0, "the scheduler")
            try:
                await grpc_channels.read_within(call, 0.2, "the scheduler")
            except grpc.aio.AioRpcError as exc:
                return first, exc.code(), exc.details(), call.cancelled()
            return first, None, None, None

    try:
        first, code, details, cancelled = asyncio.run(read_two())
    finally:
        server.stop(None)
    assert (first, code, cancelled) == (b"first", grpc.StatusCode.UNAVAILABLE, True)
    assert "the scheduler sent nothing for 0.2 s" in details


FROZEN_SERVER = """
import sys, time
from grpc_health.v1 import health, health_pb2_grpc
from pagoda.services.common import grpc_channels
server = grpc_channels.server(2)
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
print(grpc_channels.add_port(server, "127.0.0.1:0"), flush=True)
server.start()
time.sleep(600)
"""


def test_keepalive_ends_a_call_on_a_frozen_peer_long_before_its_deadline():
    """A stopped process still holds its TCP connection open: only the unanswered
    keepalive ping shows that it is gone. Without keepalive (or with gRPC's default
    60 s ping timeout) the read below would end with DEADLINE_EXCEEDED after 30 s."""
    process = subprocess.Popen([sys.executable, "-c", FROZEN_SERVER], stdout=subprocess.PIPE,
                               text=True)
    try:
        port = int(process.stdout.readline())
        with grpc_channels.channel(f"127.0.0.1:{port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(),
                                                              timeout=30)
            assert next(watch).status == SERVING
            process.send_signal(signal.SIGSTOP)
            with pytest.raises(grpc.RpcError) as failed:
                next(watch)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()


def test_servers_accept_the_pings_of_a_silent_stream():
    """Our clients ping every few seconds while a stream waits (a request queued in a
    replica); gRPC's default server policy would answer that with GOAWAY."""
    server, address = _slow_scheduler(4 * grpc_channels.KEEPALIVE_TIME_MS / 1000)
    try:
        with grpc_channels.channel(address) as channel:
            streamed = list(channel.unary_stream(f"/{SCHEDULER}/Generate")(b"", timeout=60))
    finally:
        server.stop(None)
    assert streamed == [b"first", b"second"]


def test_metrics_host_defaults_to_the_grpc_host():
    from pagoda.services.common.grpc_server import metrics_host

    assert metrics_host(SimpleNamespace(host="127.0.0.1", metrics_host=None)) == "127.0.0.1"
    assert metrics_host(SimpleNamespace(host="127.0.0.1", metrics_host="0.0.0.0")) == "0.0.0.0"
