"""The ext_proc side of `pagoda epp` over real gRPC, in process, with a stand-in for the
router's choice (the cluster test, test_epp_cluster.py, runs the real one): how a whole
exchange is framed (the answer to the headers held until the body's last chunk, the body
sent back, the response side answered), what reaches the picker (the parsed body, the
subset hint, whether the objective may be shed), the status codes, and that the load
reserved on the chosen replica is released when the stream ends, also when the proxy
drops it half-way."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as epb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epb_grpc
from envoy_client import ask, served

from pagoda.services.epp.body import BadBody, parse_body
from pagoda.services.epp.endpoints import EndpointResolver, parse_endpoint_map
from pagoda.services.epp.ext_proc import ExternalProcessor
from pagoda.services.epp.metrics import EppMetrics
from pagoda.services.epp.picker import Pick, PickError
from pagoda.services.epp.server import parse_priorities


class FakeRoute:
    def __init__(self) -> None:
        self.prefill_done_calls = 0
        self.released = asyncio.Event()

    def prefill_done(self) -> None:
        self.prefill_done_calls += 1

    def release(self) -> None:
        self.released.set()


class FakePicker:
    """Records what it was asked; answers `endpoints` or raises `error`."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.endpoints = ["10.0.0.1:8000", "10.0.0.2:8000"]
        self.error: PickError | None = None
        self.routes: list[FakeRoute] = []

    async def pick(self, body, subset, sheddable):
        self.calls.append((body, subset, sheddable))
        if self.error is not None:
            raise self.error
        self.routes.append(FakeRoute())
        return Pick(self.routes[-1], list(self.endpoints))


def on_server(picker: FakePicker, scenario) -> object:
    """Run `scenario(address)` against an ext_proc server on loopback, both on one event
    loop (grpc.aio wants one loop per process), and return what it returned."""

    async def main():
        server = grpc.aio.server()
        metrics = EppMetrics("pool", lambda: [], lambda r: "")
        epb_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(picker, metrics, {"batch": -1}), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await scenario(f"127.0.0.1:{port}")
        finally:
            await server.stop(0)

    return asyncio.run(main())


async def exchange(address: str, body, **kwargs):
    async with grpc.aio.insecure_channel(address) as channel:
        answer = await ask(channel, body, **kwargs)
        if answer.status == 0:
            await served(answer, answer.endpoints[0])
        return answer


async def released(route: FakeRoute) -> bool:
    await asyncio.wait_for(route.released.wait(), 10)
    return True


def test_a_whole_exchange_in_chunks():
    picker = FakePicker()
    body = {"model": "m", "prompt": "x" * 1000, "max_tokens": 3}

    async def scenario(address):
        answer = await exchange(address, body, chunks=5,
                                subset=["10.0.0.2:8000", "10.0.0.1:8000"])
        return answer, await released(picker.routes[0])

    answer, was_released = on_server(picker, scenario)
    assert answer.header == answer.metadata == "10.0.0.1:8000,10.0.0.2:8000"
    assert json.loads(answer.body) == body
    ((parsed, subset, sheddable),) = picker.calls
    assert parsed.model == "m" and parsed.tokenize.prompt == "x" * 1000
    assert subset == ["10.0.0.2:8000", "10.0.0.1:8000"] and sheddable is False
    (route,) = picker.routes
    assert was_released and route.prefill_done_calls == 1


def test_no_subset_hint_is_none_and_objectives_decide_shedding():
    picker = FakePicker()

    async def scenario(address):
        for objective in ("batch", "other"):
            await exchange(address, {"prompt": [1, 2, 3]},
                           headers={"x-gateway-inference-objective": objective})

    on_server(picker, scenario)
    (first, _, shed_batch), (_, _, shed_other) = picker.calls
    assert first.tokenize.token_ids.token_ids == [1, 2, 3]
    assert shed_batch is True and shed_other is False
    assert picker.calls[0][1] is None


@pytest.mark.parametrize("status", [429, 503])
def test_picker_refusals_are_immediate_responses(status):
    picker = FakePicker()
    picker.error = PickError(status, "no")
    answer = on_server(picker, lambda address: exchange(address, {"prompt": "p"}))
    assert answer.status == status
    assert answer.error["error"]["code"] == status and answer.error["error"]["message"] == "no"


def test_a_bad_body_never_reaches_the_picker():
    picker = FakePicker()
    answer = on_server(picker, lambda address: exchange(address, b"[1, 2]"))
    assert answer.status == 400 and answer.error["error"]["type"] == "BadRequestError"
    assert picker.calls == []


def test_a_dropped_stream_releases_the_route():
    picker = FakePicker()

    async def drop(address):
        async with grpc.aio.insecure_channel(address) as channel:
            answer = await ask(channel, {"prompt": "p"})
            answer.call.cancel()  # the proxy gave up before the response
        return await released(picker.routes[0])

    assert on_server(picker, drop)


def test_a_bodyless_request_is_routed_at_its_headers():
    picker = FakePicker()

    async def get(address):
        async with grpc.aio.insecure_channel(address) as channel:
            call = epb_grpc.ExternalProcessorStub(channel).Process()
            headers = epb.HttpHeaders(end_of_stream=True)
            await call.write(epb.ProcessingRequest(request_headers=headers))
            reply = await call.read()
            await call.done_writing()
            return reply

    reply = on_server(picker, get)
    (option,) = reply.request_headers.response.header_mutation.set_headers
    assert option.header.raw_value == b"10.0.0.1:8000,10.0.0.2:8000"


@pytest.mark.parametrize("raw, param", [
    (b"{", None), (b'"text"', None), (b"{}", "prompt"), (b'{"prompt": []}', "prompt"),
    (b'{"prompt": [true]}', "prompt"), (b'{"prompt": "x", "cache_salt": 3}', "cache_salt"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages"),
])
def test_parse_body_names_the_field(raw, param):
    with pytest.raises(BadBody) as info:
        parse_body(raw)
    assert info.value.param == param


def test_parse_body_reads_every_prompt_form():
    assert parse_body(b'{"prompt": ["a", "b"]}').num_prompts == 2
    assert parse_body(b'{"prompt": [[1, 2], [3]]}').tokenize.token_ids.token_ids == [1, 2]
    chat = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    assert chat.tokenize.chat.messages[0].content == "hi"
    assert chat.tokenize.chat.add_generation_prompt and not chat.tokenize.add_special_tokens


def test_endpoints_and_flags():
    class Replica:
        address = "10.1.2.3:50052"

    assert EndpointResolver(8000).endpoint(Replica()) == "10.1.2.3:8000"
    mapping = parse_endpoint_map("10.1.2.3:50052=127.0.0.1:9000")
    assert EndpointResolver(8000, mapping).endpoint(Replica()) == "127.0.0.1:9000"
    with pytest.raises(ValueError, match="--endpoint-map"):
        parse_endpoint_map("10.1.2.3:50052")
    assert parse_priorities("batch=-1, chat=2") == {"batch": -1, "chat": 2}
    with pytest.raises(ValueError, match="--objective-priority"):
        parse_priorities("batch")
