"""Envoy's `envoy.service.ext_proc.v3.ExternalProcessor`, as GIE's endpoint picker
protocol (docs/proposals/004-endpoint-picker-protocol, v1.0.0) uses it.

One gRPC stream is one HTTP exchange. The request body may arrive in any number of
chunks (FULL_DUPLEX_STREAMED): the picker holds its answer to the request headers until
the body's end_of_stream, then answers the headers with the choice and sends the body
back unchanged. Invariants:
* the chosen endpoints go out twice with the same value: the
  `x-gateway-destination-endpoint` header and the `envoy.lb` dynamic metadata key of
  that name (`ip:port`, then up to two fallbacks, comma-separated);
* with the proxy's subset hint (`envoy.lb.subset_hint` /
  `x-gateway-destination-endpoint-subset`) only listed endpoints are chosen;
* a body that is not an OpenAI request gets a 400 ImmediateResponse (OpenAI's error
  JSON naming the field), a sheddable request with every candidate saturated 429, no
  ready candidate 503; nothing else ends the stream early;
* the load reserved on the chosen replica is released when the stream ends (the
  exchange is over), and its prefill counts as done at the response headers.
"""

from __future__ import annotations

import json
import time

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as epb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.epp.body import BadBody, ParsedBody, parse_body
from pagoda.services.epp.metrics import EppMetrics
from pagoda.services.epp.picker import Pick, Picker, PickError

DESTINATION = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
DESTINATION_NAMESPACE = "envoy.lb"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
MAX_BODY_BYTES = 64 * 2**20
_ERROR_TYPES = {400: "BadRequestError", 429: "RateLimitError", 503: "ServiceUnavailableError"}


class Exchange:
    """What one stream has seen so far."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.body = bytearray()
        self.pick: Pick | None = None
        self.model = ""
        self.start = time.monotonic()


class ExternalProcessor(epb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker, metrics: EppMetrics,
                 priorities: dict[str, int] | None = None, default_priority: int = 0) -> None:
        self.picker = picker
        self.metrics = metrics
        self.priorities = priorities or {}
        self.default_priority = default_priority

    async def Process(self, request_iterator, context):  # noqa: N802 (the proto's name)
        exchange = Exchange()
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    exchange.headers = _headers(message.request_headers)
                    exchange.subset = _subset_hint(message.metadata_context)
                    if message.request_headers.end_of_stream:  # no body: route on load
                        for reply in await self._on_request(exchange, with_body=False):
                            yield reply
                elif kind == "request_body":
                    exchange.body += message.request_body.body
                    if len(exchange.body) > MAX_BODY_BYTES:
                        yield _immediate(400, "The request body is too large.", "body")
                        return
                    if message.request_body.end_of_stream:
                        replies = await self._on_request(exchange, with_body=True)
                        for reply in replies:
                            yield reply
                        if replies[0].HasField("immediate_response"):
                            return
                elif kind == "response_headers":
                    if exchange.pick is not None:
                        exchange.pick.route.prefill_done()
                    yield epb.ProcessingResponse(response_headers=epb.HeadersResponse())
                elif kind == "response_body":
                    body = message.response_body
                    yield epb.ProcessingResponse(response_body=epb.BodyResponse(
                        response=epb.CommonResponse(body_mutation=epb.BodyMutation(
                            streamed_response=epb.StreamedBodyResponse(
                                body=body.body, end_of_stream=body.end_of_stream)))))
                elif kind == "request_trailers":
                    yield epb.ProcessingResponse(request_trailers=epb.TrailersResponse())
                elif kind == "response_trailers":
                    yield epb.ProcessingResponse(response_trailers=epb.TrailersResponse())
        finally:
            self._finish(exchange)

    async def _on_request(self, exchange: Exchange, with_body: bool
                          ) -> list[epb.ProcessingResponse]:
        try:
            body = parse_body(bytes(exchange.body)) if with_body else _no_body()
        except BadBody as exc:
            self.metrics.error("", "", 400)
            return [_immediate(400, str(exc), exc.param)]
        exchange.model = body.model
        self.metrics.requests.labels(body.model, body.model).inc()
        try:
            pick = await self.picker.pick(body, exchange.subset, self._sheddable(exchange))
        except PickError as exc:
            self.metrics.error(body.model, body.model, exc.status)
            return [_immediate(exc.status, str(exc), "prompt" if exc.status == 400 else None)]
        exchange.pick = pick
        self.metrics.running.labels(body.model).inc()
        value = ",".join(pick.endpoints)
        headers = epb.ProcessingResponse(
            request_headers=epb.HeadersResponse(response=epb.CommonResponse(
                header_mutation=epb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=DESTINATION, raw_value=value.encode()),
                    append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]),
                clear_route_cache=True)),
            dynamic_metadata=_struct({DESTINATION_NAMESPACE: {DESTINATION: value}}))
        if not with_body:
            return [headers]
        echoed = epb.ProcessingResponse(request_body=epb.BodyResponse(
            response=epb.CommonResponse(body_mutation=epb.BodyMutation(
                streamed_response=epb.StreamedBodyResponse(body=bytes(exchange.body),
                                                           end_of_stream=True)))))
        return [headers, echoed]

    def _sheddable(self, exchange: Exchange) -> bool:
        """GIE: a request whose InferenceObjective has a negative priority may be shed."""
        objective = exchange.headers.get(OBJECTIVE_HEADER)
        return self.priorities.get(objective, self.default_priority) < 0

    def _finish(self, exchange: Exchange) -> None:
        if exchange.pick is None:
            return
        exchange.pick.route.release()
        self.metrics.running.labels(exchange.model).dec()
        self.metrics.duration.labels(exchange.model, exchange.model).observe(
            time.monotonic() - exchange.start)


def _no_body() -> ParsedBody:
    """A request without a body (GET /v1/models): routed on load alone."""
    return ParsedBody("", tpb.TokenizeRequest(token_ids=tpb.TokenIds()), 1)


def _headers(message: epb.HttpHeaders) -> dict[str, str]:
    return {h.key.lower(): (h.raw_value.decode("latin-1") if h.raw_value else h.value)
            for h in message.headers.headers}


def _subset_hint(metadata: base_pb2.Metadata) -> list[str] | None:
    """The endpoints the proxy allows, or None when it sent no hint."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    return [v.string_value for v in fields[SUBSET_KEY].list_value.values]


def _struct(value: dict) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(value)
    return struct


def _immediate(status: int, message: str, param: str | None = None) -> epb.ProcessingResponse:
    """An ImmediateResponse carrying OpenAI's error JSON."""
    body = json.dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"),
                                 "param": param, "code": status}}).encode()
    return epb.ProcessingResponse(immediate_response=epb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), body=body,
        headers=epb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))]),
        details=message))
