"""gRPC interceptors that carry W3C trace context between services and make spans.

Client side: a CLIENT span per unary call (and per server-streaming call, ended
when the stream ends), its context injected into the call's metadata as
`traceparent`. Server side: the context is extracted from the metadata and the
handler runs inside a SERVER span, so its own spans and outgoing calls join the
caller's trace. Health checks and client-streaming calls (the tokenizer's
long-lived DecodeStream, which multiplexes many requests) are not traced.

`client_interceptors()` / `server_interceptors()` (and their aio twins) return
an empty list while tracing is off (pagoda.tracing), so an untraced process
runs exactly the un-intercepted gRPC code.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

import pagoda.tracing as tracing

UNTRACED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def _name(method: str | bytes) -> str:
    """`/package.Service/Method` (grpc.aio passes it as bytes) -> `package.Service/Method`."""
    return (method.decode() if isinstance(method, bytes) else method).lstrip("/")


def _traced(method: str | bytes) -> bool:
    return tracing.is_enabled() and not ("/" + _name(method)).startswith(UNTRACED_PREFIXES)


def _attributes(method: str | bytes) -> dict[str, str]:
    service, _, name = _name(method).rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _metadata_with_context(metadata, span) -> list[tuple[str, str]]:
    carrier: dict[str, str] = {}
    tracing.inject(carrier, trace.set_span_in_context(span))
    return [*(metadata or ()), *carrier.items()]


def _end_with_code(span, code: grpc.StatusCode | None) -> None:
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


class _CallDetails(collections.namedtuple(
        "_CallDetails", "method timeout metadata credentials wait_for_ready compression"),
        grpc.ClientCallDetails):
    pass


# ---------------------------------------------------------------------- clients
def _sync_client_span(details):
    """A started CLIENT span for a sync call, and the call's details carrying its context."""
    span = tracing.get_tracer().start_span(_name(details.method), kind=SpanKind.CLIENT,
                                           attributes=_attributes(details.method))
    new = _CallDetails(details.method, details.timeout,
                       _metadata_with_context(details.metadata, span), details.credentials,
                       getattr(details, "wait_for_ready", None),
                       getattr(details, "compression", None))
    return span, new


class ClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Sync channels (`grpc.intercept_channel`): unary calls."""

    def intercept_unary_unary(self, continuation, details, request):
        if not _traced(details.method):
            return continuation(details, request)
        span, new = _sync_client_span(details)
        try:
            outcome = continuation(new, request)
        except grpc.RpcError as exc:
            _end_with_code(span, exc.code())
            raise
        _end_with_code(span, outcome.code())  # a blocking call: it has completed
        return outcome


class StreamClientInterceptor(grpc.UnaryStreamClientInterceptor):
    """Sync channels: server-streaming calls (the span ends with the stream)."""

    def intercept_unary_stream(self, continuation, details, request):
        if not _traced(details.method):
            return continuation(details, request)
        span, new = _sync_client_span(details)
        call = continuation(new, request)
        call.add_done_callback(lambda c: _end_with_code(span, c.code()))
        return call


class _AioClientBase:
    async def _intercept(self, continuation, details, request):
        if not _traced(details.method):
            return await continuation(details, request)
        span = tracing.get_tracer().start_span(_name(details.method), kind=SpanKind.CLIENT,
                                               attributes=_attributes(details.method))
        new = grpc.aio.ClientCallDetails(details.method, details.timeout,
                                         _metadata_with_context(details.metadata, span),
                                         details.credentials, details.wait_for_ready)
        call = await continuation(new, request)
        call.add_done_callback(lambda c: asyncio.ensure_future(_end_aio_span(span, c)))
        return call


async def _end_aio_span(span, call) -> None:
    """Runs once the call is done, so `code()` answers at once."""
    try:
        code = grpc.StatusCode.CANCELLED if call.cancelled() else await call.code()
    except Exception:  # noqa: BLE001 (no status to report: end the span without one)
        code = None
    _end_with_code(span, code)


class AioUnaryUnaryInterceptor(_AioClientBase, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await self._intercept(continuation, details, request)


class AioUnaryStreamInterceptor(_AioClientBase, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await self._intercept(continuation, details, request)


def client_interceptors() -> list:
    return [ClientInterceptor(), StreamClientInterceptor()] if tracing.is_enabled() else []


def aio_client_interceptors() -> list:
    if not tracing.is_enabled():
        return []
    return [AioUnaryUnaryInterceptor(), AioUnaryStreamInterceptor()]


def intercept(channel: grpc.Channel) -> grpc.Channel:
    """`channel`, traced if tracing is on."""
    interceptors = client_interceptors()
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


# ---------------------------------------------------------------------- servers
def _server_span(details: grpc.HandlerCallDetails):
    parent = tracing.extract(dict(details.invocation_metadata or ()))
    return tracing.get_tracer().start_span(_name(details.method), context=parent,
                                           kind=SpanKind.SERVER,
                                           attributes=_attributes(details.method)), parent


def _record(span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))


@contextlib.contextmanager
def _server_span_scope(details: grpc.HandlerCallDetails):
    """One handler call's SERVER span: yields the context that makes it current; an
    exception that escapes is recorded on it, and the span ends when the block does."""
    span, parent = _server_span(details)
    try:
        yield trace.set_span_in_context(span, parent)
    except Exception as exc:
        _record(span, exc)
        raise
    finally:
        span.end()


@contextlib.contextmanager
def _current(ctx):
    """`ctx` current for the block. A streaming handler attaches it around each step
    only, never across a yield, where the consumer's own context must be current."""
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


_DONE = object()  # the end of a handler's response stream


class ServerInterceptor(grpc.ServerInterceptor):
    """Sync servers: unary-request handlers run inside a SERVER span."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_streaming or not _traced(details.method):
            return handler
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, details),
                handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            self._wrap_unary(handler.unary_unary, details),
            handler.request_deserializer, handler.response_serializer)

    @staticmethod
    def _wrap_unary(behavior, details):
        def wrapper(request, context):
            with _server_span_scope(details) as ctx, _current(ctx):
                return behavior(request, context)
        return wrapper

    @staticmethod
    def _wrap_stream(behavior, details):
        def wrapper(request, context):
            with _server_span_scope(details) as ctx:
                responses = behavior(request, context)
                while True:
                    with _current(ctx):
                        item = next(responses, _DONE)
                    if item is _DONE:
                        return
                    yield item
        return wrapper


class AioServerInterceptor(grpc.aio.ServerInterceptor):
    """grpc.aio servers: unary-request handlers (coroutines or async generators)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or not _traced(details.method):
            return handler
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _aio_wrap_stream(handler.unary_stream, details),
                handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            _aio_wrap_unary(handler.unary_unary, details),
            handler.request_deserializer, handler.response_serializer)


def _aio_wrap_unary(behavior, details):
    async def wrapper(request, context):
        with _server_span_scope(details) as ctx, _current(ctx):
            return await behavior(request, context)
    return wrapper


def _aio_wrap_stream(behavior, details):
    if not inspect.isasyncgenfunction(behavior):  # a coroutine writing with context.write
        return _aio_wrap_unary(behavior, details)

    async def wrapper(request, context):
        with _server_span_scope(details) as ctx:
            responses = behavior(request, context)
            try:
                while True:
                    with _current(ctx):
                        item = await anext(responses, _DONE)
                    if item is _DONE:
                        return
                    yield item
            finally:
                await responses.aclose()
    return wrapper


def server_interceptors() -> list:
    return [ServerInterceptor()] if tracing.is_enabled() else []


def aio_server_interceptors() -> list:
    return [AioServerInterceptor()] if tracing.is_enabled() else []
