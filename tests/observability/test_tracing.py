"""W3C trace context across real gRPC calls, in one process, with the in-memory exporter:
the client span is the parent of the server span, which is the parent of whatever the
handler does; sync and grpc.aio, unary and server-streaming; nothing while tracing is off."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pagoda import tracing
from pagoda.services.common import tracing as grpc_tracing

SERVICE = "test.Echo"


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    assert tracing.init_tracing("test", exporter=exporter)
    yield exporter
    tracing.shutdown_tracing()


def _say(request: bytes, context) -> bytes:
    with tracing.get_tracer().start_as_current_span("handler work"):
        if request == b"bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request")
        return request.upper()


def _stream(request: bytes, context):
    for part in request.split():
        with tracing.get_tracer().start_as_current_span("handler part"):
            yield part


def _handlers(say, stream) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Say": grpc.unary_unary_rpc_method_handler(say),
        "Stream": grpc.unary_stream_rpc_method_handler(stream)})


def _find(finished, name: str, kind: SpanKind = SpanKind.INTERNAL):
    (span,) = [s for s in finished if s.name == name and s.kind == kind]
    return span


def _check_chain(finished, method: str, child: str) -> None:
    """outer -> CLIENT method -> SERVER method -> every `child` span, in one trace."""
    outer = _find(finished, "outer")
    client = _find(finished, f"{SERVICE}/{method}", SpanKind.CLIENT)
    server = _find(finished, f"{SERVICE}/{method}", SpanKind.SERVER)
    work = [s for s in finished if s.name == child]
    assert client.parent.span_id == outer.context.span_id
    assert server.parent.span_id == client.context.span_id
    assert work and all(w.parent.span_id == server.context.span_id for w in work)
    assert {s.context.trace_id for s in (client, server, *work)} == {outer.context.trace_id}
    assert client.attributes["rpc.grpc.status_code"] == 0


def test_tracing_off_installs_nothing_and_records_nothing():
    assert not tracing.is_enabled()
    assert grpc_tracing.client_interceptors() == grpc_tracing.server_interceptors() == []
    assert grpc_tracing.aio_client_interceptors() == grpc_tracing.aio_server_interceptors() == []
    with tracing.get_tracer().start_as_current_span("x") as span:
        assert not span.is_recording()


def test_sync_calls_carry_the_trace_into_the_server(spans):
    server = grpc.server(ThreadPoolExecutor(4), interceptors=grpc_tracing.server_interceptors())
    server.add_generic_rpc_handlers([_handlers(_say, _stream)])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        channel = grpc_tracing.intercept(grpc.insecure_channel(f"127.0.0.1:{port}"))
        say = channel.unary_unary(f"/{SERVICE}/Say")
        with tracing.get_tracer().start_as_current_span("outer"):
            assert say(b"hi", timeout=5) == b"HI"
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        finished = spans.get_finished_spans()
        assert {s.name for s in finished} == {"outer", f"{SERVICE}/Say", "handler work"}
        assert len(finished) == 4  # client and server spans; health checks are not traced
        _check_chain(finished, "Say", "handler work")

        spans.clear()  # server streaming: the server span covers every part
        assert list(channel.unary_stream(f"/{SERVICE}/Stream")(b"a b", timeout=5)) == [b"a", b"b"]
        finished = spans.get_finished_spans()
        stream_span = _find(finished, f"{SERVICE}/Stream", SpanKind.SERVER)
        parts = [s for s in finished if s.name == "handler part"]
        assert len(parts) == 2
        assert all(p.parent.span_id == stream_span.context.span_id for p in parts)

        spans.clear()
        with pytest.raises(grpc.RpcError) as error:
            say(b"bad", timeout=5)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finished = spans.get_finished_spans()
        client = _find(finished, f"{SERVICE}/Say", SpanKind.CLIENT)
        assert client.attributes["rpc.grpc.status_code"] == 3
        assert client.status.status_code == StatusCode.ERROR
        assert _find(finished, f"{SERVICE}/Say", SpanKind.SERVER).status.status_code == \
            StatusCode.ERROR
        channel.close()
    finally:
        server.stop(None)


def test_aio_calls_carry_the_trace_into_the_server_streams_included(spans):
    async def say(request, context):
        return _say(request, context)

    async def stream(request, context):
        for part in request.split():
            with tracing.get_tracer().start_as_current_span("handler part"):
                await asyncio.sleep(0)
            yield part

    async def main() -> None:
        server = grpc.aio.server(interceptors=grpc_tracing.aio_server_interceptors())
        server.add_generic_rpc_handlers([_handlers(say, stream)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                            interceptors=grpc_tracing.aio_client_interceptors())
        with tracing.get_tracer().start_as_current_span("outer"):
            assert await channel.unary_unary(f"/{SERVICE}/Say")(b"hi", timeout=5) == b"HI"
            call = channel.unary_stream(f"/{SERVICE}/Stream")(b"a b", timeout=5)
            assert [part async for part in call] == [b"a", b"b"]
        await asyncio.sleep(0.05)  # client spans end from the calls' done callbacks
        await channel.close()
        await server.stop(None)

    asyncio.run(main())
    finished = spans.get_finished_spans()
    _check_chain(finished, "Say", "handler work")
    _check_chain(finished, "Stream", "handler part")
