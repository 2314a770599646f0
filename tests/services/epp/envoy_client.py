"""The proxy's side of GIE's endpoint picker protocol, as Envoy's ext_proc filter speaks
it in FULL_DUPLEX_STREAMED mode, over real gRPC with xds-protos' stubs.

`ask` sends the request headers (with the subset hint in the metadata context when
given) and the body in `chunks` pieces, and reads the picker's answer: an
ImmediateResponse, or the header mutation + `envoy.lb` dynamic metadata followed by
the body sent back. `served` then plays the response side: the response headers
with the endpoint that served (`x-gateway-destination-endpoint-served`), and ends the
stream as Envoy does when the exchange is over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as epb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epb_grpc
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"


@dataclass
class Answer:
    status: int = 0                       # an ImmediateResponse's HTTP status; 0: routed
    error: dict = field(default_factory=dict)  # its OpenAI error JSON
    header: str = ""                      # x-gateway-destination-endpoint as set
    metadata: str = ""                    # envoy.lb / x-gateway-destination-endpoint
    body: bytes = b""                     # the request body as sent back
    call: object = None

    @property
    def endpoints(self) -> list[str]:
        return self.header.split(",") if self.header else []


def _headers(pairs: dict[str, str], end_of_stream: bool) -> epb.HttpHeaders:
    return epb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=end_of_stream)


def _metadata(namespace: str, values: dict) -> base_pb2.Metadata:
    struct = struct_pb2.Struct()
    struct.update(values)
    metadata = base_pb2.Metadata()
    metadata.filter_metadata[namespace].CopyFrom(struct)
    return metadata


async def ask(channel: grpc.aio.Channel, body: dict | bytes, chunks: int = 2,
              subset: list[str] | None = None, headers: dict[str, str] | None = None,
              path: str = "/v1/completions") -> Answer:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    call = epb_grpc.ExternalProcessorStub(channel).Process()
    request_headers = {":method": "POST", ":path": path, ":authority": "pool.local",
                       "content-type": "application/json", **(headers or {})}
    first = epb.ProcessingRequest(request_headers=_headers(request_headers, False))
    if subset is not None:
        first.metadata_context.CopyFrom(_metadata(
            "envoy.lb.subset_hint", {"x-gateway-destination-endpoint-subset": subset}))
    await call.write(first)
    step = -(-len(raw) // chunks)
    pieces = [raw[i:i + step] for i in range(0, len(raw), step)] or [b""]
    for i, piece in enumerate(pieces):
        await call.write(epb.ProcessingRequest(request_body=epb.HttpBody(
            body=piece, end_of_stream=i == len(pieces) - 1)))
    reply = await call.read()
    if reply.HasField("immediate_response"):
        immediate = reply.immediate_response
        await call.done_writing()
        return Answer(status=immediate.status.code, error=json.loads(immediate.body))
    assert reply.HasField("request_headers"), reply
    mutation = reply.request_headers.response.header_mutation
    (option,) = [o for o in mutation.set_headers if o.header.key == DESTINATION]
    metadata = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION]
    echoed = b""
    while True:
        reply = await call.read()
        streamed = reply.request_body.response.body_mutation.streamed_response
        echoed += streamed.body
        if streamed.end_of_stream:
            break
    return Answer(header=option.header.raw_value.decode(), metadata=metadata.string_value,
                  body=echoed, call=call)


async def served(answer: Answer, endpoint: str, status: int = 200) -> None:
    """The response side of the exchange, then the stream's end."""
    call = answer.call
    message = epb.ProcessingRequest(
        response_headers=_headers({":status": str(status)}, True),
        metadata_context=_metadata("envoy.lb",
                                   {"x-gateway-destination-endpoint-served": endpoint}))
    await call.write(message)
    reply = await call.read()
    assert reply.HasField("response_headers"), reply
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
